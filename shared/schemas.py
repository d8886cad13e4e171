"""Pydantic schemas of every message between the services.

Tensors and model portions appear as :class:`WireTensor` / ``dict[str, WireTensor]``: the schema
checks their structure (dtype name, shape, byte length); the receiving service then checks shapes
against what the round expects and decodes them zero-copy with :mod:`shared.wire`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator
from typing_extensions import TypeAlias, TypeAliasType

from shared.config import SplitPrivacyConfig, TrainConfig
from shared.data.spec import DataSpec
from shared.losses import DEFAULT_LOSS, Task
from shared.models.fingerprint import ModelFingerprint
from shared.timings import DeviceTimings
from shared.wire import DTYPE_NAMES, MAX_RANK

API = "/v1"
DeviceId = str
_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"

_ITEMSIZE = {"float32": 4, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1}


class Message(BaseModel):
    """Base of all messages: unknown fields are an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class WireTensor(Message):
    """A tensor on the wire: dtype name, shape and raw little-endian bytes."""

    dtype: str
    shape: list[int] = Field(max_length=MAX_RANK)
    data: bytes

    @model_validator(mode="after")
    def _consistent(self) -> "WireTensor":
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError("shape entries must be non-negative")
        expected = math.prod(self.shape) * _ITEMSIZE[self.dtype]
        if len(self.data) != expected:
            raise ValueError(f"{len(self.data)} data bytes do not match shape {self.shape} of {self.dtype} ({expected} expected)")
        return self


WireState = dict[str, WireTensor]

#: A value of an algorithm's payload in a task or an upload (``extras``): what ``JsonValue`` allows
#: (numbers, strings, bools, nil, arrays, string-keyed maps) and raw bytes, which a tensor's ``data``
#: is: a payload's tensors travel as tensor maps (``{dtype, shape, data}``; docs/wire-format.md).
#: Which values and tensors a payload takes is its algorithm's ``Payload`` model's business
#: (``shared/algorithms/base.py``), which checks every tensor as the weights are checked.
if TYPE_CHECKING:   # mypy reads the recursive alias this way; pydantic needs the TypeAliasType
    PayloadValue: TypeAlias = Union[list["PayloadValue"], dict[str, "PayloadValue"], str, bool, int, float, bytes, None]
else:
    PayloadValue = TypeAliasType(
        "PayloadValue", Union[list["PayloadValue"], dict[str, "PayloadValue"], str, bool, int, float, bytes, None])

#: A published portion of the global model, named by its content (:class:`TaskResponse`).
WeightsId = str
_WEIGHTS_ID_PATTERN = r"^[0-9a-f]{32}$"


class WeightsResponse(Message):
    """Weights a task named by ``weights_id``: a portion of the global model (blocks ``[0, end)``)."""

    weights: WireState


# --- device profile ---------------------------------------------------------------------------

#: Longest device kind a device may register with (shared/profiles.py names are a few letters): the
#: kind travels on in every round plan (``Participant.kind``), which the Main Server checks.
MAX_KIND_LENGTH = 64


class DeviceProfileMsg(Message):
    """What a device says about its speed; the Fed Server uses it only until it has measurements."""

    kind: str = Field(default="unknown", max_length=MAX_KIND_LENGTH)
    flops: float = Field(gt=0, allow_inf_nan=False)  # FLOP/s
    #: Bytes/s of the device's link; None: not known (a real link, measured by the Fed Server
    #: from the device's timed transfers once it has trained a round).
    rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)


#: Largest sample count of one class a device may report: far more than any device holds, and
#: small enough that the sum over any number of classes and devices fits an int64.
MAX_LABEL_COUNT = 1 << 40


