"""One (possibly virtual) device: registers, asks for tasks, trains, uploads. Only calls out.

The runner here knows nothing of HTTP: it talks to the two servers through the typed interfaces
of :mod:`device_agent.api` (HTTP implementations in :mod:`device_agent.clients`).
"""
from __future__ import annotations

import copy
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from pydantic import ValidationError

from device_agent.api import FedApi, MainApi, Unreachable
from device_agent.calibration import CALIBRATION_BATCH, training_flops
from device_agent.compute import Compute
from device_agent.timing import RoundClock
from device_agent.trainer import TaskExpired, steps_per_round, train_round
from device_agent.weights_cache import FetchedWeights, WeightsCache
from shared.algorithms.base import Payload, parse_payload
from shared.algorithms.registry import ALGORITHMS
from shared.data import ArrayDataset, device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.data.local import DataError, LocalSource
from shared.errors import Conflict, DomainError, Failed, Invalid, NotFound
from shared.evaluation import evaluation_counts
from shared.models import SplitModel, build_model, build_model_layout, check_model_origin, model_fingerprint
from shared.profiles import AUTO_TRANSFER_RATIO, SERVER_FLOPS, EmulatedKind, TimeScale, auto_time_scale
from shared.torch_device import synchronize
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, EvaluationReport, JoinRequest, RegisterRequest, ReportRequest, RunInfo, StepRequest,
    TaskResponse, UpdateRequest, WireTensor, WithdrawRequest,
)
from shared.portions import decode_portion, load_portion
from shared.wire import WireError, decode_tensor, encode_state, encode_tensor

log = logging.getLogger("device_agent")

#: Seconds a task without a deadline_s may take (the Fed Server's default round deadline).
TASK_DEADLINE_DEFAULT_S = 300.0

#: What a training task may fail with that is no fault of this process: a task it cannot build or
#: decode (Invalid; WireError: weights or a Main Server's gradient that do not decode; pydantic's
#: ValidationError: parameters the algorithm's device logic refuses, or an upload a diverged
#: training made invalid), a refusal by either server (a Main Server group that dropped the device
#: answers its join or step with 409 or 422), a server it cannot reach.
TASK_FAILURES: tuple[type[Exception], ...] = (DomainError, Unreachable, WireError, ValidationError)

#: The longest reason a withdrawal may give (``WithdrawRequest.reason``'s limit).
WITHDRAW_REASON_MAX: int = next(m.max_length for m in WithdrawRequest.model_fields["reason"].metadata
                                if hasattr(m, "max_length"))

#: How long a device's task request may wait at the Fed Server for work (long-poll): the task
#: arrives when the round opens, and an idle device asks about six times a minute.
TASK_WAIT_S = 10.0

# First-use costs (lazy imports, allocator, kernel selection) are per process, so one warm-up
# per model architecture serves every device of an agent.
_WARM_UP_LOCK = threading.Lock()
_WARMED_UP: set[tuple] = set()
# The host's measured training speed (FLOP/s) per model architecture, for ``time_scale: auto``:
# measured once per process, under the warm-up's lock, so no other device computes meanwhile.
_HOST_FLOPS: dict[tuple, float] = {}


def round_seed(seed: int, shard: int | str, round_id: int) -> int:
    """Per device and round batch-order seed, identical in every process (``shard``: the device's
    shard, or its id when it brings its own data)."""
    digest = hashlib.sha256(f"{seed}/{shard}/{round_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF


def build_run_model(info: RunInfo, layout: bool = False) -> SplitModel:
    """The run's model with real weights, or (``layout``) its structure on the meta device."""
    build = build_model_layout if layout else build_model
    return build(info.model, info.num_classes, tuple(info.input_shape), seed=info.seed, params=info.model_params)


def check_run(info: RunInfo, model_ref: str | None) -> SplitModel:
    """The run's model layout, once the run is known to be one this process can train: its
    algorithm is one it knows, and its model one it may build (an import path only when it is
    the operator's ``--model``, checked before anything is imported) and can. ValueError
    naming what is wrong otherwise."""
    if info.algorithm not in ALGORITHMS:
        raise ValueError(f"the run's algorithm {info.algorithm!r} is not one this agent knows "
                         f"({', '.join(ALGORITHMS)}): run an agent of the Fed Server's version")
    check_model_origin(info.model, model_ref)
    return build_run_model(info, layout=True)


def wait_for_run(fed: FedApi, stop: threading.Event, server: str) -> RunInfo:
    """The run spec, asked for until the Fed Server answers (or ``stop`` is set). Every second
    at most: an agent started beside its servers (the testbed starts them together) registers
    as soon as the Fed Server is up, not seconds later.

    ``server`` names the Fed Server in the log: one WARNING when it first does not answer, DEBUG
    for every later try, one INFO line once it answers, so an agent waiting for a server that is
    still starting says so once rather than once a try."""
    delay = 0.2
    waiting_since: float | None = None
    while True:
        try:
            info = fed.run_info()
        except Exception as exc:  # the Fed Server may still be starting
            if stop.is_set():
                raise
            reason = " ".join(str(exc).split()) or type(exc).__name__
            if waiting_since is None:
                waiting_since = time.monotonic()
                log.warning("waiting for %s: not reachable yet (%s); retrying", server, reason)
            else:
                log.debug("waiting for %s: still not reachable (%s)", server, reason)
            stop.wait(delay)
            delay = min(delay * 2, 1.0)
            continue
        if waiting_since is not None:
            log.info("%s is reachable (after %.1f s)", server, time.monotonic() - waiting_since)
        return info


class RegistrationRefused(Exception):
    """The run refuses a device's registration: the Fed Server refused it (a model fingerprint
    that differs from the run's, a shard that is held already, a sample count the run rules out, a
    credential that does not cover the device), or its shard is not one of the run's (checked
    before its data is loaded). A configuration problem, which retrying cannot fix."""


#: Opens a Main Server client for a task's URL, presenting the device's current token.
MainConnector = Callable[[str, str | None], MainApi]


class Device:
    """A device agent's unit of work: its shard, its model copy, its clients and its profile.

    ``shard`` is the partition shard it derives its data from; a device that brings its own data
    (``python -m device_agent --data``) has ``shard=None`` and a ``source`` instead, loaded with
    ``data_args`` (``--data-arg``), and gets a slot from the Fed Server when it registers.

    ``fed`` is this device's Fed Server client (it holds the device's enrolment secret and token);
    ``connect_main`` opens a Main Server client when a task names one.

    With ``keep_model`` (a real device) the model lives for the whole run and ends holding the
    final global model. Without it (an agent hosting many virtual devices) a device holds real
    weights only while it trains: each task materialises just the blocks it trains when its
    training starts and frees them once the upload is encoded, so an agent's memory follows the
    devices training at once rather than the devices it hosts. Nothing else changes: every task
    starts from all the weights it trains.

    A task names its weights; ``weights_cache`` (one per agent, shared by its devices) fetches
    each named portion once and holds it while a device uses it (:mod:`device_agent.weights_cache`).

    ``torch_device`` (``--torch-device``) is where the model's real weights live and train; the
    data set and the meta-device layout stay where they are (CPU, meta).
    """

    def __init__(self, device_id: str, shard: int | None, fed: FedApi, connect_main: MainConnector,
                 kind: EmulatedKind | None, time_scale: TimeScale = 1.0, stop: threading.Event | None = None,
                 poll_interval_s: float = 0.2, max_downtime_s: float = 600.0, keep_model: bool = True,
                 source: LocalSource | None = None, data_args: dict[str, str] | None = None,
                 torch_device: torch.device | None = None, model_ref: str | None = None,
                 compute: Compute | None = None, task_wait_s: float = TASK_WAIT_S,
                 weights_cache: WeightsCache | None = None, emulate_links: bool = True) -> None:
        if (shard is None) == (source is None):
            raise ValueError(f"{device_id}: a device holds either a shard or its own data source")
        self.device_id = device_id
        self.shard = shard
        self.source = source
        self.data_args = dict(data_args or {})
        self.kind = kind
        #: Whether an emulated kind's transfers are emulated too (sleeps for its rate), or only its
        #: compute, on a link that is really as slow as the kind (``--links real``).
        self.emulate_links = emulate_links
        #: The configured ``time_scale`` (a factor, or "auto") and the factor this device emulates
        #: transfers with (for "auto" resolved in :meth:`setup`, from the host's measured speed).
        self.time_scale_setting = time_scale
        self.time_scale = 1.0 if time_scale == "auto" else float(time_scale)
        self.stop = stop or threading.Event()
        self.poll_interval_s = poll_interval_s
        self.task_wait_s = task_wait_s
        self.max_downtime_s = max_downtime_s
        self.keep_model = keep_model
        self.torch_device = torch_device or torch.device("cpu")
        #: The operator's ``--model``: a run whose model is an import path is built only if it is this.
        self.model_ref = model_ref
        #: Where a whole-model round's training runs: the agent's compute threads, or (None) this
        #: device's own thread (``train_round``'s default).
        self.compute = compute
        self.weights_cache = weights_cache if weights_cache is not None else WeightsCache()
        self.token: str | None = None
        self.fed = fed
        self.connect_main = connect_main
        self.main: MainApi | None = None
        self.info: RunInfo | None = None
        #: The data this device trains on (and counts in ``num_samples``): with federated
        #: evaluation its data minus the held-out part, which it only evaluates on.
        self.data: ArrayDataset | None = None
        self.held_out: ArrayDataset | None = None
        #: Real weights: for the whole run with ``keep_model``, else only while a task trains.
        self.model: SplitModel | None = None
        #: The model's structure on the meta device (names, shapes, dtypes; no memory), against
        #: which every received portion is checked.
        self.layout: SplitModel | None = None
        self.rounds_done = 0
        #: Called after every successful upload with the body and the round's split point
        #: (the agent's optional metrics port uses it).
        self.on_upload: Callable[[UpdateRequest, int], None] | None = None

    # --- lifecycle ----------------------------------------------------------------------------
    def run(self, info: RunInfo | None = None) -> None:
        """Register, then train every round this device is given until the run is done.
        ``info``: the run spec, when the device's agent has asked for it already (:meth:`setup`).

        Survives server restarts: connection failures back off and retry (up to
        ``max_downtime_s`` without any answer), and a Fed Server that no longer knows the device
        (it restarted from its checkpoint) gets a new registration. A task that fails, for any
        reason, is given up (:meth:`_abandon`) and the device asks for its next one.
        """
        self.setup(info)
        down_since: float | None = None
        delay = self.poll_interval_s
        while not self.stop.is_set():
            try:
                asked_at = time.monotonic()
                task, size = self._poll(self.task_wait_s)
            except NotFound:  # the Fed Server restarted and forgot us
                log.info("%s: Fed Server does not know this device (restart?); registering again", self.device_id)
                self.register()
                continue
            except Unreachable as exc:
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > self.max_downtime_s:
                    raise
                log.info("%s: Fed Server unreachable (%s); retrying in %.1fs", self.device_id, exc, delay)
                self.stop.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            down_since, delay = None, self.poll_interval_s
            if task.status == "done":
                self._receive_final(task)
                return
            if task.status == "wait" or (task.status == "train" and task.phase != "train"):
                self._pause_after(task, asked_at, self.task_wait_s)
                continue
            try:
                if task.status == "evaluate":
                    self.run_evaluation(task)
                else:
                    self.run_task(task, size, time.monotonic())
            except Exception as exc:   # one task's failure, whatever it is, must not end the device
                self._abandon(task, exc)

    def _abandon(self, task: TaskResponse, exc: Exception) -> None:
        """Give up a task that failed and say why in one line; from a training task, withdraw,
        so its attempt need not wait for this device. The device then asks for its next task.

        An expected failure (:data:`TASK_FAILURES`) is one WARNING line. Anything else is a fault
        in this process (a bug, memory running out): an ERROR with its traceback, and the device
        is still withdrawn and goes on, since it keeps nothing of the failed task and one task's
        fault need not cost it every later round. Either way the agent's other devices go on. A
        task past its deadline (:class:`TaskExpired`) is not withdrawn: the Fed Server has closed
        its attempt already.
        """
        expected = isinstance(exc, (*TASK_FAILURES, TaskExpired))
        reason = " ".join(str(exc).split())   # one line: pydantic's messages span several
        if not expected:
            reason = f"{type(exc).__name__}: {reason}"
        # The attempt to withdraw from; none for an evaluation, an expired task or a malformed one.
        attempt = task.round_id if task.status == "train" and not isinstance(exc, TaskExpired) else None
        log.log(logging.WARNING if expected else logging.ERROR, "%s: %s %s abandoned%s: %s", self.device_id,
                "evaluation of attempt" if task.status == "evaluate" else "attempt", task.round_id,
                "" if attempt is None else ", withdrawing", reason, exc_info=not expected)
        if attempt is None:
            return
        try:
            self.fed.withdraw(WithdrawRequest(device_id=self.device_id, round_id=attempt,
                                              reason=reason[:WITHDRAW_REASON_MAX]))
        except (DomainError, Unreachable) as failed:   # best effort: the attempt's deadline ends it anyway
            log.warning("%s: attempt %d: withdrawal not taken: %s", self.device_id, attempt, failed)

    def _poll(self, wait_s: float) -> tuple[TaskResponse, int]:
        return self.fed.task(self.device_id, wait_s=wait_s)

    def _named_weights(self, task: TaskResponse) -> AbstractContextManager[FetchedWeights]:
        """The weights ``task`` names, fetched once for all the agent's devices it names them to,
        held until the ``with`` block ends."""
        weights_id = task.weights_id
        if weights_id is None:
            raise Invalid(f"a {task.status} task of round {task.round_id} names no weights")
        return self.weights_cache.use(weights_id, lambda: self.fed.weights(self.device_id, weights_id))

    def _pause_after(self, task: TaskResponse, asked_at: float, wait_s: float) -> None:
        """After an answer that is no task for now: ask again at once if the Fed Server held the
        request for the whole ``wait_s`` (it long-polls: work would have ended the wait), else
        (a server that answers at once) after its ``retry_after_s``."""
        if wait_s > 0 and time.monotonic() - asked_at >= wait_s:
            return
        self.stop.wait(self._retry_delay(task))

    def _retry_delay(self, task: TaskResponse) -> float:
        """The server's ``retry_after_s``, bounded below by this device's poll interval and above
        by 5 s so a confused server cannot park a device."""
        return min(max(task.retry_after_s, self.poll_interval_s), 5.0)

    def _receive_final(self, task: TaskResponse) -> None:
        """Load the run's final global model, on a device that keeps its model (a virtual device
        has no use for it, and does not fetch it)."""
        received = task.weights_id is not None and self.keep_model
        if received:
            assert self.layout is not None and self.model is not None
            try:
                with self._named_weights(task) as final:
                    self.model.load_state_dict(decode_portion(final.weights, self.layout, 0, len(self.layout.blocks),
                                                              what="final weights"))
            except (DomainError, Unreachable) as exc:   # the run is over either way: the device ends cleanly
                log.warning("%s: the final global model could not be fetched: %s", self.device_id, exc)
                received = False
        log.info("%s: run finished after %d rounds%s", self.device_id, self.rounds_done,
                 "; final global model received" if received else "")

    def setup(self, info: RunInfo | None = None) -> None:
        """Fetch the run spec (unless given ``info``: an agent waits for it once for all its
        devices), load and check this device's data, register with the Fed Server.

        Bad data stops here with a :class:`DataError`, before the device registers. A run this
        process cannot train (:func:`check_run`: an unknown algorithm, a model it may not or cannot
        build) stops the device here (ValueError), before anything is imported: code is never
        taken from the network."""
        self.info = info if info is not None else wait_for_run(self.fed, self.stop, f"the Fed Server of {self.device_id}")
        self.layout = check_run(self.info, self.model_ref)
        # The one place the device's data becomes its training set. Federated evaluation: split
        # once into the training part and the held-out part, before anything (registration,
        # warm-up, training) sees the data.
        self.data, self.held_out = evaluation_holdout(self._load_data(), self.info.holdout, self.info.seed,
                                                      self.device_id)
        if self.keep_model:
            # Built (and seeded) on the CPU, then moved: the same initial weights on every device.
            self.model = self._build().to(self.torch_device)
        self._warm_up()
        self._resolve_time_scale()
        self._profile = self.profile()
        self.register()

    def _load_data(self) -> ArrayDataset:
        """This device's samples: its shard of the run's data set, or its own files (``--data``)."""
        assert self.info is not None
        spec = self.info.data
        if self.source is not None:
            return self.source.load(spec, self.data_args)
        if spec.dataset == "local":
            raise DataError(f"{self.device_id}: the run uses the devices' own data (dataset 'local'); start the "
                            f"agent with --data PATH instead of --shards")
        assert self.shard is not None
        if not 0 <= self.shard < spec.num_devices:
            raise RegistrationRefused(f"shard {self.shard} does not exist: the run has {spec.num_devices} shards "
                                      f"(0..{spec.num_devices - 1})")
        train, _ = load_dataset(spec)
        return device_shard(spec, train, self.shard)

    def _build(self) -> SplitModel:
        """The run's model with real weights."""
        assert self.info is not None
        return build_run_model(self.info)

    def _model_for(self) -> SplitModel:
        """The model to train or evaluate with. Without ``keep_model``, a fresh one on the meta
        device: the blocks a task uses are allocated when their weights are loaded into them
        (:func:`shared.portions.load_portion`), the others never are.

        The fresh one is a copy of the checked meta layout, not a new build: copying costs
        milliseconds (6 ms for vgg16 here, against 42 ms to build and check it again), and the
        user's model code runs once per device, not once per task."""
        if self.model is None:
            assert self.layout is not None
            self.model = copy.deepcopy(self.layout)
        return self.model

    def register(self) -> None:
        """Announce this device, its shard, its profile and its model's fingerprint to the Fed
        Server, and its label counts when the run asks for them (several Main Server replicas). A fingerprint that differs from the run's is refused (Conflict): the device stops
        rather than train on another model: every refusal stops the device (:class:`RegistrationRefused`)."""
        assert self.data is not None and self.layout is not None and self.info is not None
        request = RegisterRequest(device_id=self.device_id, shard=self.shard, num_samples=len(self.data),
                                  profile=self._profile, fingerprint=model_fingerprint(self.layout, self.info.data),
                                  label_counts=self.data.label_counts().tolist()
                                  if self.info.label_counts_at_registration else None)
        try:
            answer = self.fed.register(request)
        except DomainError as exc:
            if isinstance(exc, Failed):   # the server's own fault, not a refusal
                raise
            raise RegistrationRefused(f"refused by the Fed Server: {exc}") from None
        self.token = answer.token
        self._drop_main()  # the next task's Main Server client presents the new token
        log.info("%s: registered %s %d (%d samples, %s)", self.device_id, "shard" if self.source is None else "slot",
                 answer.shard, len(self.data), self._profile.kind)

    def _drop_main(self) -> None:
        if self.main is not None:
            self.main.close()
            self.main = None

    def _warm_up(self) -> None:
        """One forward/backward pass and optimizer step before registering, so first-use costs
        (allocator, kernel selection, and about a second of lazy imports on the first optimizer
        PyTorch builds in a process) do not land in the first round and skew the time table.
        They are per process: the first device of an agent with this architecture pays them."""
        assert self.info is not None and self.data is not None
        key = self._architecture()
        with _WARM_UP_LOCK:
            if key in _WARMED_UP:
                return
            model = self.model or self._build().to(self.torch_device)
            x = self.data.x[: min(8, len(self.data))].to(self.torch_device)
            model(x).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.0).step()  # lr 0: the weights stay as built
            model.zero_grad(set_to_none=True)
            _WARMED_UP.add(key)

    def _architecture(self) -> tuple:
        """What a process's warm-up and speed measurement are per: the run's model on this torch device."""
        assert self.info is not None
        return self.info.model, self.info.num_classes, tuple(self.info.input_shape), str(self.torch_device)

    def _resolve_time_scale(self) -> None:
        """``time_scale: auto`` on an emulated device: compress transfers by
        :func:`shared.profiles.auto_time_scale` of the host's measured speed, before the device
        reports its (compressed) rate. A factor given as a number is used as it is; a real device
        emulates nothing and measures nothing."""
        if self.kind is not None and self.time_scale_setting == "auto":
            self.time_scale = auto_time_scale(self._host_flops())

    def _cpu_time(self) -> bool:
        """Whether compute is timed by the thread's CPU time: where it measures the work, a CPU
        device with one torch thread (see :class:`RoundClock`)."""
        return self.torch_device.type == "cpu" and torch.get_num_threads() == 1

    def _host_flops(self) -> float:
        """This host's training speed on the run's model (FLOP/s), measured once per process on a
        model built for it, a batch of this device's data and the clock its compute sections use."""
        assert self.info is not None and self.data is not None
        key = self._architecture()
        with _WARM_UP_LOCK:
            if key not in _HOST_FLOPS:
                # A full batch even from a device with fewer samples (repeated): the same work
                # on every host, and a batch BatchNorm can train on.
                x = self.data.x[torch.arange(CALIBRATION_BATCH) % len(self.data)].to(self.torch_device)
                flops = training_flops(self._build().to(self.torch_device), x, self._cpu_time())
                _HOST_FLOPS[key] = flops
                log.info("time scale auto: this host trains %s at %.1f GFLOP/s (batch %d), so emulated transfers "
                         "are compressed %.1fx (%g x %.3g / %.3g FLOP/s)", self.info.model, flops / 1e9, len(x),
                         auto_time_scale(flops), AUTO_TRANSFER_RATIO, flops, SERVER_FLOPS)
            return _HOST_FLOPS[key]

    def profile(self) -> DeviceProfileMsg:
        """Nominal speed of an emulated kind, or a quick measurement on a real device (on the
        torch device it trains on). The rate is the emulated link's; a real link's is not known
        before it has carried a round (``rate`` None): the Fed Server measures it from the device's
        timed transfers (docs/s2fl.md, "The client time table")."""
        if self.kind is not None:
            return DeviceProfileMsg(kind=self.kind.name, flops=self.kind.flops,
                                    rate=self.kind.rate * self.time_scale if self.emulate_links else None)
        a = torch.randn(256, 256, device=self.torch_device)
        synchronize(self.torch_device)
        t0 = time.perf_counter()
        for _ in range(20):
            a @ a
        synchronize(self.torch_device)
        flops = 20 * 2 * 256 ** 3 / max(1e-9, time.perf_counter() - t0)
        return DeviceProfileMsg(kind="native", flops=flops, rate=None)

    # --- one round ----------------------------------------------------------------------------
    def run_task(self, task: TaskResponse, task_bytes: int, received_at: float) -> None:
        """Train the task's portion, report and follow up if the algorithm asks, and upload.

        ``received_at`` is the ``time.monotonic()`` at which the task arrived: its ``deadline_s``
        (what remained of the attempt when the Fed Server answered, which may have held the
        request for a while) counts from there, and past it the Fed Server has closed the attempt,
        so the device gives the task up (:class:`TaskExpired`). The Fed Server's own deadline is
        the one that counts; this one only spares the device work nobody will take.
        """
        try:
            body = self._train(task, task_bytes, received_at)
        finally:
            if not self.keep_model:
                self.model = None
        # Uploaded after the model is freed: its weights are in the body now, and the upload may
        # wait on a Fed Server that is busy with the other devices' uploads.
        self.fed.upload(body)
        spent_s = time.monotonic() - received_at
        self.rounds_done += 1
        assert task.split_point is not None
        if self.on_upload is not None:
            try:
                self.on_upload(body, task.split_point)
            except Exception:  # observability must never break training
                log.debug("%s: on_upload hook failed", self.device_id, exc_info=True)
        log.info("%s: round %d done (split %d, %d steps, loss %.3f, spent %.2fs, %.2fs waiting)", self.device_id,
                 task.round_id, task.split_point, body.steps, body.train_loss, spent_s, body.timings.wait_s)

    def run_evaluation(self, task: TaskResponse) -> None:
        """Federated evaluation: run the task's global model on the held-out part and report the
        counts. A device that held nothing out reports zero samples, so the round need not wait
        for it (it sends no figures)."""
        assert self.layout is not None and task.round_id is not None
        held_out = self.held_out
        correct, loss_sum, n = 0, 0.0, 0
        if held_out is not None and len(held_out) > 0:
            num_blocks = len(self.layout.blocks)
            try:
                with self._named_weights(task) as named:
                    model = self._model_for()
                    load_portion(model.portion(0, num_blocks), decode_portion(
                        named.weights, self.layout, 0, num_blocks, what="evaluation weights"), self.torch_device)
                correct, loss_sum = evaluation_counts(model, held_out)
                n = len(held_out)
            finally:
                if not self.keep_model:
                    self.model = None
        self.fed.evaluation(EvaluationReport(device_id=self.device_id, round_id=task.round_id, num_samples=n,
                                             correct=correct, loss_sum=loss_sum))
        log.info("%s: evaluated round %d on %d held-out samples (%d correct)", self.device_id, task.round_id, n, correct)

    def _train(self, task: TaskResponse, task_bytes: int, received_at: float) -> UpdateRequest:
        """Train the task and return the upload (the model, the decoded weights and the
        training's other objects are freed when this returns)."""
        assert self.layout is not None and self.data is not None and self.info is not None
        deadline = received_at + (task.deadline_s or TASK_DEADLINE_DEFAULT_S)
        clock = RoundClock(self.kind, self.time_scale, cpu_time=self._cpu_time(), emulate_links=self.emulate_links)
        train = task.train
        if train is None or task.round_id is None or task.split_point is None:
            raise Invalid("a training task must name its round_id, split_point and train settings")
        algorithm = ALGORITHMS.get(task.algorithm or "fedavg")
        if algorithm is None:
            raise Invalid(f"the task's algorithm {task.algorithm!r} is not one this agent knows "
                          f"({', '.join(ALGORITHMS)})")
        logic = algorithm.device_logic(dict(task.params))   # pydantic's ValidationError for refused params
        extras = parse_payload(algorithm.TaskExtras, task.extras, "task extras")
        if time.monotonic() > deadline:   # a stalled device: its weights may no longer be served either
            raise TaskExpired("deadline passed before the task started")
        fetch_started = time.monotonic()
        with self._named_weights(task) as named:
            # Charged whether this device fetched them or another device of its agent did: an
            # emulated device downloads its task's weights itself. The measured part is the time
            # this device waited for them (the task itself came with a long poll, untimed).
            clock.transfer(task_bytes + named.size, time.monotonic() - fetch_started)
            # Decoded, they view the fetched body, which the agent's devices share: each device
            # copies them into its own model when its training starts (train_round), so a device
            # waiting for a compute thread holds no copy of its own.
            weights = decode_portion(named.weights, self.layout, 0, task.split_point, what="task weights")
            model = self._model_for()
            send_step = None
            main_bytes_before = (0, 0)
            if task.main_server_url is not None:
                if self.main is None or self.main.url != task.main_server_url.rstrip("/"):
                    self._drop_main()
                    self.main = self.connect_main(task.main_server_url, self.token)
                main_bytes_before = (self.main.bytes_up, self.main.bytes_down)
                send_step = self._join(task, clock)
            result = train_round(
                model, task.split_point, weights, self.data, train.lr, train.momentum, train.weight_decay,
                train.batch_size, train.local_epochs,
                round_seed(self.info.seed, self.device_id if self.shard is None else self.shard, task.round_id), clock,
                send_step, task.half_precision, logic=logic, extras=extras, deadline=deadline,
                compute=self.compute, torch_device=self.torch_device,
            )
            # Both view the shared body: dropped here, they do not keep it alive through the
            # upload once the agent's last device has let it go (``as`` names outlive the block).
            del weights, named
        portion = model.portion(0, task.split_point)
        if task.report:
            self._report_and_follow_up(task, algorithm.FollowUp, logic, portion, clock, deadline)
        state = portion.state_dict()  # detached views: encoding below copies them into the body
        # The upload's emulated transfer is charged before it is sent (its timings travel inside
        # it), sized by its tensor payload, which is all but a few hundred bytes of the body.
        clock.transfer(sum(t.numel() * t.element_size() for t in state.values()))
        return UpdateRequest(
            device_id=self.device_id, round_id=task.round_id, num_samples=len(self.data), steps=result.steps,
            train_loss=result.train_loss, weights=encode_state(state),
            timings=DeviceTimings(compute_s=clock.compute_s, transfer_s=clock.transfer_s, wait_s=clock.wait_s,
                                  server_s=clock.server_s, total_s=clock.total()),
            bytes_up=(self.main.bytes_up - main_bytes_before[0]) if self.main and send_step else 0,
            bytes_down=(self.main.bytes_down - main_bytes_before[1]) if self.main and send_step else 0,
            extras=logic.upload_extras(portion, self.data).to_wire(),
        )

    def _report_and_follow_up(self, task: TaskResponse, follow_up_model: type[Payload], logic, portion,
                              clock: RoundClock, deadline: float) -> None:
        """Two-phase algorithms: send the report, wait for this round's follow-up, validate it as
        ``follow_up_model`` (the algorithm's ``FollowUp``) and act on it."""
        assert self.data is not None and task.round_id is not None
        with clock.compute():
            extras = logic.report(portion, self.data).to_wire()
        report = ReportRequest(device_id=self.device_id, round_id=task.round_id, extras=extras)
        self.fed.report(report)
        t0 = time.monotonic()
        while True:
            asked_at = time.monotonic()
            wait_s = min(self.task_wait_s, max(0.0, deadline - asked_at))
            follow, size = self._poll(wait_s)
            if follow.status == "train" and follow.phase == "follow_up" and follow.round_id == task.round_id:
                break
            if follow.status == "done" or (follow.round_id is not None and follow.round_id != task.round_id) \
                    or time.monotonic() > deadline or self.stop.is_set():
                raise Conflict(f"no follow-up for round {task.round_id}")
            self._pause_after(follow, asked_at, wait_s)
        clock.wait_s += time.monotonic() - t0  # waiting for the other devices' reports
        clock.transfer(size)
        with clock.compute():
            logic.follow_up(portion, self.data, parse_payload(follow_up_model, follow.extras, "follow-up"))

    def _join(self, task: TaskResponse, clock: RoundClock):
        """Join the round at the Main Server; return the per-step exchange function."""
        assert self.main is not None and self.data is not None and task.train is not None and task.round_id is not None
        main = self.main
        round_id = task.round_id
        num_steps = steps_per_round(len(self.data), task.train.batch_size, task.train.local_epochs)
        join = JoinRequest(device_id=self.device_id, label_counts=self.data.label_counts().tolist(), num_steps=num_steps)
        t0 = time.monotonic()
        before = main.bytes_up + main.bytes_down
        timeout = (task.deadline_s or TASK_DEADLINE_DEFAULT_S) + 5
        main.join(round_id, join, timeout)
        clock.transfer(main.bytes_up + main.bytes_down - before, 0.0)
        clock.wait_s += time.monotonic() - t0  # waiting for the other participants to join

        def send_step(step: int, fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
            req = StepRequest(device_id=self.device_id, step=step, fx=WireTensor(**encode_tensor(fx)),
                              labels=WireTensor(**encode_tensor(labels)))
            before = main.bytes_up + main.bytes_down
            t0 = time.monotonic()
            resp = main.step(round_id, req, timeout)
            elapsed = time.monotonic() - t0
            clock.server_time(resp.wait_s, resp.server_s)
            clock.transfer(main.bytes_up + main.bytes_down - before, elapsed - resp.wait_s - resp.server_s)
            dfx = decode_tensor(resp.dfx, expect_shape=tuple(fx.shape), what="dfx")
            return dfx, resp.loss

        return send_step
