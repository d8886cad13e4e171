"""How fast this host trains the run's model: what ``--time-scale auto`` scales emulated transfers by.

An emulated device stretches its measured compute as if this machine were the paper's 5e10 FLOP/s
server (:mod:`shared.profiles`), so emulated compute is faster the faster the host is, while the
emulated transfer delays are fixed by ``time_scale``. Measuring the host's training speed lets the
agent pick a ``time_scale`` that keeps the two in the same proportion on any host
(:func:`shared.profiles.auto_time_scale`).
"""
from __future__ import annotations

import statistics
import threading
import time

import torch

from shared.models import SplitModel, profile_model
from shared.torch_device import synchronize

#: Samples in a measured batch: the testbed's default batch size. Speed per FLOP varies a little
#: with the batch; a task's batch size is not known before the device registers.
CALIBRATION_BATCH = 32

_MATMUL_LOCK = threading.Lock()
_MATMUL_FLOPS: dict[str, float] = {}


def matmul_flops(device: torch.device) -> float:
    """FLOP/s of a 256x256 matrix product on ``device``: a real device's nominal speed, measured
    once per process and torch device, since the agent's devices share the host.

    Measured per device, it cost each of an agent's virtual devices about 17 ms of set-up and
    its thread several MiB of memory it kept while idle (the math library's and allocator's
    buffers of a thread that computed once)."""
    with _MATMUL_LOCK:
        if str(device) not in _MATMUL_FLOPS:
            a = torch.randn(256, 256, device=device)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(20):
                a @ a
            synchronize(device)
            _MATMUL_FLOPS[str(device)] = 20 * 2 * 256 ** 3 / max(1e-9, time.perf_counter() - t0)
        return _MATMUL_FLOPS[str(device)]


def training_flops(model: SplitModel, x: torch.Tensor, cpu_time: bool, min_steps: int = 3, max_steps: int = 20,
                   budget_s: float = 0.5) -> float:
    """FLOP/s this host reaches training ``model`` (forward, backward, optimizer step) on batch ``x``.

    The FLOPs are the model's counted forward+backward FLOPs per sample (:func:`profile_model`)
    times the batch; the time is the median of ``min_steps`` to ``max_steps`` steps (as many as
    fit in ``budget_s``), after one untimed step that pays first-use costs. ``cpu_time``: time
    the calling thread's CPU (``time.thread_time``), as an emulated device's compute sections are
    timed with one torch thread on the CPU (:class:`device_agent.timing.RoundClock`), else wall
    time. The optimizer's learning rate is 0, but BatchNorm statistics move: measure a model built
    for this, not one that trains.
    """
    flops = profile_model(model).total_flops * len(x)
    if not flops > 0:
        raise ValueError("the model has no counted FLOPs (convolutions, matrix products) to measure this host's "
                         "speed with for time scale auto: give --time-scale (devices.time_scale) a number")
    device = x.device
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    clock = time.thread_time if cpu_time else time.perf_counter

    def step() -> float:
        t0 = clock()
        model(x).sum().backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        synchronize(device)
        return clock() - t0

    step()
    times: list[float] = []
    while len(times) < min_steps or (len(times) < max_steps and sum(times) < budget_s):
        times.append(step())
    return flops / max(statistics.median(times), 1e-9)
