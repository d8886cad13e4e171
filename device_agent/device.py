"""One (possibly virtual) device: registers, asks for tasks, trains, uploads. Only calls out.

This module is the device's lifecycle and task loop. Each job it hands off has its own module:
the run it joins (:mod:`device_agent.run_spec`), its model and the weights a task names
(:mod:`device_agent.device_model`), a training task up to its upload
(:mod:`device_agent.task_training`, over :mod:`device_agent.trainer` and the Main Server's
:mod:`device_agent.step_exchange`), and what it sends back once a task is over
(:mod:`device_agent.reports`). None of them knows HTTP: the device talks to the two servers
through the typed interfaces of :mod:`device_agent.api` (HTTP implementations in
:mod:`device_agent.clients`).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import torch

from device_agent.api import FedApi, SecureChannel, Unreachable
from device_agent.calibration import matmul_flops
from device_agent.compute import Compute
from device_agent.device_model import DeviceModel
from device_agent.device_state import DeviceStates
from device_agent.reports import UploadHook, abandon, report_evaluation, upload
from device_agent.run_spec import check_run, wait_for_run
from device_agent.step_exchange import MainConnector, MainLink
from device_agent.task_expired import TaskExpired
from device_agent.task_poll import TaskPoller
from device_agent.task_training import TaskTrainer
from device_agent.timing import RoundClock
from device_agent.weights_cache import WeightsCache
from shared.data import ArrayDataset, device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.data.local import DataError, LocalSource
from shared.algorithms.registry import build_privacy_defences
from shared.errors import DomainError, Failed, NotFound, TooSoon
from shared.http_client import Cancellation
from shared.label_counts import reported_label_counts
from shared.losses import Loss, build_loss
from shared.models import SplitModel, model_fingerprint
from shared.profiles import EmulatedKind, TimeScale, auto_time_scale
from shared.schemas import DeviceProfileMsg, RegisterRequest, RegisterResponse, RunInfo, TaskResponse

log = logging.getLogger("device_agent")

#: How long a device's task request may wait at the Fed Server for work (long-poll): the task
#: arrives when the round opens, and an idle device asks about six times a minute.
TASK_WAIT_S = 10.0


class RegistrationRefused(Exception):
    """The run refuses a device's registration: the Fed Server refused it (a model fingerprint
    that differs from the run's, a shard that is held already, a sample count the run rules out, a
    credential that does not cover the device), or its shard is not one of the run's (checked
    before its data is loaded). A configuration problem, which retrying cannot fix."""


def registration_error(exc: DomainError) -> Exception:
    """What a registration the Fed Server did not take means for the device: its own fault
    (:class:`Failed`) as it is, anything else a refusal (:class:`RegistrationRefused`)."""
    return exc if isinstance(exc, Failed) else RegistrationRefused(f"refused by the Fed Server: {exc}")


class Device:
    """A device agent's unit of work: its shard, its model copy, its clients and its profile.

    ``shard`` is the partition shard it derives its data from; a device that brings its own data
    (``python -m device_agent --data``) has ``shard=None`` and a ``source`` instead, loaded with
    ``data_args`` (``--data-arg``), and gets a slot from the Fed Server when it registers.

    ``fed`` is this device's Fed Server client (it holds the device's enrolment secret and token);
    ``connect_main`` opens a Main Server client when a task names one.

    With ``keep_model`` (a real device) the model lives for the whole run and ends holding the
    final global model; without it (an agent hosting many virtual devices) a device holds real
    weights only while a task uses them (:mod:`device_agent.device_model`). Nothing else changes:
    every task starts from all the weights it trains.

    A task names its weights; ``weights_cache`` (one per agent, shared by its devices) fetches
    each named portion once and holds it while a device uses it (:mod:`device_agent.weights_cache`).
    ``states`` (one per agent) holds what the algorithm's device logic keeps between the device's
    rounds, on disk (:mod:`device_agent.device_state`); None: a temporary one of its own.

    ``torch_device`` (``--torch-device``) is where the model's real weights live and train; the
    data set and the meta-device layout stay where they are (CPU, meta).
    """

    def __init__(self, device_id: str, shard: int | None, fed: FedApi, connect_main: MainConnector,
                 kind: EmulatedKind | None, time_scale: TimeScale = 1.0, stop: threading.Event | None = None,
                 poll_interval_s: float = 0.2, max_downtime_s: float = 600.0, keep_model: bool = True,
                 source: LocalSource | None = None, data_args: dict[str, str] | None = None,
                 torch_device: torch.device | None = None, model_ref: str | None = None,
                 loss_ref: str | None = None, compute: Compute | None = None, task_wait_s: float = TASK_WAIT_S,
                 weights_cache: WeightsCache | None = None, emulate_links: bool = True,
                 keep_data: bool | None = None, states: DeviceStates | None = None) -> None:
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
        #: Whether the device holds its data between tasks (None: as it keeps its model). Else it
        #: loads it for each task and lets it go after: an idle device of an agent hosting
        #: thousands holds no samples.
        self.keep_data = keep_model if keep_data is None else keep_data
        self.torch_device = torch_device or torch.device("cpu")
        #: The operator's ``--model``: a run whose model is an import path is built only if it is this.
        self.model_ref = model_ref
        #: The operator's ``--loss``: a run whose loss is an import path uses it only if it is this.
        self.loss_ref = loss_ref
        self.loss: Loss | None = None   # the run's, once the run is checked (:meth:`prepare`)
        #: Where a whole-model round's training runs: the agent's compute threads, or (None) this
        #: device's own thread (``train_round``'s default).
        self.compute = compute
        self.weights_cache = weights_cache if weights_cache is not None else WeightsCache()
        self.states = states if states is not None else DeviceStates()
        #: The device's two server connections: replaceable until the device is prepared (:meth:`prepare`).
        self.fed = fed
        self.connect_main = connect_main
        #: Where its secure aggregation stages go: ``fed`` (None), or its agent's batches
        #: (:mod:`device_agent.secure_batches`); set before it is prepared.
        self.secure_channel: SecureChannel | None = None
        self.info: RunInfo | None = None
        #: The data this device trains on (and counts in ``num_samples``): with federated
        #: evaluation its data minus the held-out part, which it only evaluates on.
        self.data: ArrayDataset | None = None
        self.held_out: ArrayDataset | None = None
        #: What the device registers with: its training sample count, and its samples per class as
        #: the run says to report them (``split_privacy.label_counts``; empty: withheld), drawn once.
        self.num_samples = 0
        self.label_counts: list[int] = []
        #: Its speed and link as it registers them (:meth:`profile`), measured last in :meth:`setup`.
        self._profile: DeviceProfileMsg | None = None
        #: What asks for its tasks, its Main Server link, its model, and what trains its tasks
        #: (all from :meth:`prepare`).
        self.poller: TaskPoller | None = None
        self.main_link: MainLink | None = None
        self.device_model: DeviceModel | None = None
        self.trainer: TaskTrainer | None = None
        self.tasks_trained = 0
        #: The attempt (``round_id``) of the training task the device runs now, and whether the Fed
        #: Server has closed it without the device's upload (:meth:`taken_out`).
        self._running: int | None = None
        self._taken_out = Cancellation()
        #: Called after every successful upload with the body and the round's split point
        #: (the agent's optional metrics port uses it).
        self.on_upload: UploadHook | None = None

    @property
    def token(self) -> str | None:
        """The token of the device's current registration (None before it registers)."""
        return self.main_link.token if self.main_link is not None else None

    @property
    def model(self) -> SplitModel | None:
        """The real weights: for the whole run with ``keep_model``, else only while a task uses them."""
        return self.device_model.model if self.device_model is not None else None

    # --- lifecycle ----------------------------------------------------------------------------
    def run(self) -> None:
        """A device without an agent: register, then ask for every task on its own task poll
        (``GET /v1/devices/{device_id}/task``) and train it, until the run is done. An agent runs
        its devices, one or many, in its task session instead (:mod:`device_agent.agent_tasks`),
        which also tells them of an attempt closed without them.

        Survives server restarts: connection failures back off and retry (up to
        ``max_downtime_s`` without any answer), and a Fed Server that no longer knows the device
        (it restarted from its checkpoint) gets a new registration. A task that fails, for any
        reason, is given up (:func:`device_agent.reports.abandon`) and the device asks for its
        next one.
        """
        self.setup()
        if self.stop.is_set():   # stopped while it set up
            return
        poller = self.poller
        assert poller is not None
        down_since: float | None = None
        delay = self.poll_interval_s
        while not self.stop.is_set():
            try:
                asked_at = time.monotonic()
                task, size = poller.poll(self.task_wait_s)
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
            if task.status == "wait" or (task.status == "train" and task.phase != "train"):
                poller.pause_after(task, asked_at, self.task_wait_s)
            elif self.handle(task, size, time.monotonic()):
                return

    def handle(self, task: TaskResponse, task_bytes: int, received_at: float) -> bool:
        """Act on one instruction of the Fed Server that is not ``wait``: train, evaluate, or take
        the final model. Returns whether the run is over for this device. A task that fails, for
        any reason, is given up (:func:`device_agent.reports.abandon`): the device goes on.
        ``task_bytes`` and ``received_at``: as for :meth:`run_task`. The device's own loop
        (:meth:`run`) and its agent's session (:mod:`device_agent.agent_tasks`) both call it."""
        if task.status == "done":
            self._receive_final(task)
            return True
        try:
            if task.status == "evaluate":
                self.run_evaluation(task)
            elif task.status == "train" and task.phase == "train":
                self.run_task(task, task_bytes, received_at)
        except Exception as exc:   # one task's failure, whatever it is, must not end the device
            abandon(self.fed, self.device_id, task, exc)
        return False

    def _receive_final(self, task: TaskResponse) -> None:
        """Load the run's final global model, on a device that keeps its model (a virtual device
        has no use for it, and does not fetch it), and forget the state its algorithm kept: the
        run has no round left to use it."""
        if self.info is not None:
            self.states.discard(self.info.run_id, self.device_id)
        received = task.weights_id is not None and self.keep_model
        if received:
            assert self.device_model is not None
            try:
                self.device_model.load_final(task)
            except (DomainError, Unreachable) as exc:   # the run is over either way: the device ends cleanly
                log.warning("%s: the final global model could not be fetched: %s", self.device_id, exc)
                received = False
        log.info("%s: run finished; this device trained %d task(s)%s", self.device_id, self.tasks_trained,
                 "; final global model received" if received else "")

    def setup(self, info: RunInfo | None = None, layout: SplitModel | None = None, register: bool = True) -> None:
        """Fetch the run spec (unless given ``info``: an agent waits for it once for all its
        devices) and check it (unless given its model's ``layout``: an agent checks it once and
        its devices share the layout, which they only read), load and check this device's data,
        register with the Fed Server.

        ``register``: False when the agent registers its devices together
        (:mod:`device_agent.registrar`). Bad data stops here with a :class:`DataError`, before the
        device registers. A run this
        process cannot train (:func:`check_run`: an unknown algorithm, a model it may not or cannot
        build) stops the device here (ValueError), before anything is imported: code is never
        taken from the network.

        A device whose ``stop`` is set stops setting up between steps, unregistered: an agent
        stopped while its many devices set up exits at once."""
        self.info = info if info is not None else wait_for_run(self.fed, self.stop, f"the Fed Server of {self.device_id}")
        if self.stop.is_set():
            return
        layout = layout if layout is not None else check_run(self.info, self.model_ref, self.loss_ref)
        # The one place the device's data becomes its training set. Federated evaluation: split
        # once into the training part and the held-out part, before anything (registration,
        # warm-up, training) sees the data.
        data, held_out = evaluation_holdout(self._load_data(), self.info.holdout, self.info.seed, self.device_id)
        device_model = self.prepare(self.info, layout, data, held_out)
        device_model.warm_up(data)
        self._resolve_time_scale()
        self._profile = self.profile()
        if not self.keep_data:
            self._release_data()
        if register and not self.stop.is_set():
            self.register()

    def prepare(self, info: RunInfo, layout: SplitModel, data: ArrayDataset,
                held_out: ArrayDataset | None) -> DeviceModel:
        """Hold the checked run, its model ``layout`` and this device's training and held-out
        data, and build what asks for and trains its tasks over the device's ``fed`` and
        ``connect_main``: what :meth:`setup` does between checking the run and registering.
        Returns the device's model."""
        self.info, self.data, self.held_out = info, data, held_out
        self.num_samples = len(data)
        self.label_counts = reported_label_counts(data.label_counts().tolist(), info.split_privacy)
        device_id, fed = self.device_id, self.fed
        self.poller = TaskPoller(fed, device_id, self.stop, self.poll_interval_s)
        self.main_link = MainLink(self.connect_main)
        self.device_model = DeviceModel(info, layout, self.keep_model, self.torch_device, self.weights_cache,
                                        lambda weights_id: fed.weights(device_id, weights_id, self._taken_out))
        # The run's loss (checked by check_run: an import path only when it is the operator's --loss).
        self.loss = build_loss(info.loss, info.task)
        self.trainer = TaskTrainer(device_id, data, self.device_model, fed, self.main_link, self.poller,
                                   self._new_clock, info.seed, device_id if self.shard is None else self.shard,
                                   self.compute, self.task_wait_s, self.loss, self.states, info.run_id,
                                   self.label_counts, build_privacy_defences(info.split_privacy.defences,
                                                                             info.split_privacy.defence_params),
                                   info.num_classes, secure_channel=self.secure_channel)
        return self.device_model

    def _load_data(self) -> ArrayDataset:
        """This device's samples: its shard of the run's data set, or its own files (``--data``)."""
        assert self.info is not None
        spec = self.info.data
        if self.source is not None:
            return self.source.load(spec, self.data_args, self.info.task)
        if spec.dataset == "local":
            raise DataError(f"{self.device_id}: the run uses the devices' own data (dataset 'local'); start the "
                            f"agent with --data PATH instead of --shards")
        assert self.shard is not None
        if not 0 <= self.shard < spec.num_devices:
            raise RegistrationRefused(f"shard {self.shard} does not exist: the run has {spec.num_devices} shards "
                                      f"(0..{spec.num_devices - 1})")
        train, _ = load_dataset(spec)
        return device_shard(spec, train, self.shard)

    def register(self) -> None:
        """Announce this device, its shard, its profile and its model's fingerprint to the Fed
        Server, and its label counts when the run asks for them (several Main Server replicas). A
        fingerprint that differs from the run's is refused (Conflict): the device stops rather than
        train on another model: every refusal stops the device (:class:`RegistrationRefused`),
        but a 429 (the device registered again moments ago), after which it registers once the
        answer's ``Retry-After`` has passed."""
        while True:
            try:
                answer = self.fed.register(self.registration())
                break
            except TooSoon as exc:   # it registered again moments ago: as the Fed Server says, later
                log.info("%s: the Fed Server asks it to register again in %.0f s", self.device_id, exc.retry_after_s)
                if self.stop.wait(exc.retry_after_s):
                    return
            except DomainError as exc:
                raise registration_error(exc) from None
        self.registered(answer)

    @property
    def ready_to_register(self) -> bool:
        """Whether :meth:`setup` has got as far as what the device registers with."""
        return self.device_model is not None and self.info is not None and self._profile is not None

    def registration(self) -> RegisterRequest:
        """What this device registers with (:meth:`register`, or its agent's batch)."""
        assert self.device_model is not None and self.info is not None and self._profile is not None
        return RegisterRequest(device_id=self.device_id, shard=self.shard, num_samples=self.num_samples,
                               profile=self._profile,
                               fingerprint=model_fingerprint(self.device_model.layout, self.info.data,
                                                             self.info.loss, self.info.task),
                               label_counts=self.label_counts if self.info.label_counts_at_registration else None)

    def registered(self, answer: RegisterResponse) -> None:
        """The Fed Server registered the device: its Main Server client presents the new token from
        now on (its Fed Server client took it with the answer, or from its agent's registrar)."""
        assert self.main_link is not None and self._profile is not None
        self.main_link.new_token(answer.token)  # the next task's Main Server client presents it
        log.info("%s: registered %s %d (%d samples, %s)", self.device_id, "shard" if self.source is None else "slot",
                 answer.shard, self.num_samples, self._profile.kind)

    # --- emulation and profile -----------------------------------------------------------------
    def _resolve_time_scale(self) -> None:
        """``time_scale: auto`` on an emulated device: compress transfers by
        :func:`shared.profiles.auto_time_scale` of the host's measured speed, before the device
        reports its (compressed) rate. A factor given as a number is used as it is; a real device
        emulates nothing and measures nothing."""
        if self.kind is not None and self.time_scale_setting == "auto":
            assert self.device_model is not None and self.data is not None
            self.time_scale = auto_time_scale(self.device_model.host_flops(self.data))

    def _new_clock(self) -> RoundClock:
        """A round's clock: this device's emulated kind and transfer scale, and the clock its
        compute is timed by."""
        assert self.device_model is not None
        return RoundClock(self.kind, self.time_scale, cpu_time=self.device_model.cpu_time(),
                          emulate_links=self.emulate_links, taken_out=self._taken_out)

    def profile(self) -> DeviceProfileMsg:
        """Nominal speed of an emulated kind, or a quick measurement on a real device (on the
        torch device it trains on, once per agent: :func:`device_agent.calibration.matmul_flops`). The rate is the emulated link's; a real link's is not known
        before it has carried a round (``rate`` None): the Fed Server measures it from the device's
        timed transfers (docs/s2fl.md, "The client time table")."""
        if self.kind is not None:
            return DeviceProfileMsg(kind=self.kind.name, flops=self.kind.flops,
                                    rate=self.kind.rate * self.time_scale if self.emulate_links else None)
        return DeviceProfileMsg(kind="native", flops=matmul_flops(self.torch_device), rate=None)

    # --- one task -----------------------------------------------------------------------------
    def run_task(self, task: TaskResponse, task_bytes: int, received_at: float) -> None:
        """Train the task's portion, report and follow up if the algorithm asks, and upload.

        ``received_at`` is the ``time.monotonic()`` at which the task arrived: its ``deadline_s``
        (what remained of the attempt when the Fed Server answered, which may have held the
        request for a while) counts from there, and past it the Fed Server has closed the attempt,
        so the device gives the task up (:class:`device_agent.task_expired.TaskExpired`). The Fed
        Server's own deadline is the one that counts; this one only spares the device work nobody
        will take.
        """
        assert self.device_model is not None and self.trainer is not None
        self._running = task.round_id
        try:
            with self._data_scope(), self.device_model.task_scope():
                body = self.trainer.train(task, task_bytes, received_at)
            if self._taken_out.is_set():   # an upload nobody will take, over a link that may be slow
                raise TaskExpired("the Fed Server closed the task's attempt before the upload")
            # Uploaded after the model is freed: its weights are in the body now, and the upload may
            # wait on a Fed Server that is busy with the other devices' uploads.
            upload(self.fed, task, body, received_at, self.on_upload)
        finally:
            self._running = None
            self._taken_out.clear()   # what the device fetches next is not this task's
        if self.trainer.secure is not None:
            self.trainer.secure.answer_unmasking()
        self.tasks_trained += 1

    def taken_out(self, round_id: int) -> None:
        """The Fed Server closed attempt ``round_id`` without this device's upload (its agent's
        session says so): if the device still runs that attempt's task, it gives it up
        (:class:`device_agent.task_expired.TaskExpired`) where it is: the download of its weights, an
        emulated transfer or compute stretch, the next step, or before the upload. A link that slowed
        down is then free for the device's next task rather than busy with weights nobody will
        train from."""
        if self._running == round_id:
            self._taken_out.set()

    def run_evaluation(self, task: TaskResponse) -> None:
        """Federated evaluation of the task's global model on the held-out part
        (:func:`device_agent.reports.report_evaluation`)."""
        assert self.device_model is not None
        assert self.loss is not None
        with self._data_scope():
            report_evaluation(self.fed, self.device_id, task, self.device_model, self.held_out, self.loss)

    @contextlib.contextmanager
    def _data_scope(self) -> Iterator[None]:
        """One task's use of the device's data: loaded again if it was let go (the same samples and
        the same held-out part: both are derived from the run's seed), let go after unless the
        device keeps it (:attr:`keep_data`)."""
        assert self.info is not None and self.trainer is not None
        if self.data is None:
            data, self.held_out = evaluation_holdout(self._load_data(), self.info.holdout, self.info.seed,
                                                     self.device_id)
            self.data = self.trainer.data = data
        try:
            yield
        finally:
            if not self.keep_data:
                self._release_data()

    def _release_data(self) -> None:
        """Let the device's samples go until its next task."""
        self.data = self.held_out = None
        if self.trainer is not None:
            self.trainer.data = None
