"""An agent process hosting one or many devices.

Its devices, one or many, set up on a few threads, then wait as records in the agent's task
session (:mod:`device_agent.agent_tasks`): one held request for all of them, and a thread only for
a device that has a task. One device goes through the session too, not through its own task poll
(:meth:`device_agent.device.Device.run`, a device without an agent): the session is what tells a
device that the Fed Server closed its attempt without it (``ended``), so that a board whose link
slowed down stops a download nobody will train from rather than miss its next task too. Devices
with a task run at once: members of a Main Server group wait for each other at every step, so
training them one after another would deadlock the barrier.
"""
from __future__ import annotations

import functools
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from device_agent.agent_tasks import AgentTasks
from device_agent.api import AgentApi, SecureBatchApi
from device_agent.clients import HttpFedClient, main_connector
from device_agent.compute import compute_for
from device_agent.device import Device, RegistrationRefused
from device_agent.device_state import DeviceStates
from device_agent.run_spec import check_run, wait_for_run
from device_agent.weights_cache import WeightsCache
from device_agent.secure_batches import SecureBatches
from shared.data.local import DataError, LocalSource
from shared.machine import compute_workers
from shared.models import SplitModel
from shared.profiles import LINKS, TimeScale, kind_for
from shared.schemas import RunInfo

log = logging.getLogger("device_agent")

#: How long a stopping agent (Ctrl-C, SIGTERM) waits for its devices to end what they are doing:
#: short, as the process's exit with many device threads takes its own time on a loaded machine
#: and the whole stop must fit in 2 s.
STOP_WAIT_S = 0.5
#: Threads that set up an agent's devices (load the data, warm up, register): enough to overlap one
#: device's registration round trip with the next one's set-up, few enough to keep memory flat.
SETUP_THREADS = 8


class RunRefused(Exception):
    """The Fed Server's run is one this agent cannot train (:func:`device_agent.run_spec.check_run`):
    refused at start, before any of its devices registers."""


def parse_shards(text: str) -> list[int]:
    """``"0-3,7"`` -> ``[0, 1, 2, 3, 7]``."""
    shards: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            shards.extend(range(int(lo), int(hi) + 1))
        else:
            shards.append(int(part))
    if not shards or len(set(shards)) != len(shards) or min(shards) < 0:
        raise ValueError(f"bad shard list {text!r}: use e.g. 0-9 or 0,2,4 (distinct, non-negative)")
    return shards


