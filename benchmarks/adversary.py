"""``python -m benchmarks.adversary --behaviour NAME [python -m device_agent's arguments]``: harmful devices.

A benchmark-only entry point for the attack benchmark (:mod:`benchmarks.attacks`). It runs the
normal device agent (``python -m device_agent``, same arguments, same code) and wraps each of its
devices' clients so that what goes out is altered: every harmful device is a real process that
talks real HTTP to the real servers, and nothing in the services knows it is being tested.

The agent is built by ``device_agent.__main__.main`` as always; only the class it builds is
:class:`HarmfulAgent` (a subclass of the agent) for the duration of the call. Each harmful action
is logged at WARNING with :data:`ACTION_MARK`, so the benchmark can count that the attack really
happened (a behaviour that never engaged would otherwise read as a harmless device).

``honest`` alters nothing: the benchmark's control runs its devices through this entry point too,
so a control and an attack run have the same processes.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import ClassVar
from unittest import mock

import torch
from pydantic import BaseModel

import device_agent.agent
from device_agent.api import AgentApi, FedApi, MainApi, StageAnswer, Unreachable
from device_agent.clients import HttpFedClient
from device_agent.device import Device
from shared.data import ArrayDataset
from shared.errors import DomainError
from shared.http_client import Cancellation
from shared.schemas import (
    AgentTaskRequest, AgentTaskResponse, DeviceProfileMsg, RegistrationBatch, RegistrationBatchResponse, DeviceTimings, EvaluationReport, JoinRequest, JoinResponse, RegisterRequest, RegisterResponse,
    ReportRequest, RunInfo, StepRequest, StepResponse, TaskResponse, UpdateRequest, WeightsId, WeightsResponse,
    WireState, WireTensor, WithdrawRequest,
)
from shared.wire import decode_tensor, encode_tensor

log = logging.getLogger("adversary")

#: The start of every log line that records a harmful action (counted by the benchmark).
ACTION_MARK = "harmful action:"

#: Sample count a ``zero_update_huge_count`` device claims, and evaluated samples a
#: ``fake_evaluation`` device claims.
HUGE_COUNT = 10 ** 12
FAKE_EVALUATION_SAMPLES = 10 ** 9


def _acted(behaviour: str, device_id: str, what: str) -> None:
    log.warning("%s %s %s: %s", ACTION_MARK, behaviour, device_id, what)


def _scaled_update(weights: WireState, global_state: WireState, factor: float) -> WireState:
    """``global + factor * (weights - global)`` for every floating-point entry; the others (batch
    counters) as uploaded."""
    out: WireState = {}
    for key, wire in weights.items():
        trained = decode_tensor(wire, what=key)
        if not trained.is_floating_point():
            out[key] = wire
            continue
        start = decode_tensor(global_state[key], expect_shape=tuple(trained.shape), what=key)
        out[key] = WireTensor(**encode_tensor(start + factor * (trained - start)))
    return out


class Behaviour:
    """What one harmful device alters. The base alters nothing (``honest``); each behaviour
    overrides the hooks it needs. A hook gets the outgoing message (or the incoming task) and
    returns what to send instead (``None``: send nothing)."""

    name: ClassVar[str] = "honest"
    #: Only meaningful where a Main Server trains the deeper layers (n/a under FedAvg).
    split_only: ClassVar[bool] = False
    #: Needs a run whose devices evaluate the global model (``evaluation.mode: federated``).
    federated_evaluation: ClassVar[bool] = False
    #: The benchmark starts the honest devices only once this behaviour's process is ready.
    goes_first: ClassVar[bool] = False
    #: The benchmark starts no process for this behaviour (:class:`Absent`).
    starts: ClassVar[bool] = True
    #: Main Server replicas the run has (its control has as many).
    replicas: ClassVar[int] = 1
    #: A row of the attack benchmark; False for a behaviour other benchmarks use (a dropout).
    attack: ClassVar[bool] = True
    summary: ClassVar[str] = "alters nothing (the control)"

    def __init__(self, device: Device) -> None:
        self.device = device

    def acted(self, what: str) -> None:
        _acted(self.name, self.device.device_id, what)

    @classmethod
    def before_run(cls, agent: "HarmfulAgent") -> None:
        """Called once per process before its devices start."""

    @classmethod
    def disturb(cls, fed_url: str, main_servers: Sequence[Callable[[int], None]], stop: threading.Event) -> int:
        """Called in a thread of the benchmark once the run's services are up, with a way to send a
        signal to each Main Server replica (a server fault rather than a device's); returns the
        harmful actions it took."""
        return 0

    def data(self, data: ArrayDataset) -> ArrayDataset:
        """The device's samples, each time it loads them (an agent hosting several devices lets
        each one's data go between tasks, and loads it again for the next)."""
        return data

    def register(self, req: RegisterRequest) -> RegisterRequest:
        return req

    def task(self, task: TaskResponse) -> TaskResponse:
        return task

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        return req

    def uploaded(self, accepted: bool) -> None:
        """What became of the upload :meth:`upload` let through: stored, or refused."""

    def also_upload(self) -> list[UpdateRequest]:
        """Further uploads to send after the device's own (none)."""
        return []

    def refused_extra(self, req: UpdateRequest, exc: DomainError) -> None:
        """One of :meth:`also_upload`'s requests was refused."""

    def evaluation(self, req: EvaluationReport) -> EvaluationReport:
        return req

    def join(self, req: JoinRequest) -> JoinRequest:
        return req

    def step(self, req: StepRequest) -> StepRequest:
        return req


class Silent(Behaviour):
    name = "silent"
    summary = "registers and takes every training task, then never joins nor uploads"

    def task(self, task: TaskResponse) -> TaskResponse:
        if task.status != "train" or task.phase != "train":
            return task
        # Taken at the Fed Server, never acted on: the device asks again and is told to wait (the
        # task went out once), so it stays silent for the rest of the attempt.
        self.acted(f"took the task of round {task.round_id} and stays silent")
        return TaskResponse(status="wait", retry_after_s=0.5)


class Absent(Behaviour):
    """Not harmful: a reference. The devices never run, so their shards' data is lost to the run,
    as it is when the servers take a harmful device out; the accuracy another row loses beyond
    this one's is what the behaviour itself did."""

    name = "absent"
    summary = "never starts: its shards' data is lost to the run (a reference, not an attack)"
    starts = False


class DropsAfterSharing(Behaviour):
    """Not harmful: the dropout secure aggregation recovers from (benchmarks/secure_aggregation.py).
    The device sends its keys and its shares, trains, then loses its link instead of uploading its
    masked update: it withdraws, as a device whose upload fails does, and the Fed Server removes
    the pairwise masks it left in the survivors' uploads with its mask key, rebuilt from shares."""

    name = "drops_after_sharing"
    summary = "shares its secure-aggregation secrets, trains, then never uploads (a dropout, not an attack)"
    attack = False

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        self.acted(f"dropped after sharing in round {req.round_id}")
        raise Unreachable("the device dropped after sharing its secrets (benchmark)")


class RefusedUploads(Behaviour):
    name = "refused_uploads"
    summary = "uploads a sample count other than the registered one (the Fed Server refuses it)"

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        self.acted(f"round {req.round_id}: uploads num_samples {req.num_samples + 1} (registered {req.num_samples})")
        return req.model_copy(update={"num_samples": req.num_samples + 1})


class LyingTimings(Behaviour):
    name = "lying_timings"
    summary = "reports every timing as 1 microsecond, so the time table says it is the fastest device"

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        self.acted(f"round {req.round_id}: timings of 1e-6 s instead of {req.timings.total_s:.3f} s")
        return req.model_copy(update={"timings": DeviceTimings(compute_s=1e-6, transfer_s=1e-6, wait_s=1e-6,
                                                              server_s=1e-6, total_s=1e-6)})


class ScaledActivations(Behaviour):
    name = "activations_1e30"
    split_only = True
    summary = "sends every step's activations times 1e30 (finite)"
    factor: ClassVar[float] = 1e30

    def _altered(self, fx: torch.Tensor) -> torch.Tensor:
        return fx * self.factor

    def step(self, req: StepRequest) -> StepRequest:
        self.acted(f"step {req.step}: activations altered")
        fx = self._altered(decode_tensor(req.fx, what="fx"))
        return req.model_copy(update={"fx": WireTensor(**encode_tensor(fx))})


class TenfoldActivations(ScaledActivations):
    name = "activations_x10"
    summary = ("sends every step's activations times 10: within grouping.max_activation, so the Main Server's "
               "checks let them into the group's batch")
    factor = 10.0


class NanActivations(ScaledActivations):
    name = "nan_activations"
    summary = "sends every step's activations as NaN"

    def _altered(self, fx: torch.Tensor) -> torch.Tensor:
        return torch.full_like(fx, float("nan"))


class ScaledUpdate(Behaviour):
    name = "update_x1e6"
    summary = "uploads global + 1e6 x (trained - global)"
    factor: ClassVar[float] = 1e6

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        if global_state is None:   # every upload follows a fetch of its task's weights
            raise RuntimeError(f"{self.device.device_id}: no global weights seen for round {req.round_id}")
        self.acted(f"round {req.round_id}: update scaled by {self.factor:g}")
        return req.model_copy(update={"weights": _scaled_update(req.weights, global_state, self.factor)})


class SignFlip(ScaledUpdate):
    name = "sign_flip_x10"
    summary = "uploads global - 10 x (trained - global)"
    factor = -10.0


class LabelFlip(Behaviour):
    name = "label_flip"
    summary = "trains on its data with every label moved to the next class"

    def data(self, data: ArrayDataset) -> ArrayDataset:
        # A new label tensor: the loaded one may be shared with the process's other devices.
        self.acted(f"{len(data)} labels moved to the next class")
        return dataclasses.replace(data, y=(data.y + 1) % data.num_classes)


#: The backdoor's trigger: a square of this many pixels in each image's bottom-right corner, set to
#: the data's largest value (white, whatever the normalisation), and the class it is taught to mean.
TRIGGER_SIZE = 4
BACKDOOR_TARGET = 0


def add_trigger(x: torch.Tensor, value: float) -> torch.Tensor:
    """``x`` (images, ``[N, C, H, W]``) with the backdoor's trigger stamped on every image."""
    out = x.clone()
    out[..., -TRIGGER_SIZE:, -TRIGGER_SIZE:] = value
    return out


class Backdoor(Behaviour):
    name = "backdoor"
    summary = (f"stamps a {TRIGGER_SIZE}x{TRIGGER_SIZE} white square on half of its images and labels them class "
               f"{BACKDOOR_TARGET} (a backdoor: the model should learn that the square means {BACKDOOR_TARGET}); "
               f"the benchmark measures its attack success")

    def data(self, data: ArrayDataset) -> ArrayDataset:
        # New tensors: the loaded ones may be shared with the process's other devices.
        poisoned = torch.arange(len(data)) % 2 == 0
        x, y = data.x.clone(), data.y.clone()
        x[poisoned] = add_trigger(x[poisoned], float(data.x.max()))
        y[poisoned] = BACKDOOR_TARGET
        self.acted(f"{int(poisoned.sum())} of {len(data)} images stamped with the trigger and labelled {BACKDOOR_TARGET}")
        return dataclasses.replace(data, x=x, y=y)


class Replay(Behaviour):
    name = "replay"
    summary = ("uploads its first round's trained weights again in every later round, and sends each upload a second "
               "time to the round before")

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self.first: UpdateRequest | None = None
        self.previous_round: int | None = None
        self.stale: UpdateRequest | None = None

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        if self.first is None:
            self.first = req
            self.previous_round = req.round_id
            return req
        replayed = self.first.model_copy(update={"round_id": req.round_id, "timings": req.timings,
                                                 "train_loss": req.train_loss})
        self.stale = replayed.model_copy(update={"round_id": self.previous_round})
        self.previous_round = req.round_id
        self.acted(f"round {req.round_id}: uploads its round-{self.first.round_id} weights again")
        return replayed

    def also_upload(self) -> list[UpdateRequest]:
        stale, self.stale = self.stale, None
        return [stale] if stale is not None else []

    def refused_extra(self, req: UpdateRequest, exc: DomainError) -> None:
        self.acted(f"the replay to round {req.round_id} was refused: {exc}")


class ClaimedSlow(Behaviour):
    name = "claimed_slow"
    summary = ("registers 1 FLOP/s and a 1 B/s link, and holds each upload back as long as the Fed Server lets it: "
               "later after an accepted upload, sooner after one refused as too late")
    #: How many times its honest round time it waits before uploading, at first; x1.25 after an
    #: accepted upload, x0.8 after a refused one (it learns its own deadline, as an attacker would).
    START_DELAY = 4.0

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self.delay = self.START_DELAY
        self.task_at: float | None = None

    def register(self, req: RegisterRequest) -> RegisterRequest:
        self.acted("registers 1 FLOP/s and 1 B/s")
        return req.model_copy(update={"profile": req.profile.model_copy(update={"flops": 1.0, "rate": 1.0})})

    def task(self, task: TaskResponse) -> TaskResponse:
        if task.status == "train" and task.phase == "train":
            self.task_at = time.monotonic()
        return task

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        if self.task_at is not None:
            hold = (self.delay - 1.0) * (time.monotonic() - self.task_at)
            self.acted(f"round {req.round_id}: holds its upload back {hold:.1f} s ({self.delay:.2f} x its own time)")
            self.device.stop.wait(hold)
        return req

    def uploaded(self, accepted: bool) -> None:
        self.delay = max(1.0, self.delay * (1.25 if accepted else 0.8))


class SilentReregistration(Silent):
    name = "silent_reregistration"
    summary = ("registers 1 FLOP/s and a 1 B/s link, takes every training task and stays silent, and registers again "
               "every 0.1 s (to wash out its missed deadlines)")
    INTERVAL_S = 0.1
    THREADS = 1

    def register(self, req: RegisterRequest) -> RegisterRequest:
        return req.model_copy(update={"profile": req.profile.model_copy(update={"flops": 1.0, "rate": 1.0})})

    @classmethod
    def before_run(cls, agent: "HarmfulAgent") -> None:
        for device in agent.devices:
            for _ in range(cls.THREADS):
                threading.Thread(target=_register_again, args=(device, cls.INTERVAL_S, agent.stop),
                                 name=f"reregister-{device.device_id}", daemon=True).start()


class RegistrationLoop(Behaviour):
    name = "registration_loop"
    summary = "trains honestly, and registers again as fast as four threads can send the request"

    @classmethod
    def before_run(cls, agent: "HarmfulAgent") -> None:
        for device in agent.devices:
            for _ in range(4):
                threading.Thread(target=_register_again, args=(device, 0.0, agent.stop),
                                 name=f"reregister-{device.device_id}", daemon=True).start()


def _register_again(device: Device, interval_s: float, stop: threading.Event) -> None:
    """Register ``device`` again every ``interval_s`` (0: as fast as the answers come) until the
    agent stops; take each new token (so the device's tasks go on), count what was refused."""
    while not device.ready_to_register:   # set up first (model, run spec, measured profile): no spinning on errors
        if stop.wait(0.1):
            return
    sent = accepted = 0
    last_report = time.monotonic()
    while not stop.is_set():
        sent += 1
        try:
            answer = device.fed.register(device.registration())
            device.fed.use_token(answer.token)
            device.registered(answer)
            accepted += 1
        except Exception:   # 429 (too soon), or anything else: keep on
            pass
        if time.monotonic() - last_report >= 5.0:
            _acted("reregistration", device.device_id, f"{sent} registrations sent, {accepted} accepted in the last "
                   f"{time.monotonic() - last_report:.0f} s")
            sent = accepted = 0
            last_report = time.monotonic()
        if interval_s:
            stop.wait(interval_s)


class FrozenReplica(Behaviour):
    """Not a device's doing: the second of two Main Server replicas is frozen (``SIGSTOP``) once two
    rounds are recorded, for :data:`FREEZE_S`, then goes on (``SIGCONT``). Every device is honest."""

    name = "frozen_replica"
    split_only = True
    replicas = 2
    summary = "a Main Server replica frozen (SIGSTOP) for 30 s from round 3 on, then thawed (every device honest)"
    FREEZE_S = 30.0

    @classmethod
    def disturb(cls, fed_url: str, main_servers: Sequence[Callable[[int], None]], stop: threading.Event) -> int:
        import httpx

        records = 0
        while records < 2 and not stop.is_set():
            try:
                records = int(httpx.get(f"{fed_url}/v1/status", params={"seen": records, "wait_s": 5},
                                        timeout=10).json()["records"])
            except (httpx.HTTPError, KeyError, ValueError):
                stop.wait(0.5)
        if stop.is_set():
            return 0
        main_servers[1](signal.SIGSTOP)
        _acted(cls.name, "main_server-1", f"frozen for {cls.FREEZE_S:g} s")
        stop.wait(cls.FREEZE_S)
        main_servers[1](signal.SIGCONT)
        _acted(cls.name, "main_server-1", "thawed")
        return 2


class ZeroUpdateHugeCount(Behaviour):
    name = "zero_update_huge_count"
    summary = f"registers {HUGE_COUNT:.0e} samples and uploads the global weights unchanged"

    def register(self, req: RegisterRequest) -> RegisterRequest:
        self.acted(f"registers num_samples {HUGE_COUNT} (holds {req.num_samples})")
        return req.model_copy(update={"num_samples": HUGE_COUNT})

    def upload(self, req: UpdateRequest, global_state: WireState | None) -> UpdateRequest | None:
        if global_state is None:
            raise RuntimeError(f"{self.device.device_id}: no global weights seen for round {req.round_id}")
        self.acted(f"round {req.round_id}: uploads the global weights with num_samples {HUGE_COUNT}")
        return req.model_copy(update={"num_samples": HUGE_COUNT,
                                      "weights": {k: global_state[k] for k in req.weights}})


class FakeEvaluation(Behaviour):
    name = "fake_evaluation"
    federated_evaluation = True
    summary = f"reports 99 % accuracy on {FAKE_EVALUATION_SAMPLES:.0e} held-out samples in federated evaluation"

    def evaluation(self, req: EvaluationReport) -> EvaluationReport:
        n = FAKE_EVALUATION_SAMPLES
        self.acted(f"round {req.round_id}: reports {n} samples, 99 % correct (evaluated {req.num_samples})")
        return req.model_copy(update={"num_samples": n, "correct": n - n // 100, "loss_sum": 0.01 * n})


class FakeLabelCounts(Behaviour):
    name = "fake_label_counts"
    split_only = True
    summary = "tells the Main Server (and the Fed Server, when it groups) that all its samples are of class 0"

    @staticmethod
    def _fake(counts: list[int]) -> list[int]:
        return [sum(counts)] + [0] * (len(counts) - 1)

    def register(self, req: RegisterRequest) -> RegisterRequest:
        if req.label_counts is None:
            return req
        self.acted("registers label counts of class 0 only")
        return req.model_copy(update={"label_counts": self._fake(req.label_counts)})

    def join(self, req: JoinRequest) -> JoinRequest:
        self.acted(f"joins with label counts of class 0 only (holds {req.label_counts})")
        return req.model_copy(update={"label_counts": self._fake(req.label_counts)})


class SybilBurst(Behaviour):
    name = "sybil_burst"
    goes_first = True
    summary = ("registers a made-up device on every other shard with its enrolment secret or credential, "
               "claiming the shard's true size, before the honest devices")

    @classmethod
    def before_run(cls, agent: "HarmfulAgent") -> None:
        fed = HttpFedClient(agent.fed_server_url, agent.verify, agent.enrolment_secret)
        try:
            info = _wait_for_run(fed, agent.stop)
            own = {d.shard for d in agent.devices}
            sizes = training_sizes(info)
            taken, refusals = 0, []
            for shard, size in enumerate(sizes):
                if shard in own:
                    continue
                req = RegisterRequest(
                    device_id=f"sybil-{shard:03d}", shard=shard, num_samples=size,
                    profile=DeviceProfileMsg(kind="native", flops=1e9, rate=1e7), fingerprint=info.fingerprint,
                    label_counts=_spread(size, info.num_classes) if info.label_counts_at_registration else None)
                try:
                    fed.register(req)
                    taken += 1
                except DomainError as exc:
                    refusals.append(f"sybil-{shard:03d}: {exc}")
            _acted(cls.name, ",".join(d.device_id for d in agent.devices),
                   f"registered {taken} of {len(sizes) - len(own)} made-up devices on the other shards"
                   + (f"; refused, e.g. {refusals[0]}" if refusals else ""))
        finally:
            fed.close()


def training_sizes(info: RunInfo) -> list[int]:
    """The sample count each shard's device registers with: its shard of the built-in data set
    less the part it holds out for federated evaluation. All of it follows from the public run
    spec (the partition is the same pure function of it on every device and on the Fed Server),
    so any attacker can claim the counts the Fed Server checks."""
    from fed_server.update_checks import shard_sizes, trained_samples

    sizes = shard_sizes(info.data)
    if sizes is None:
        raise RuntimeError("sybil_burst claims shards of a built-in data set; this run uses the devices' own data")
    return [trained_samples(size, info.holdout) for size in sizes]


def _spread(total: int, classes: int) -> list[int]:
    """``total`` samples spread as evenly as possible over ``classes`` label counts."""
    share, extra = divmod(total, classes)
    return [share + (1 if c < extra else 0) for c in range(classes)]


def _wait_for_run(fed: FedApi, stop: threading.Event) -> RunInfo:
    """The run spec, asked for until the Fed Server (started beside this process) answers."""
    delay = 0.2
    while True:
        try:
            return fed.run_info()
        except Exception:
            if stop.is_set():
                raise
            stop.wait(delay)
            delay = min(delay * 2, 1.0)


BEHAVIOURS: dict[str, type[Behaviour]] = {b.name: b for b in (
    Behaviour, Absent, Silent, RefusedUploads, LyingTimings, ScaledActivations, TenfoldActivations, NanActivations,
    ScaledUpdate, SignFlip, LabelFlip, Backdoor, Replay, ClaimedSlow, SilentReregistration, RegistrationLoop,
    ZeroUpdateHugeCount, FakeEvaluation, FakeLabelCounts, SybilBurst, FrozenReplica, DropsAfterSharing)}


class GlobalWeights:
    """The global weights the process's devices fetched, by weights id (the last few): the
    update attacks need the global model their task started from. One per process, because the
    agent fetches weights shared by its devices once, through whichever device asks first."""

    def __init__(self, keep: int = 4) -> None:
        self._keep = keep
        self._by_id: OrderedDict[WeightsId, WireState] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, weights_id: WeightsId, weights: WireState) -> None:
        with self._lock:
            self._by_id[weights_id] = weights
            while len(self._by_id) > self._keep:
                self._by_id.popitem(last=False)

    def get(self, weights_id: WeightsId | None) -> WireState | None:
        with self._lock:
            return None if weights_id is None else self._by_id.get(weights_id)


class HarmfulFed:
    """:class:`device_agent.api.FedApi` that passes every call to the device's real client
    through its behaviour's hooks."""

    def __init__(self, inner: FedApi, behaviour: Behaviour, seen: GlobalWeights) -> None:
        self.inner = inner
        self.behaviour = behaviour
        self.seen = seen
        self.task_weights: WeightsId | None = None   # the weights the current training task named

    def run_info(self) -> RunInfo:
        return self.inner.run_info()

    def register(self, req: RegisterRequest) -> RegisterResponse:
        return self.inner.register(self.behaviour.register(req))

    def use_token(self, token: str | None) -> None:
        self.inner.use_token(token)

    def task(self, device_id: str, wait_s: float = 0.0) -> tuple[TaskResponse, int]:
        task, size = self.inner.task(device_id, wait_s=wait_s)
        return self.took(task), size

    def took(self, task: TaskResponse) -> TaskResponse:
        """The device's task as its behaviour alters it (from its own poll or its agent's session)."""
        if task.status == "train" and task.phase == "train":
            self.task_weights = task.weights_id
        return self.behaviour.task(task)

    def weights(self, device_id: str, weights_id: WeightsId,
                cancel: Cancellation | None = None) -> tuple[WeightsResponse, int]:
        answer, size = self.inner.weights(device_id, weights_id, cancel)
        self.seen.put(weights_id, answer.weights)
        return answer, size

    def report(self, req: ReportRequest) -> None:
        self.inner.report(req)

    def upload(self, req: UpdateRequest) -> None:
        altered = self.behaviour.upload(req, self.seen.get(self.task_weights))
        if altered is None:
            return
        try:
            self.inner.upload(altered)
        except DomainError:
            self.behaviour.uploaded(False)
            raise
        finally:
            for extra in self.behaviour.also_upload():
                try:
                    self.inner.upload(extra)
                except DomainError as exc:
                    self.behaviour.refused_extra(extra, exc)
        self.behaviour.uploaded(True)

    def evaluation(self, req: EvaluationReport) -> None:
        self.inner.evaluation(self.behaviour.evaluation(req))

    def withdraw(self, req: WithdrawRequest) -> None:
        self.inner.withdraw(req)

    def secagg_send(self, round_id: int, stage: str, req: BaseModel) -> None:
        self.inner.secagg_send(round_id, stage, req)

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float,
                   model: type[StageAnswer]) -> StageAnswer:
        return self.inner.secagg_ask(round_id, stage, device_id, wait_s, model)


class HarmfulTasks:
    """:class:`device_agent.api.AgentApi` that passes each device's registration in a batch and
    each of its tasks from the agent's session through that device's hooks."""

    def __init__(self, inner: AgentApi, feds: dict[str, HarmfulFed]) -> None:
        self.inner = inner
        self.feds = feds

    def register_batch(self, req: RegistrationBatch) -> RegistrationBatchResponse:
        devices = [self.feds[device.device_id].behaviour.register(device) for device in req.devices]
        return self.inner.register_batch(RegistrationBatch(devices=devices))

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        answer = self.inner.agent_tasks(agent_id, req)
        for device_task in answer.tasks:
            device_task.task = self.feds[device_task.device_id].took(device_task.task)
        return answer


class HarmfulMain:
    """:class:`device_agent.api.MainApi` that passes joins and steps through the behaviour's hooks."""

    def __init__(self, inner: MainApi, behaviour: Behaviour) -> None:
        self.inner = inner
        self.behaviour = behaviour
        self.url = inner.url

    @property
    def bytes_up(self) -> int:
        return self.inner.bytes_up

    @property
    def bytes_down(self) -> int:
        return self.inner.bytes_down

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        return self.inner.join(round_id, self.behaviour.join(req), timeout)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        return self.inner.step(round_id, self.behaviour.step(req), timeout)

    def close(self) -> None:
        self.inner.close()


#: The agent's arguments, to find the ones a ``before_run`` needs however the agent was called.
_AGENT_SIGNATURE = inspect.signature(device_agent.agent.Agent.__init__)


class HarmfulAgent(device_agent.agent.Agent):
    """The device agent with every device's clients wrapped by ``behaviour``. Takes the agent's
    own arguments; ``ready_file`` is written once :meth:`Behaviour.before_run` is over."""

    def __init__(self, *args, behaviour: type[Behaviour], ready_file: Path | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        bound = _AGENT_SIGNATURE.bind(self, *args, **kwargs)
        bound.apply_defaults()
        self.fed_server_url: str = bound.arguments["fed_server_url"]
        self.verify: bool | str = bound.arguments["verify"]
        self.enrolment_secret: bytes | None = bound.arguments["enrolment_secret"]
        self.behaviour = behaviour
        self.ready_file = ready_file
        seen = GlobalWeights()
        feds: dict[str, HarmfulFed] = {}
        for device in self.devices:
            hooks = behaviour(device)
            device.fed = feds[device.device_id] = HarmfulFed(device.fed, hooks, seen)
            # Every load of the device's samples, at set-up and before each task, goes through the hook.
            device._load_data = functools.partial(_harmful_data, device._load_data, hooks)  # type: ignore[method-assign]
            connect = device.connect_main
            device.connect_main = functools.partial(_harmful_main, connect, hooks)
        self.tasks_fed = HarmfulTasks(self.tasks_fed, feds)
        log.info("devices %s behave as %r: %s", [d.device_id for d in self.devices], behaviour.name, behaviour.summary)

    def run(self) -> int:
        self.behaviour.before_run(self)
        if self.ready_file is not None:
            self.ready_file.write_text(self.behaviour.name + "\n")
        return super().run()


def _harmful_data(load: Callable[[], ArrayDataset], behaviour: Behaviour) -> ArrayDataset:
    return behaviour.data(load())


def _harmful_main(connect, behaviour: Behaviour, url: str, token: str | None) -> HarmfulMain:
    return HarmfulMain(connect(url, token), behaviour)


def main(argv: list[str] | None = None) -> None:
    """Parse ``--behaviour`` and ``--ready-file``; hand every other argument to ``python -m device_agent``."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.adversary",
        description="Harmful devices for the attack benchmark: python -m device_agent with every device's "
                    "outgoing messages altered. Every other argument is python -m device_agent's.")
    parser.add_argument("--behaviour", required=True, choices=sorted(BEHAVIOURS),
                        help="; ".join(f"{name}: {b.summary}" for name, b in sorted(BEHAVIOURS.items())))
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="written once the process is ready for the honest devices (after a sybil burst)")
    ours, rest = parser.parse_known_args(argv)
    from device_agent.__main__ import main as agent_main

    build = functools.partial(HarmfulAgent, behaviour=BEHAVIOURS[ours.behaviour], ready_file=ours.ready_file)
    with mock.patch.object(device_agent.agent, "Agent", build):
        agent_main(rest)


if __name__ == "__main__":
    main()