def check_label_counts(value: list[int]) -> list[int]:
    """Label counts as a device sends them (join, or registration with replicas): each in
    ``0..MAX_LABEL_COUNT`` with a positive total; ValueError otherwise."""
    # Bounded above too: grouping runs on int64 arrays of the counts. A count of 2**63 or more
    # cannot be converted (grouping raised and no group was formed, leaving the round's devices
    # waiting), and large smaller ones wrap the sums around.
    if any(c < 0 or c > MAX_LABEL_COUNT for c in value) or sum(value) == 0:
        raise ValueError(f"label_counts must be in 0..{MAX_LABEL_COUNT} with a positive total")
    return value


# --- Fed Server <- device -----------------------------------------------------------------------

class RegisterRequest(Message):
    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    #: The partition shard the device derived its data from (built-in data sets). None with
    #: ``dataset="local"``: the device brings its own data and the Fed Server gives it a slot.
    shard: int | None = Field(default=None, ge=0)
    num_samples: int = Field(ge=0)
    profile: DeviceProfileMsg
    # The device's own model fingerprint (shared/models/fingerprint.py); the Fed Server refuses one
    # that differs from the run's with 409. None (a device that does not send one, e.g. written
    # before fingerprints or in another language) is accepted unchecked.
    fingerprint: ModelFingerprint | None = None
    #: The device's samples per class, sent only when ``RunInfo.label_counts_at_registration``
    #: asks for them (a run with several Main Server replicas, where the Fed Server forms the
    #: groups; docs/security.md). The Fed Server checks the length against the run's classes.
    label_counts: list[int] | None = Field(default=None, min_length=1)

    @field_validator("label_counts")
    @classmethod
    def _counts(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else check_label_counts(value)


class RunInfo(Message):
    """What a device needs to know about the run before it registers (``GET /v1/run``)."""

    run_id: str
    algorithm: str
    model: str
    model_params: dict[str, JsonValue] = Field(default_factory=dict)   # data passed to the model function, never code
    num_classes: int
    input_shape: list[int]
    data: DataSpec
    seed: int
    #: The run's loss and task (``train.loss``, ``train.task``): a device loads its data with the
    #: task's labels, and an import-path loss is used only when the operator named it (``--loss``).
    loss: str = DEFAULT_LOSS
    task: Task = "classification"
    #: Federated evaluation: the fraction of its data every device holds out (``evaluation.holdout``)
    #: and evaluates the global model on when asked. None: the Fed Server evaluates on its test set.
    holdout: float | None = Field(default=None, gt=0, lt=1)
    fingerprint: ModelFingerprint   # what a device's own build must match to register (docs/models.md)
    #: True when the Fed Server forms the groups itself (several Main Server replicas and an
    #: algorithm that uses them): the device must send ``RegisterRequest.label_counts``.
    label_counts_at_registration: bool = False
    #: True once the run is over (finished, or stopped by its failures): a device has nothing to
    #: join, and waits for the Fed Server's next run instead (device_agent/run_spec.py).
    finished: bool = False
    #: What the devices do so that what they send gives less away (``split_privacy``: their defences,
    #: and how they report label counts; docs/split-privacy.md).
    split_privacy: SplitPrivacyConfig = Field(default_factory=SplitPrivacyConfig)


class RegisterResponse(Message):
    run_id: str
    device_id: DeviceId
    shard: int   # the device's shard, or with dataset="local" the slot the Fed Server gave it
    token: str | None = None   # the device's bearer token (None when the servers run without auth)


#: The most devices one registration batch may hold (:class:`RegistrationBatch`).
MAX_REGISTRATION_BATCH = 100


class RegistrationBatch(Message):
    """Several devices of one agent registering in one request (``POST /v1/devices/registrations``),
    each exactly as it would alone."""

    devices: list[RegisterRequest] = Field(min_length=1, max_length=MAX_REGISTRATION_BATCH)

    @model_validator(mode="after")
    def _distinct(self) -> "RegistrationBatch":
        ids = [device.device_id for device in self.devices]
        if len(set(ids)) != len(ids):
            raise ValueError("devices names a device more than once")
        return self


class Refusal(Message):
    """Why one device of a batch was refused (not registered, a secure aggregation message not
    taken): the status and the one-line reason its own request would have been answered with."""

    status: int
    detail: str
    #: With status 429: seconds after which the device may register again (the ``Retry-After``
    #: its own registration would have been answered with).
    retry_after_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class RegistrationBatchResponse(Message):
    """Each device of a batch registered (its answer, with its token) or refused (why): one device's
    refusal changes nothing and does not stop the others."""

    registered: list[RegisterResponse] = []
    refused: dict[DeviceId, Refusal] = {}


class PrivacyTerms(Message):
    """A training task's privacy terms (``privacy.*``; docs/privacy.md): the device clips its
    update (its portion's change over the round) to ``clip_norm`` before it leaves. With
    ``noise_multiplier`` (``privacy.noise: distributed``, always with secure aggregation) it then
    weighs its update 1, not its sample count, and adds Gaussian noise of standard deviation
    ``noise_multiplier x clip_norm / sqrt(threshold)`` (the roster's threshold) to every entry
    before masking it."""

    clip_norm: float = Field(gt=0, allow_inf_nan=False)
    noise_multiplier: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class SecureTerms(Message):
    """A training task's secure aggregation terms (``secure_aggregation.*``; docs/privacy.md): the
    device clips each entry of its update to ``value_range``, weighs it by its sample count and
    encodes it with ``fraction_bits`` in 64-bit words before masking it (the threshold comes with
    the roster, :class:`SecAggRoster`); its shares and commitments are bound to the run ``run_id``
    (the Fed Server's current run, which checks them: a device that registered again after the Fed
    Server began a new run may still hold the old one's id)."""

    fraction_bits: int = Field(ge=1, le=62)
    value_range: float = Field(gt=0, allow_inf_nan=False)
    run_id: str = Field(min_length=1, max_length=128)


class TaskResponse(Message):
    """The answer to a device's poll: wait, train this round, act on a follow-up, evaluate, or stop.

    ``phase="train"``: train the weights ``weights_id`` names (the device's portion of the global
    model, blocks ``[0, split_point)``, and in U-shaped mode its head ``[head_start, num_blocks)``).
    ``phase="follow_up"``: two-phase algorithms only; ``extras`` is the Fed Server's answer to the
    device's report for ``round_id``; no weights (the device continues from its trained model).
    ``status="evaluate"``: federated evaluation of round ``round_id``: ``weights_id`` names the whole
    new global model; evaluate it on the held-out part and POST an :class:`EvaluationReport`.
    ``status="done"``: the run is over; ``weights_id`` names the final global model.

    The weights themselves are fetched by id (``GET /v1/devices/{device_id}/weights/{weights_id}``,
    a :class:`WeightsResponse`): every device of an attempt with the same split point is named the
    same weights, so an agent hosting many devices fetches them once, not once per device.
    """

    status: Literal["wait", "train", "evaluate", "done"]
    retry_after_s: float = 0.5
    phase: Literal["train", "follow_up"] = "train"
    round_id: int | None = None
    #: The logical round (1..rounds) the attempt ``round_id`` trains or evaluates, for logs
    #: (shared/round_label.py); None in a ``wait`` or ``done`` answer.
    round_index: int | None = Field(default=None, ge=1)
    split_point: int | None = None         # number of model blocks on the device
    #: U-shaped mode (``split.u_shaped``): the first block of the device's head; the device holds
    #: blocks ``[0, split_point)`` and ``[head_start, num_blocks)`` and computes the loss. None: the
    #: Main Server computes it (or nothing is split).
    head_start: int | None = Field(default=None, ge=2)
    num_blocks: int | None = None
    weights_id: WeightsId | None = Field(default=None, pattern=_WEIGHTS_ID_PATTERN)
    train: TrainConfig | None = None
    main_server_url: str | None = None     # None: split depth zero, train locally
    deadline_s: float | None = None
    half_precision: bool = False
    algorithm: str | None = None           # which DeviceLogic to build (shared/algorithms/registry.py)
    params: dict[str, JsonValue] = {}      # the algorithm's device-side hyperparameters
    extras: dict[str, PayloadValue] = {}   # per-device values for this round (e.g. a dual variable, tensors)
    report: bool = False                   # report after training and wait for a follow-up
    privacy: PrivacyTerms | None = None    # clip the update before it leaves
    secure_aggregation: SecureTerms | None = None   # mask the update (the secure stages first)


#: The most devices one agent's task request may add to its session (:class:`AgentTaskRequest`):
#: a request stays under about 200 KiB; an agent with more idle devices adds them over several.
MAX_AGENT_DEVICES = 1000
#: An agent session's id: 32 hex digits the agent draws at random when it starts. Whoever knows it
#: can take the session's tasks, so it is as secret as the devices' tokens.
AGENT_ID_PATTERN = r"^[0-9a-f]{32}$"
#: The longest an agent's task request may be held for work, as a device's task poll.
MAX_AGENT_WAIT_S = 30.0


def _check_distinct(devices: list["AgentDevice"], name: str) -> None:
    """ValueError when ``devices`` (the field ``name``) names a device more than once."""
    ids = [device.device_id for device in devices]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{name} names a device more than once")


class AgentDevice(Message):
    """A device an agent adds to its session as idle: the device's id and its current token (None
    on a server without authentication)."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    token: str | None = Field(default=None, max_length=256)


class AgentTaskRequest(Message):
    """An agent's request for work for any of its idle devices (``POST /v1/agents/{agent_id}/tasks``).

    ``add``: devices that are idle now (just registered, or done with a task), added to the
    session's idle set; a device leaves that set when the session hands it a task. ``wait_s``: how
    long the answer may be held until some idle device has a task (long-poll)."""

    add: list[AgentDevice] = Field(default=[], max_length=MAX_AGENT_DEVICES)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_AGENT_WAIT_S)

    @model_validator(mode="after")
    def _distinct(self) -> "AgentTaskRequest":
        _check_distinct(self.add, "add")
        return self


class DeviceTask(Message):
    """One device's task in an agent's answer: exactly what the device's own task poll would have
    answered (never ``wait``)."""

    device_id: DeviceId
    task: TaskResponse


class AgentTaskResponse(Message):
    """The answer to an agent's task request.

    ``tasks``: work for some of the session's idle devices, each handed out once (those devices are
    no longer idle in the session). ``unknown``: added devices this Fed Server has no registration
    for (it restarted): register them again. ``refused``: added devices whose token is not their
    current one (device id -> why): another registration replaced it. ``new_session``: this request
    opened the session (the first request, or the Fed Server restarted or forgot a session idle for
    :data:`fed_server.agent_sessions.SESSION_IDLE_S`): idle devices added before are not in it.
    ``ended``: devices the session handed a training task whose attempt closed without their upload
    (device id -> the attempt's ``round_id``): nothing they send for it will be taken, so the agent
    gives that task up, its weights' download included, rather than finish it over a slow link."""

    tasks: list[DeviceTask] = []
    unknown: list[DeviceId] = []
    refused: dict[DeviceId, str] = {}
    new_session: bool = False
    ended: dict[DeviceId, int] = {}


class ReportRequest(Message):
    """Two-phase algorithms: what a device reports after training, before it uploads."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    extras: dict[str, JsonValue]


class WithdrawRequest(Message):
    """A device that cannot contribute to round ``round_id`` (a task it cannot build or decode, a
    group that dropped it) says so, and the Fed Server takes it out of the attempt at once
    (``POST /v1/rounds/{round_id}/withdrawals``) instead of waiting for its upload."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    reason: str = Field(max_length=500)


class UpdateRequest(Message):
    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    num_samples: int = Field(ge=1)
    steps: int = Field(ge=0)
    train_loss: float = Field(allow_inf_nan=False)
    weights: WireState
    timings: DeviceTimings
    bytes_up: int = Field(ge=0)
    bytes_down: int = Field(ge=0)
    extras: dict[str, PayloadValue] = {}   # algorithm-specific values (checked by the algorithm; tensors too)
    #: A private task's (``TaskResponse.privacy``): whether the change was inside the clip bound
    #: before the device clipped it, which adaptive clipping counts (the upload, clipped, cannot say).
    inside_clip: bool | None = None


class EvaluationReport(Message):
    """Federated evaluation: how the global model of round ``round_id`` did on a device's held-out
    part. ``num_samples`` 0: the device held nothing out (it reports so the round need not wait)."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0, strict=True)
    num_samples: int = Field(ge=0, strict=True)
    correct: int = Field(ge=0, strict=True)               # classification; 0 for a regression task
    loss_sum: float = Field(ge=0, allow_inf_nan=False)   # the run's loss summed over the samples
    #: Regression task: squared and absolute errors summed over the samples (each sample's averaged
    #: over its targets); 0 for a classification task.
    squared_error_sum: float = Field(0.0, ge=0, allow_inf_nan=False)
    absolute_error_sum: float = Field(0.0, ge=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _consistent(self) -> "EvaluationReport":
        if self.correct > self.num_samples:
            raise ValueError(f"correct ({self.correct}) exceeds num_samples ({self.num_samples})")
        if self.num_samples == 0 and (self.loss_sum != 0 or self.squared_error_sum != 0 or self.absolute_error_sum != 0):
            raise ValueError("loss_sum must be 0 when no sample was evaluated (and so must the error sums)")
        return self


class Ack(Message):
    ok: bool = True
    detail: str = ""


# --- Fed Server <-> Main Server ----------------------------------------------------------------

class Participant(Message):
    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    split_point: int = Field(ge=1)
    num_samples: int = Field(ge=1)
    #: The nonce of the device's current token (shared/auth.py), so the Main Server can check
    #: device tokens, and refuse revoked ones, without a registry of its own.
    token_nonce: str | None = Field(default=None, max_length=64)
    #: The Fed Server's estimate of the seconds the device takes to download its client portion
    #: (portion bytes over its measured link rate; None: rate not known yet): part of the time
    #: its join is expected to take (``RoundPlan.patience``).
    download_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    # What else the Fed Server knows of the device, for the grouping (shared/algorithms/grouping.py,
    # ``group_candidate``), which sees the device the same way on either server.
    #: The kind the device registered (``DeviceProfileMsg.kind``).
    kind: str | None = Field(default=None, max_length=MAX_KIND_LENGTH)
    #: The Fed Server's client time table row of the device: (split point, running average of its
    #: measured round time there in seconds), one pair per split point measured, in split order;
    #: empty before its first measured round. Pairs, not a map: msgpack maps have string keys.
    round_times: list[tuple[Annotated[int, Field(ge=1)], Annotated[float, Field(ge=0, allow_inf_nan=False)]]] = \
        Field(default_factory=list)
    #: The device's link rate (bytes/s) as measured from its rounds; None before its first (the
    #: rate a device registers is its own claim, and is not passed on).
    link_rate: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @field_validator("round_times")
    @classmethod
    def _one_time_per_split(cls, value: list[tuple[int, float]]) -> list[tuple[int, float]]:
        splits = [split for split, _ in value]
        if len(set(splits)) != len(splits):
            raise ValueError(f"a split point has two round times: {splits}")
        return value


class PlannedGroup(Message):
    """A group the Fed Server formed (several Main Server replicas): its round-wide id and members."""

    group_id: int = Field(ge=0)
    members: list[DeviceId] = Field(min_length=1)


class RoundPlan(Message):
    """What the Main Server needs to serve one round."""

    run_id: str
    round_id: int = Field(ge=0)
    #: The logical round (1..rounds) this attempt trains: logs (shared/round_label.py) and the
    #: grouping's draw (shared/algorithms/grouping.py).
    round_index: int = Field(ge=1)
    model: str
    model_params: dict[str, JsonValue] = Field(default_factory=dict)
    num_classes: int
    input_shape: list[int]
    seed: int
    participants: list[Participant] = Field(min_length=1)
    server_weights: WireState              # global model blocks from the smallest split onward
    train: TrainConfig
    grouping: str                          # a name in GROUPINGS (shared/algorithms/registry.py)
    group_size: int = Field(ge=1)
    group_loss: str                        # a name in GROUP_LOSSES
    #: Names in MEMBER_DEFENCES, applied in order, and their parameters by name (``grouping.member_defences``).
    member_defences: list[str] = Field(default_factory=list, max_length=16)
    member_defence_params: dict[str, dict[str, JsonValue]] = Field(default_factory=dict)
    join_deadline_s: float = Field(gt=0)
    step_deadline_s: float = Field(gt=0)
    #: Each participant's own join deadline (``deadlines.patience``, shared/own_deadline.py): once
    #: half have joined, a missing one is waited for ``patience`` x the larger of its peers' join
    #: time and its ``download_s``, plus ``patience_grace_s``. None: only ``join_deadline_s``.
    patience: float | None = Field(default=None, ge=1, allow_inf_nan=False)
    patience_grace_s: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    #: How many of the slowest joins the peers' join time leaves out (``deadlines.ignore_slowest``).
    ignore_slowest: int = Field(default=0, ge=0, le=1_000_000)
    #: None: the Main Server groups the devices that join (one Main Server, as in the paper).
    #: Otherwise the groups the Fed Server formed for this replica, with round-wide group ids.
    groups: list[PlannedGroup] | None = None
    #: The largest |activation| a member's step may carry (``grouping.max_activation``); a step
    #: beyond it drops its sender from the group.
    max_activation: float = Field(1e4, gt=0, allow_inf_nan=False)
    #: U-shaped mode: where the devices' heads start; the server portion is the middle
    #: ``[smallest split, head_start)`` and a step comes in two halves (``/step/forward``,
    #: ``/step/backward``) with no label. None: the server portion runs to the end and computes the loss.
    head_start: int | None = Field(default=None, ge=2)

    @field_validator("participants")
    @classmethod
    def _unique(cls, value: list[Participant]) -> list[Participant]:
        ids = [p.device_id for p in value]
        if len(set(ids)) != len(ids):
            raise ValueError("participants must be distinct devices")
        return value

    @model_validator(mode="after")
    def _groups_cover_participants(self) -> "RoundPlan":
        if self.groups is None:
            return self
        members = [m for g in self.groups for m in g.members]
        if sorted(members) != sorted(p.device_id for p in self.participants):
            raise ValueError("planned groups must hold every participant exactly once")
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise ValueError("planned group ids must be distinct")
        return self


class ServerPortionUpload(Message):
    """One group's trained server-side copy, sent by the Main Server when the group finishes."""

    run_id: str
    round_id: int = Field(ge=0)
    group_id: int = Field(ge=0)
    members: list[DeviceId]                # devices that completed every step
    dropped: list[DeviceId]                # devices dropped at a deadline
    absent: list[DeviceId] = []            # participants that never joined the round (any group's upload may list them)
    start_block: int = Field(ge=0)
    weights: WireState
    #: Eq. 2 distance of the group's pooled label counts; None when its members withheld them.
    label_distance: float | None = Field(ge=0, allow_inf_nan=False)
    steps: int = Field(ge=0)
    train_time_s: float = Field(ge=0, allow_inf_nan=False)
    #: With ``member_updates`` (``grouping.member_defences``): each of ``members``' own state of the
    #: copy, keyed as ``weights`` (shared/algorithms/member_defence.py); empty otherwise.
    member_weights: dict[DeviceId, WireState] = Field(default_factory=dict)


# --- Main Server <- device ---------------------------------------------------------------------

class JoinRequest(Message):
    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    #: The device's samples per class, as the run says to report them (``split_privacy.label_counts``:
    #: exact, with local differential privacy, or withheld: empty).
    label_counts: list[int] = Field(default_factory=list)
    num_steps: int = Field(ge=1)

    @field_validator("label_counts")
    @classmethod
    def _non_negative(cls, value: list[int]) -> list[int]:
        return check_label_counts(value) if value else value


class RoundWatch(Message):
    """One line of a Main Server's round watch stream (``GET /v1/rounds/{round_id}/watch``):
    ``open`` is a heartbeat; ``done`` (every group's upload ended) or ``replaced`` (a newer plan)
    ends it.

    ``dropped``: the members this replica has dropped from the round so far, each with why (a
    missed step deadline, activations that failed the checks, a failed group step), so the Fed
    Server takes them out of the attempt at once instead of waiting for their uploads.
    ``undelivered``: groups whose server portion could not be delivered to the Fed Server; their
    members cannot be aggregated in this attempt."""

    round_id: int
    state: Literal["open", "done", "replaced"]
    dropped: dict[DeviceId, str] = {}
    undelivered: list[int] = []


class Departures(Message):
    """Fed Server -> Main Server (``POST /v1/rounds/{round_id}/departures``): participants the Fed
    Server took out of the attempt (a refused upload, a withdrawal), each with why, so the Main
    Server stops waiting for them at the join or at their group's barrier."""

    round_id: int = Field(ge=0)
    devices: dict[DeviceId, Annotated[str, Field(max_length=1000)]] = Field(min_length=1)


class JoinResponse(Message):
    group_id: int
    members: list[DeviceId]
    label_distance: float | None   # None: the members withheld their label counts


class StepRequest(Message):
    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    step: int = Field(ge=0)
    fx: WireTensor
    labels: WireTensor


class StepResponse(Message):
    dfx: WireTensor
    loss: float
    wait_s: float           # how long this device waited at the group's barrier
    server_s: float         # server-side training time of the step


class ForwardRequest(Message):
    """U-shaped mode, a step's first half: the activations at the device's cut, and no label."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    step: int = Field(ge=0)
    fx: WireTensor


class ForwardResponse(Message):
    """The middle's output for the device's rows, and the weight its mean loss has in the group's
    objective (times its dfx multiplier): the device scales its head's gradient by it."""

    output: WireTensor
    loss_weight: float = Field(ge=0, allow_inf_nan=False)
    wait_s: float           # how long this device waited at the group's barrier
    server_s: float         # server-side time of the half


class BackwardRequest(Message):
    """U-shaped mode, a step's second half: the gradient of the device's own mean loss at the
    middle's output (its head's input), shaped as that output."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    step: int = Field(ge=0)
    gradient: WireTensor


class BackwardResponse(Message):
    """The gradient at the device's cut (dfx) once the group's copy has stepped."""

    dfx: WireTensor
    wait_s: float           # how long this device waited for the group's gradients
    server_s: float         # server-side time of the half


class SecAggKeys(Message):
    """Secure aggregation's first stage: a device's two X25519 public keys for the attempt, one
    for its pairwise masks, one for the secret shares it exchanges."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    mask_key: bytes = Field(min_length=32, max_length=32)
    share_key: bytes = Field(min_length=32, max_length=32)


class SecAggRoster(Message):
    """The asking device's neighbourhood among the attempt's devices that sent their keys (itself
    and the devices it shares with and masks with), each with its keys (share index: the position
    in sorted order, from 1), and the threshold; ``ready`` False: the stage is still open."""

    ready: bool
    keys: dict[str, SecAggKeys] = {}
    threshold: int = 0
    #: Each of those devices' split point: it masks blocks ``[0, split)``, and two neighbours'
    #: pairwise masks cover the blocks both hold.
    splits: dict[str, int] = {}


class SecAggShares(Message):
    """Secure aggregation's second stage: a device's secret shares, one for each other device of
    its neighbourhood (recipient -> ChaCha20-Poly1305 ciphertext, which the Fed Server cannot open,
    followed by the commitments to its two shares), and its commitments to its seed and to the
    shares it keeps itself: what the Fed Server checks unmasking answers and rebuilt secrets
    against."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    shares: dict[str, bytes]
    #: 16 bytes (``shared.secagg.crypto.DIGEST_BYTES``).
    seed_commitment: bytes = Field(min_length=16, max_length=16)
    #: 32 bytes: to the share of its seed, then to the share of its mask key.
    own_commitments: bytes = Field(min_length=32, max_length=32)


class SecAggInbox(Message):
    """The shares dealt to one device (sender -> ciphertext and commitments, as the sender sent
    them) by every device that shared (those it masks with); ``ready`` False: the stage is still
    open."""

    ready: bool
    shares: dict[str, bytes] = {}


class SecAggUnmaskPlan(Message):
    """The unmasking stage: the devices whose masked updates are summed (``survivors``: shares of
    their own mask seeds wanted) and those that shared but sent none (``dropped``: shares of their
    mask keys wanted); ``ready`` False: uploads are still open."""

    ready: bool
    survivors: list[str] = []
    dropped: list[str] = []


class SecAggUnmask(Message):
    """A device's answer to the unmasking stage: its shares of the survivors' seeds and of the
    dropped devices' mask keys (owner -> share). Never both for one device."""

    device_id: DeviceId = Field(pattern=_ID_PATTERN)
    round_id: int = Field(ge=0)
    seed_shares: dict[str, bytes] = {}
    key_shares: dict[str, bytes] = {}


class SecAggBatch(Message):
    """Several devices' messages into the secure stages of attempt ``round_id``, sent by their agent
    in one request (``POST /v1/rounds/{round_id}/secagg/batch``): ``devices`` are the senders, each
    with its current token (None on a server without authentication), and every message is one of
    theirs. Each message is taken or refused on its own."""

    devices: list[AgentDevice] = Field(max_length=MAX_AGENT_DEVICES)
    keys: list[SecAggKeys] = Field(default=[], max_length=MAX_AGENT_DEVICES)
    shares: list[SecAggShares] = Field(default=[], max_length=MAX_AGENT_DEVICES)
    unmask: list[SecAggUnmask] = Field(default=[], max_length=MAX_AGENT_DEVICES)

    @model_validator(mode="after")
    def _one_message_per_sender(self) -> "SecAggBatch":
        _check_distinct(self.devices, "devices")
        senders = [*(m.device_id for m in self.keys), *(m.device_id for m in self.shares),
                   *(m.device_id for m in self.unmask)]
        if sorted(senders) != sorted(device.device_id for device in self.devices):
            raise ValueError("each device of devices sends exactly one message")
        return self


class SecAggBatchAck(Message):
    """The devices of a :class:`SecAggBatch` whose message was not taken (device id -> why); the
    others' were stored."""

    refused: dict[DeviceId, Refusal] = {}


class SecAggQuestion(Message):
    """An agent asking one stage's answer for several of its devices at once
    (``POST /v1/rounds/{round_id}/secagg/{stage}/batch``), each with its current token, held up to
    ``wait_s`` until the stage closes."""

    devices: list[AgentDevice] = Field(min_length=1, max_length=MAX_AGENT_DEVICES)
    wait_s: float = Field(default=0.0, ge=0.0, le=MAX_AGENT_WAIT_S)

    @model_validator(mode="after")
    def _distinct(self) -> "SecAggQuestion":
        _check_distinct(self.devices, "devices")
        return self


class SecAggAnswers(Message):
    """One stage's answer for each device of a :class:`SecAggQuestion`, in the field of its stage
    (``roster``: ``rosters``, ``inbox``: ``inboxes``, ``unmask``: ``plans``; ``ready`` False while
    it is open), or why the device was refused."""

    rosters: dict[DeviceId, SecAggRoster] = {}
    inboxes: dict[DeviceId, SecAggInbox] = {}
    plans: dict[DeviceId, SecAggUnmaskPlan] = {}
    refused: dict[DeviceId, Refusal] = {}