def parse_data_args(pairs: list[str]) -> dict[str, str]:
    """``["root=/x", "n=3"]`` -> ``{"root": "/x", "n": "3"}``: the keywords a ``--data`` function gets."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"bad --data-arg {pair!r}: use KEY=VALUE with KEY a Python name")
        if key in out:
            raise ValueError(f"--data-arg {key} given twice")
        out[key] = value
    return out


def local_device_ids(sources: list[LocalSource], prefix: str, device_id: str | None = None) -> list[str]:
    """Ids of the devices of ``--data`` sources: ``--device-id`` for a single device, else
    ``<prefix>-<name>`` with the name's characters outside ``[A-Za-z0-9_.-]`` replaced by ``_``
    (64 characters at most). Two sources with the same id are refused."""
    if device_id is not None:
        if len(sources) != 1:
            raise ValueError(f"--device-id names one device, but --data gives {len(sources)}; use --prefix")
        ids = [device_id]
    else:
        ids = [f"{prefix}-{re.sub(r'[^A-Za-z0-9_.-]', '_', s.name)}"[:64] for s in sources]
    for i in ids:
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", i):
            raise ValueError(f"device id {i!r} is not allowed: 1-64 characters of A-Z a-z 0-9 _ . -")
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"two --data sources give the same device id {twice}; rename a file/folder or set --prefix")
    return ids


class Agent:
    """Runs its devices until the run is done (or ``stop`` is set).

    ``model``: the operator's ``--model`` (the only import path its devices will build).
    ``keep_models``: whether each device keeps its model between rounds (see :class:`Device`);
    ``keep_data``: its data between tasks (``None``: as it keeps its model).
    ``None`` (the default) keeps it only when the agent hosts one device: a real board avoids
    rebuilding its model every round, while an agent hosting 100 virtual VGG-16 devices would
    otherwise hold 100 model copies (about 14 GB) where 10 train at a time.
    ``torch_device``: where every device's model trains (``--torch-device``; default the CPU).
    ``compute_slots``: how many of the agent's threads run its devices' whole-model training
    (``--compute-slots``, :mod:`device_agent.compute`; split training computes on each device's
    own thread, see :func:`device_agent.trainer.train_round`). ``None`` (the default): one per core the
    agent may use given its torch threads (``--threads``, :func:`shared.machine.compute_workers`) when it hosts
    more devices than that, else 0; 0: each device computes on its own thread. With one torch
    thread, devices beyond the cores cannot compute sooner, but each one computing holds its
    training memory, and each thread that computes keeps an allocator arena of it: ten devices of
    the small cnn computing on their own threads held about 55 MiB each at the agent's peak
    (benchmarks/README.md, "Why the code is as it is"). A device never holds a compute thread while it sleeps an
    emulated kind's stretch.
    """

    def __init__(self, fed_server_url: str, shards: list[int], kinds: list[str] | None, time_scale: TimeScale = 1.0,
                 prefix: str = "dev", verify: bool | str = True, metrics=None,
                 enrolment_secret: bytes | None = None, keep_models: bool | None = None, keep_data: bool | None = None,
                 sources: list[LocalSource] | None = None, data_args: dict[str, str] | None = None,
                 device_id: str | None = None, torch_device: torch.device | None = None,
                 model: str | None = None, compute_slots: int | None = None, links: str = "emulated",
                 request_delay_s: float = 0.0, loss: str | None = None, state_dir: str | None = None) -> None:
        """Devices of ``shards`` (a built-in data set's partition) or, with ``sources`` (``--data``;
        then ``shards`` is empty), one device per local data source, named by :func:`local_device_ids`.
        ``model`` and ``loss``: the operator's ``--model`` and ``--loss`` (import paths the run may
        name). ``links``
        (``--links``): ``emulated``, the kinds' transfers are slept; ``real``, the kinds stretch
        compute only and the link is what it is (:data:`LINKS`). ``request_delay_s``: a delay
        before each request the devices send (``--request-delay-ms``, an emulated round trip).
        ``state_dir`` (``--state-dir``): where the devices' algorithm states wait between their
        rounds, surviving a restart of the agent; None: a temporary directory, removed when
        :meth:`run` ends (:mod:`device_agent.device_state`)."""
        if links not in LINKS:
            raise ValueError(f"links must be one of {', '.join(LINKS)}, got {links!r}")
        self.stop = threading.Event()
        self.fed_server_url = fed_server_url
        self.model = model
        self.loss = loss
        sources = sources or []
        count = len(sources) or len(shards)
        keep = count == 1 if keep_models is None else keep_models
        if compute_slots is None:
            workers = compute_workers()
            compute_slots = workers if count > workers else 0
        self.compute_slots = compute_slots
        self.compute = compute_for(compute_slots)
        # The weights tasks name, fetched once for all the devices they are named to.
        self.weights = WeightsCache()
        self.states = DeviceStates(state_dir)
        connect_main = main_connector(verify, request_delay_s)
        places: list[tuple[str, int | None, LocalSource | None, int]] = (
            [(i, None, s, n) for n, (i, s) in enumerate(zip(local_device_ids(sources, prefix, device_id), sources))]
            if sources else [(f"{prefix}-{shard:03d}", shard, None, shard) for shard in shards])
        self.devices = [
            Device(name, shard, HttpFedClient(fed_server_url, verify, enrolment_secret, request_delay_s=request_delay_s),
                   connect_main, kind_for(index, kinds) if kinds else None, time_scale, self.stop, keep_model=keep,
                   keep_data=keep_data, source=source, data_args=data_args, torch_device=torch_device, model_ref=model,
                   loss_ref=loss, compute=self.compute, weights_cache=self.weights, emulate_links=links == "emulated",
                   states=self.states)
            for name, shard, source, index in places
        ]
        # The session's client: the enrolment secret for its registration batches, no token of its
        # own (the devices' travel in its bodies) and no retries (the session sends a failed
        # request again itself, with its devices).
        self.tasks_fed: AgentApi = HttpFedClient(fed_server_url, verify, enrolment_secret, retries=0,
                                                 request_delay_s=request_delay_s)
        # The devices' secure aggregation batches' client (their tokens travel in its bodies too);
        # with the usual retries: every stage message and question may be sent again.
        self.secure_fed: SecureBatchApi = HttpFedClient(fed_server_url, verify, request_delay_s=request_delay_s)
        self.errors: dict[str, BaseException] = {}
        self._threads: list[threading.Thread] = []   # what a stopping agent waits for (:meth:`_start`)
        self.metrics = metrics  # device_agent.metrics.AgentMetrics or None (no --metrics-port)
        if metrics is not None:
            for device in self.devices:
                metrics.add_device(device.device_id)
                device.on_upload = metrics.observe_upload

    def _guarded(self, device: Device, step: Callable[[], None]) -> bool:
        """Run one device's ``step``; an error is recorded and logged (one line for the operator's
        data or configuration) and the agent's other devices go on. Returns whether it succeeded."""
        try:
            step()
            return True
        except BaseException as exc:
            self._failed(device, exc)
            return False

    def _failed(self, device: Device, exc: BaseException) -> None:
        self.errors[device.device_id] = exc
        if isinstance(exc, (DataError, RegistrationRefused)):
            log.error("%s: not registered: %s", device.device_id, exc)
        elif exc.__traceback__ is None:   # a refusal its session was told of, never raised: one line
            log.error("%s stopped: %s", device.device_id, exc)
        else:
            log.error("%s stopped with an error", device.device_id, exc_info=exc)

    def check_run(self) -> tuple[RunInfo, SplitModel]:
        """Wait for the Fed Server's run spec and refuse (:class:`RunRefused`) a run this agent
        cannot train, once for all its devices and before any registers: a device that joined
        it would fail every task it is given. Returns the spec and the model's checked layout,
        which the devices then start from (one layout for all: they only read it)."""
        info = wait_for_run(self.devices[0].fed, self.stop, f"the Fed Server at {self.fed_server_url}")
        try:
            return info, check_run(info, self.model, self.loss)
        except ValueError as exc:
            raise RunRefused(str(exc)) from None

    def run(self) -> int:
        """Stop at once each device whose ``--data`` was refused when it was listed
        (:attr:`LocalSource.refused`), check the run (:meth:`check_run`, which may raise
        :class:`RunRefused`), then run the other devices in the agent's task session until each has
        ended. The exit code: 2 if any device did not
        register because its data or the Fed Server refused it (a configuration problem, which a
        restart does not fix; the agent's other devices train on to the end), else 1 if any device
        failed, else 0."""
        for device in self.devices:
            if device.source is not None and device.source.refused is not None:
                self._failed(device, DataError(device.source.refused))
        devices = [device for device in self.devices if device.device_id not in self.errors]
        try:
            if not devices:
                return self._exit_code()
            info, layout = self.check_run()
            session = self._start_session(devices, info, layout)
            while not session.ended.wait(0.5):
                pass
        except KeyboardInterrupt:
            self.stop.set()
            self.compute.close()   # rounds waiting for a compute thread are not run
            # The devices end what they are doing now (a set-up step, a round already computing);
            # one waiting on the Fed Server (a long poll) is left to the process's exit.
            deadline = time.monotonic() + STOP_WAIT_S
            for thread in self._threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        finally:
            self.compute.close()
            self.states.close()
        return self._exit_code()

    def _exit_code(self) -> int:
        """:meth:`run`'s exit code from the devices' errors so far."""
        if any(isinstance(exc, (DataError, RegistrationRefused)) for exc in self.errors.values()):
            return 2
        return 1 if self.errors else 0

    def _start_session(self, devices: list[Device], info: RunInfo, layout: SplitModel) -> AgentTasks:
        """Set ``devices`` up on :data:`SETUP_THREADS` threads; the agent's session registers them
        in batches and runs their tasks."""
        session = AgentTasks(self.tasks_fed, devices, self.stop, self._failed)
        batches = SecureBatches(self.secure_fed)
        for device in devices:
            device.secure_channel = batches.channel(device)
        session.start()
        waiting = deque(devices)

        def set_up_each() -> None:
            while not self.stop.is_set():
                try:
                    device = waiting.popleft()
                except IndexError:
                    return
                if not self._guarded(device, functools.partial(device.setup, info, layout, register=False)):
                    session.end(device)   # its error is recorded
                elif not self.stop.is_set():
                    session.register(device)
        for index in range(min(SETUP_THREADS, len(devices))):
            self._start(f"set-up-{index}", set_up_each)
        return session

    def _start(self, name: str, target: Callable[..., object], *args: object) -> threading.Thread:
        """A daemon thread the agent waits for when it stops (:data:`STOP_WAIT_S`)."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread
