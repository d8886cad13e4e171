"""A device's model for the run: its checked meta layout, the real weights a task trains or
evaluates with, the weights a task names, and the per-process warm-up and speed measurement.

With ``keep_model`` (a real device) the model lives for the whole run and ends holding the final
global model. Without it (an agent hosting many virtual devices) a device holds real weights only
while a task uses them: each task materialises just the blocks it trains when its training starts
and frees them once it is done (:meth:`DeviceModel.task_scope`), so an agent's memory follows the
devices training at once rather than the devices it hosts.
"""
from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from device_agent.calibration import CALIBRATION_BATCH, training_flops
from device_agent.run_spec import build_run_model
from device_agent.weights_cache import FetchedWeights, WeightsCache
from shared.data import ArrayDataset
from shared.errors import Invalid
from shared.models import SplitModel
from shared.portions import decode_portion, load_portion
from shared.profiles import AUTO_TRANSFER_RATIO, SERVER_FLOPS, auto_time_scale
from shared.schemas import RunInfo, TaskResponse, WeightsId, WeightsResponse

log = logging.getLogger("device_agent")

# First-use costs (lazy imports, allocator, kernel selection) are per process, so one warm-up
# per model architecture serves every device of an agent.
_WARM_UP_LOCK = threading.Lock()
_WARMED_UP: set[tuple] = set()
# The host's measured training speed (FLOP/s) per model architecture, for ``time_scale: auto``:
# measured once per process, under the warm-up's lock, so no other device computes meanwhile.
_HOST_FLOPS: dict[tuple, float] = {}

#: Fetches named weights from the Fed Server for one device: (the answer, its body's size in bytes).
FetchWeights = Callable[[WeightsId], tuple[WeightsResponse, int]]


class DeviceModel:
    """The run's model on one device (see the module docstring).

    ``layout`` is the model's structure on the meta device (names, shapes, dtypes; no memory),
    against which every received portion is checked. ``torch_device`` (``--torch-device``) is
    where the real weights live and train. A task names its weights; ``weights_cache`` (one per
    agent, shared by its devices) fetches each named portion once, with ``fetch``, and holds it
    while a device uses it (:mod:`device_agent.weights_cache`).
    """

    def __init__(self, info: RunInfo, layout: SplitModel, keep_model: bool, torch_device: torch.device,
                 weights_cache: WeightsCache, fetch: FetchWeights) -> None:
        self.info = info
        self.layout = layout
        self.keep_model = keep_model
        self.torch_device = torch_device
        self.weights_cache = weights_cache
        self._fetch = fetch
        #: Real weights: for the whole run with ``keep_model``, else only while a task uses them.
        #: Built (and seeded) on the CPU, then moved: the same initial weights on every device.
        self.model: SplitModel | None = self.build().to(torch_device) if keep_model else None

    def build(self) -> SplitModel:
        """The run's model with real weights."""
        return build_run_model(self.info)

    def for_task(self) -> SplitModel:
        """The model to train or evaluate with. Without ``keep_model``, a fresh one on the meta
        device: the blocks a task uses are allocated when their weights are loaded into them
        (:func:`shared.portions.load_portion`), the others never are.

        The fresh one is a copy of the checked meta layout, not a new build: copying costs
        milliseconds (6 ms for vgg16 here, against 42 ms to build and check it again), and the
        user's model code runs once per device, not once per task."""
        if self.model is None:
            self.model = copy.deepcopy(self.layout)
        return self.model

    @contextmanager
    def task_scope(self) -> Iterator[None]:
        """One task's use of the model: without ``keep_model``, the model it built
        (:meth:`for_task`) is freed when the block ends, however it ends."""
        try:
            yield
        finally:
            if not self.keep_model:
                self.model = None

    def named_weights(self, task: TaskResponse) -> AbstractContextManager[FetchedWeights]:
        """The weights ``task`` names, fetched once for all the agent's devices it names them to,
        held until the ``with`` block ends."""
        weights_id = task.weights_id
        if weights_id is None:
            raise Invalid(f"a {task.status} task of round {task.round_id} names no weights")
        return self.weights_cache.use(weights_id, lambda: self._fetch(weights_id))

    def whole_model_of(self, task: TaskResponse) -> SplitModel:
        """The model to evaluate ``task``'s global weights with, holding them (within a
        :meth:`task_scope`)."""
        num_blocks = len(self.layout.blocks)
        with self.named_weights(task) as named:
            model = self.for_task()
            load_portion(model.portion(0, num_blocks), decode_portion(
                named.weights, self.layout, 0, num_blocks, what="evaluation weights"), self.torch_device)
        return model

    def load_final(self, task: TaskResponse) -> None:
        """Load the run's final global model, which ``task`` (the run's end) names, into the kept model."""
        assert self.model is not None
        with self.named_weights(task) as final:
            self.model.load_state_dict(decode_portion(final.weights, self.layout, 0, len(self.layout.blocks),
                                                      what="final weights"))

    def cpu_time(self) -> bool:
        """Whether compute is timed by the thread's CPU time: where it measures the work, a CPU
        device with one torch thread (see :class:`device_agent.timing.RoundClock`)."""
        return self.torch_device.type == "cpu" and torch.get_num_threads() == 1

    def warm_up(self, data: ArrayDataset) -> None:
        """One forward/backward pass and optimizer step on ``data`` before registering, so
        first-use costs (allocator, kernel selection, and about a second of lazy imports on the
        first optimizer PyTorch builds in a process) do not land in the first round and skew the
        time table. They are per process: the first device of an agent with this architecture pays them."""
        key = self._architecture()
        with _WARM_UP_LOCK:
            if key in _WARMED_UP:
                return
            model = self.model or self.build().to(self.torch_device)
            x = data.x[: min(8, len(data))].to(self.torch_device)
            model(x).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()  # lr 0: the weights stay as built
            model.zero_grad(set_to_none=True)
            _WARMED_UP.add(key)

    def host_flops(self, data: ArrayDataset) -> float:
        """This host's training speed on the run's model (FLOP/s), measured once per process on a
        model built for it, a batch of ``data`` and the clock its compute sections use."""
        key = self._architecture()
        with _WARM_UP_LOCK:
            if key not in _HOST_FLOPS:
                # A full batch even from a device with fewer samples (repeated): the same work
                # on every host, and a batch BatchNorm can train on.
                x = data.x[torch.arange(CALIBRATION_BATCH) % len(data)].to(self.torch_device)
                flops = training_flops(self.build().to(self.torch_device), x, self.cpu_time())
                _HOST_FLOPS[key] = flops
                log.info("time scale auto: this host trains %s at %.1f GFLOP/s (batch %d), so emulated transfers "
                         "are compressed %.1fx (%g x %.3g / %.3g FLOP/s)", self.info.model, flops / 1e9, len(x),
                         auto_time_scale(flops), AUTO_TRANSFER_RATIO, flops, SERVER_FLOPS)
            return _HOST_FLOPS[key]

    def _architecture(self) -> tuple:
        """What a process's warm-up and speed measurement are per: the run's model on this torch device."""
        info = self.info
        return info.model, info.num_classes, tuple(info.input_shape), str(self.torch_device)
