"""A device's local training for one round: split mode (through the Main Server) or whole model."""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from device_agent.compute import Compute, InlineCompute
from device_agent.timing import RoundClock
from shared.algorithms.base import DeviceLogic, Payload
from shared.data import ArrayDataset
from shared.models import SplitModel
from shared.portions import load_portion
from shared.torch_device import model_device, synchronize

#: Sends (step, fx, labels) to the Main Server and returns (dfx, server-reported loss).
StepFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]


class TaskExpired(Exception):
    """The task's deadline passed before training finished: the Fed Server has closed that
    attempt, so finishing it would only load the machine and upload a stale model."""


@dataclass
class LocalResult:
    """What a round's training gives besides the weights, which stay in the model (the device
    uploads its portion's ``state_dict`` after any follow-up)."""

    steps: int
    train_loss: float


def batches(data: ArrayDataset, batch_size: int, epochs: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches over ``epochs`` passes, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=gen)
        for start in range(0, len(data), batch_size):
            idx = order[start:start + batch_size]
            yield data.x[idx], data.y[idx]


def steps_per_round(num_samples: int, batch_size: int, epochs: int) -> int:
    return epochs * math.ceil(num_samples / batch_size)


def train_round(
    model: SplitModel,
    split_point: int,
    weights: dict[str, torch.Tensor] | None,
    data: ArrayDataset,
    lr: float,
    momentum: float,
    weight_decay: float,
    batch_size: int,
    epochs: int,
    seed: int,
    clock: RoundClock,
    send_step: StepFn | None,
    half_precision: bool = False,
    logic: DeviceLogic | None = None,
    extras: Payload | None = None,
    deadline: float | None = None,
    compute: Compute | None = None,
    torch_device: torch.device | None = None,
) -> LocalResult:
    """Train blocks[:split_point] of ``model`` in place for one round, on the device its trained
    blocks live on (``--torch-device``; the weights are copied there). ``weights``: the round's
    starting weights, loaded when the training starts (on a compute thread, for a whole-model
    round); blocks still on the meta device (a virtual device's model, built per task) are
    allocated on ``torch_device`` (default the CPU) first. ``weights`` None: the portion already
    holds them.

    With ``send_step`` (split mode) each step sends the cut's activations and labels to the Main
    Server and backpropagates the returned dfx; without it the device holds the whole model and
    trains on the algorithm's local objective (``logic.loss``; cross-entropy by default).
    ``deadline`` (a ``time.monotonic()`` instant) is checked before every step: past it the
    round is given up with :class:`TaskExpired`. ``compute`` (the agent's compute threads, see
    :mod:`device_agent.compute`; none: this thread) runs the whole local training when there is
    no Main Server, as one section; an emulated kind's stretch sleeps after it, on this thread.
    Split mode computes on this thread: its forward and backward sections are short and each
    waits for the Main Server in between, and queueing them on the compute threads changed the
    emulated times the sliding split is decided on (measured: the default S2FL run's median rule
    then put every device at split 1 from round 7 on; benchmarks/README.md, "Measured and not
    adopted"). ``extras`` are the task's validated
    ``Algorithm.TaskExtras`` for ``logic.begin_round`` (none: the empty payload).

    The data set stays on the CPU and each batch is moved to the device after it is drawn, so
    the seeded batch order is the same on every device. Activations go back to the CPU (in
    half precision first when asked, halving the copy) for the wire; dfx comes to the device.
    """
    logic = logic or DeviceLogic({})
    portion = model.portion(0, split_point)
    compute = compute if compute is not None else InlineCompute()
    losses: list[float] = []
    steps = 0

    def start() -> tuple[torch.optim.Optimizer, ArrayDataset, torch.device]:
        # Where the training runs (a compute thread, for a whole-model round): a device waiting
        # for its turn holds no weights of its own, only the task's, which its agent's devices
        # share (device_agent/weights_cache.py).
        if weights is not None:
            load_portion(portion, weights, torch_device)
        logic.begin_round(portion, extras if extras is not None else Payload(), data)
        portion.train()
        optimizer = torch.optim.SGD(portion.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        return optimizer, logic.training_data(data), model_device(portion)

    def check_deadline(owed_s: float = 0.0) -> None:
        if deadline is not None and time.monotonic() + owed_s > deadline:
            raise TaskExpired(f"deadline passed after {steps} steps")

    if send_step is None:
        # The whole local training is one section: nothing in it waits for anyone else. An
        # emulated kind's stretch is slept once the section is done, so the deadline is checked
        # against the time the device will have taken, stretch included.
        def local_training() -> None:
            nonlocal steps
            t0, cpu0 = time.monotonic(), time.thread_time()
            optimizer, train_data, device = start()
            for x, y in batches(train_data, batch_size, epochs, seed):
                check_deadline(clock.stretch_of(time.monotonic() - t0, time.thread_time() - cpu0))
                loss = logic.loss(portion, x.to(device), y.to(device))  # .to: no copy on the CPU
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(float(loss.detach()))  # waits for CUDA/MPS: the clock sees the compute
                steps += 1
            optimizer.zero_grad(set_to_none=True)  # the last step's gradients: as big as the weights
        # Its size for the queue: the device's samples, times an emulated kind's stretch (a Low
        # device sleeps 10x its compute afterwards, so it is the round's longest and goes first).
        # The samples of the shard, not of the algorithm's training part, which is known only
        # once the round has begun in the section (FedBC holds the same fraction back everywhere).
        clock.section(compute, local_training, work=len(data) * epochs * clock.stretch_factor())
    else:
        # Split mode computes on this thread: a step's sections are short and interleaved with the
        # Main Server's answers (see the docstring).
        optimizer, train_data, device = start()
        for step, (x, y) in enumerate(batches(train_data, batch_size, epochs, seed)):
            check_deadline()
            with clock.compute():
                fx = portion(x.to(device))  # .to: no copy on the CPU
                synchronize(device)
            sent = fx.detach().half() if half_precision else fx.detach()
            dfx, loss_value = send_step(step, sent.cpu(), y)
            with clock.compute():
                optimizer.zero_grad(set_to_none=True)
                fx.backward(dfx.to(device=fx.device, dtype=fx.dtype))
                optimizer.step()
                synchronize(device)  # CUDA/MPS run asynchronously: the clock must see the compute
            losses.append(loss_value)
            steps += 1
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients: as big as the weights
    return LocalResult(steps=steps, train_loss=sum(losses) / max(1, len(losses)))
