"""The small interfaces every algorithm implements.

In the spirit of Flower's ``Strategy``: an algorithm decides *what* happens in a round (which
devices train, where each one's model is cut, how the Main Server groups them, what a device
optimises, how updates are combined, what per-device state it keeps); the services decide *how*
it travels. Services call these methods and never branch on an algorithm's name. Adding an
algorithm = one new module + one line in ``registry.py``.

Two objects per algorithm:
- :class:`Algorithm` lives on the Fed Server (one per run; its state goes into checkpoints).
- :class:`DeviceLogic` lives on a device (one per round), built by ``Algorithm.device_logic``
  from the JSON-able ``device_params()`` that travel in every task, so devices need no run config.
  What it keeps from one round to the next is its ``State`` (a :class:`Payload`), which the
  device's agent holds on disk between the device's rounds (``device_agent/device_state.py``).

What the two exchange besides weights is typed: each algorithm declares pydantic :class:`Payload`
models (``TaskExtras``, ``UploadExtras``; empty by default). On the wire they stay msgpack maps;
the framework validates every map that arrives against the algorithm's model
(:func:`parse_payload`: the Fed Server for uploads, the device for tasks), so the hooks below only
ever see well-formed, finite values and keep only the checks that need the run's state. A payload
field of type :data:`ParameterTensors` carries tensors, one per trainable parameter of the portion
the round trains, checked as the weights are (docs/wire-format.md).

An algorithm whose devices report after training and wait for the Fed Server's answer before
uploading adds the two-phase mixins of ``shared/algorithms/two_phase.py`` (FNR-FL does).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Generic, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, PlainValidator, ValidationError, ValidationInfo
from pydantic_core import PydanticCustomError

from shared.algorithms.aggregation import Contribution
from shared.algorithms.registry import build_aggregation_rule
from shared.algorithms.robust_aggregation import AggregationRule
from shared.config import TrainConfig
from shared.errors import Invalid
from shared.losses import Loss, build_loss
from shared.wire import WireError, check_tensors, decode_state, encode_state

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.data import ArrayDataset

log = logging.getLogger(__name__)

SplitMode = Literal["sliding", "fixed", "zero"]
#: A JSON-able map that is not a payload: device parameters, metrics. (An algorithm's checkpoint
#: state is msgpack-able, which is more: see :meth:`Algorithm.state_dict`.)
JsonMap = dict[str, Any]
#: Tensors by parameter name: what :func:`trainable_parameters` gives, and a payload's
#: :data:`ParameterTensors` once validated.
Tensors = dict[str, torch.Tensor]


def trainable_parameters(module: torch.nn.Module) -> Tensors:
    """``module``'s trainable parameters by name (the full model's names for a portion), as they
    are: no copy. On a meta-device layout, their names, shapes and dtypes at no cost."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def _parameter_tensors(raw: Any, info: ValidationInfo) -> Tensors:
    """A :data:`ParameterTensors` field's value: tensor maps from the wire decoded and checked
    (:func:`shared.wire.decode_state`), tensors built in this process checked the same way
    (:func:`shared.wire.check_tensors`), against the context's ``parameters`` when given."""
    expect = (info.context or {}).get("parameters")
    what = info.field_name or "tensors"
    try:
        if isinstance(raw, Mapping) and raw and all(isinstance(t, torch.Tensor) for t in raw.values()):
            check_tensors(raw, expect, what)
            return {name: t.detach() for name, t in raw.items()}
        return decode_state(raw, expect=expect, what=what)
    except WireError as exc:   # the field is named once: parse_payload puts it in front
        raise PydanticCustomError("tensors", str(exc).removeprefix(f"{what}: ")) from None


#: A payload field holding one tensor per trainable parameter of the portion a round trains (a
#: control variate, an error-feedback residual, ...). On the wire, a map of parameter name ->
#: tensor map, exactly as a model portion travels; every tensor is checked as the weights are: a
#: dtype the wire carries, the byte length its shape needs, at most ``MAX_ELEMENTS``, finite, and,
#: where the framework parses it (:func:`parse_payload` with ``parameters``), exactly the
#: portion's trainable parameters: their names in order, shapes and dtypes. Decoded tensors view
#: the received bytes: read them, or clone them before changing them in place.
ParameterTensors = Annotated[Tensors, PlainValidator(_parameter_tensors)]


def _is_tensors(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(t, torch.Tensor) for t in value.values())


class Payload(BaseModel):
    """Base of an algorithm's wire payloads (task extras, reports, follow-ups, upload extras).

    Strict on purpose, since these values cross the network: unknown keys are refused, numbers
    must be finite, and no type is coerced (no ``true`` for a count, no ``"1.5"`` for a float).
    The empty model is the default of every payload an algorithm does not use.
    """

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    def to_wire(self) -> JsonMap:
        """The msgpack map that carries this payload. Unset optional fields (None) are left out,
        so the wire keys are those the algorithm actually sends; tensors (:data:`ParameterTensors`)
        go as tensor maps (:func:`shared.wire.encode_state`), everything else as JSON values."""
        tensors = {name for name, value in self if _is_tensors(value)}
        wire = self.model_dump(mode="json", by_alias=True, exclude_none=True, exclude=tensors)
        for name in tensors:
            wire[type(self).model_fields[name].alias or name] = encode_state(getattr(self, name))
        return wire


P = TypeVar("P", bound=Payload)
# The payload models an algorithm's hooks receive: a subclass names its own (e.g.
# ``Algorithm[FedBCUploadExtras]``, ``DeviceLogic[FedBCTaskExtras]``), the framework has validated
# every value against them, and a plain ``Algorithm`` / ``DeviceLogic`` leaves them open.
TaskExtrasT = TypeVar("TaskExtrasT", bound=Payload)
UploadExtrasT = TypeVar("UploadExtrasT", bound=Payload)


def parse_payload(model: type[P], raw: Mapping[str, Any], what: str,
                  parameters: Mapping[str, torch.Tensor] | None = None) -> P:
    """``raw`` (a map that arrived over the network) as ``model``, or :class:`~shared.errors.Invalid`
    naming ``what`` and each offending field, e.g. ``report: feature_norms.3: Input should be
    greater than or equal to 0``. ``parameters``: the trainable parameters of the portion the
    round trains (:func:`trainable_parameters`; a layout's serve), which every
    :data:`ParameterTensors` field must match exactly."""
    try:
        return model.model_validate(dict(raw), context={"parameters": parameters})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            field = ".".join(str(part) for part in err["loc"])  # empty for a check across fields
            problems.append(f"{field}: {err['msg']}" if field else err["msg"])
        raise Invalid(f"{what}: {'; '.join(problems)}") from None


@dataclass(frozen=True)
class RoundContext:
    """Which round a hook is called for: the logical round and the attempt that runs it.

    ``index`` is the paper's round t (1..rounds): it advances only when a round succeeds, so a
    retried or resumed round keeps its index. ``attempt`` is the wire ``round_id``: every try of a
    round gets a new one, never reused, so a stale upload of a failed attempt cannot land in the
    retry. Algorithms key their per-round state by ``index``; only transport-level checks compare
    ``attempt``.
    """

    index: int
    attempt: int


class AlgorithmParams(BaseModel):
    """Base of an algorithm's own hyperparameters (``RunConfig.algorithm_params``)."""

    model_config = ConfigDict(extra="forbid")


class DeviceLogic(Generic[TaskExtrasT]):
    """What an algorithm changes on a device in one round. Default: the run's loss
    (``criterion``, ``train.loss``; shared/losses.py), cross-entropy unless the run says otherwise.

    Only split-depth-zero rounds use :meth:`loss` (in split mode the Main Server computes the
    loss); the other hooks apply in every mode.

    A logic lives for one round. What it keeps for the device's next round is its ``State``: the
    device's agent hands the kept one to :meth:`restore_state` before :meth:`begin_round`, and
    asks :meth:`kept_state` once the upload is built, before sending it
    (``device_agent/device_state.py``; between rounds it is on disk, not in memory).
    """

    #: The run's loss; :meth:`Algorithm.device_logic` sets the task's.
    criterion: Loss = build_loss()
    #: The task's training settings (``train``: lr, momentum, batch size, local epochs, ...);
    #: :meth:`Algorithm.device_logic` sets the task's.
    train: TrainConfig = TrainConfig()
    #: What the logic keeps on the device from one round to the next (a :class:`Payload`, whose
    #: :data:`ParameterTensors` are the whole model's trainable parameters), or None: nothing.
    State: ClassVar[type[Payload] | None] = None

    def __init__(self, params: JsonMap) -> None:
        self.params = params

    def begin_round(self, model: torch.nn.Module, extras: TaskExtrasT, data: "ArrayDataset") -> None:
        """Called with the freshly loaded model (the global weights) and the task's validated
        ``Algorithm.TaskExtras`` before training."""

    def training_data(self, data: "ArrayDataset") -> "ArrayDataset":
        """The part of the shard that is trained on (FedBC keeps a local test split back)."""
        return data

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local objective on one mini-batch."""
        return self.criterion.mean(model(x), y)

    def upload_extras(self, model: torch.nn.Module, data: "ArrayDataset") -> Payload:
        """Extra values sent with the trained weights (an ``Algorithm.UploadExtras``)."""
        return Payload()

    def restore_state(self, state: Payload | None) -> None:
        """Called before :meth:`begin_round` with the validated ``State`` this device kept after its
        last round with a ``State`` (None: it kept none yet, or its agent lost it: an agent started
        without ``--state-dir`` forgets on restart)."""

    def kept_state(self) -> Payload | None:
        """The ``State`` to keep until this device's next round, asked once the upload is built and
        before it is sent (None: keep nothing new). The device cannot know then whether the Fed
        Server will aggregate the upload: a state that must agree with the server's keeps its
        change pending until a later task says (SCAFFOLD's ``last_aggregated``)."""
        return None


class Algorithm(Generic[UploadExtrasT]):
    """Fed Server side. Defaults: split depth zero, the configured aggregation rule (``aggregation``).

    Which devices train is not the algorithm's business: the coordinator composes the configured
    selection policy (``shared/algorithms/selection.py``) with :meth:`eligible`.
    """

    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    Logic: ClassVar[type[DeviceLogic]] = DeviceLogic
    #: Why the algorithm cannot run a regression task (it needs class labels), or None when it
    #: works with any loss: ``validate_run_config`` refuses such a run in one line.
    needs_classes: ClassVar[str | None] = None
    #: Why the algorithm needs each device's own update at the Fed Server (its aggregate is not a
    #: weighted mean of the updates, or it takes per-device values beside them), or None when its
    #: aggregate is a weighted mean: only then can the updates be clipped and noised as a sum
    #: (``validate_run_config`` refuses the others in a private run, in one line; docs/privacy.md).
    individual_updates: ClassVar[str | None] = None
    #: The payloads (validated wherever they arrive, see :func:`parse_payload`): per-device values
    #: of a task, and the values sent with an upload.
    TaskExtras: ClassVar[type[Payload]] = Payload
    UploadExtras: ClassVar[type[Payload]] = Payload

    def __init__(self, config: "RunConfig") -> None:
        self.config = config
        self.params = self.Params.model_validate(config.algorithm_params)
        self.aggregation_rule: AggregationRule = build_aggregation_rule(config)

    def bind_model(self, model: torch.nn.Module) -> None:
        """Called once by the Fed Server with the global model (names of its output layer etc.)."""
        self.output_layer: str = getattr(model, "output_layer", None) or ""

    def model_parts_needed(self) -> tuple[str, ...]:
        """The optional model parts this algorithm uses, as ``SplitModel`` attribute names
        (``"feature_block"``, ``"output_layer"``): ``validate_run_config`` refuses a model that does
        not declare them, at start, with a message saying what to add (docs/models.md)."""
        return ()

    # --- Fed Server decisions ------------------------------------------------------------------
    def split_mode(self) -> SplitMode:
        """``zero``: the whole model trains on the device; ``fixed``: every device gets the
        largest client portion; ``sliding``: per-device split from the client time table."""
        return "zero"

    def eligible(self, devices: Sequence[str]) -> list[str]:
        """Devices that may be selected at all (FedIPG's exit strategy removes some)."""
        return list(devices)

    def device_params(self) -> JsonMap:
        """Hyperparameters every device needs for :class:`DeviceLogic` (sent in each task)."""
        return self.params.model_dump(mode="json")

    def task_extras(self, device_id: str, ctx: RoundContext) -> Payload:
        """Per-device values for this round's task (a ``TaskExtras``; e.g. FedBC's dual variable)."""
        return self.TaskExtras()

    def accept_update(self, device_id: str, ctx: RoundContext, state: Mapping[str, torch.Tensor], extras: UploadExtrasT,
                      num_samples: int, global_state: Mapping[str, torch.Tensor]) -> None:
        """Checks of an upload that need the run's state, on its validated ``UploadExtras``
        (ValueError -> 422, nothing stored) before it is accepted."""

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution], extras: Mapping[str, UploadExtrasT]) -> dict[str, torch.Tensor]:
        """New global model from the round's uploads, keyed by device: the configured aggregation
        rule (default: S2FL Algorithm 1's mean with bounded weights and updates; FedAvg when nothing
        is split). Also the place to update per-device state from the uploads."""
        return self.apply_aggregation_rule(ctx, global_state, contributions)

    def apply_aggregation_rule(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                               contributions: Mapping[str, Contribution]) -> dict[str, torch.Tensor]:
        """The configured rule (``aggregation``) over ``contributions``; logs which devices' weights
        or updates its bounds changed, since an honest run should rarely see that."""
        result = self.aggregation_rule.aggregate(global_state, contributions)
        if result.capped:
            log.info("round %d (attempt %d): aggregation weight bounded for %s", ctx.index, ctx.attempt,
                     ", ".join(f"{d} ({contributions[d].weight:g} -> {w:g})" for d, w in sorted(result.capped.items())))
        if result.clipped:
            log.info("round %d (attempt %d): update clipped to the round's norm bound for %s", ctx.index, ctx.attempt,
                     "; ".join(f"{d} on {', '.join(keys)}" for d, keys in sorted(result.clipped.items())))
        return result.state

    def evaluate(self, model: torch.nn.Module) -> JsonMap:
        """Extra evaluation of the new global model (e.g. out-of-distribution accuracy)."""
        return {}

    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, UploadExtrasT]) -> JsonMap:
        """Extra fields for the round's metrics record (``extras``: the aggregated uploads' ``UploadExtras``)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Per-run state that a checkpoint must keep. Msgpack-able, since the checkpoint is msgpack
        (docs/wire-format.md): JSON-like values (string map keys), and tensors as
        :func:`shared.wire.encode_state` maps, which :meth:`load_state_dict` decodes and checks with
        :func:`shared.wire.decode_state`. Never pickled."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (called after :meth:`bind_model`)."""

    # --- Main Server decisions -----------------------------------------------------------------
    def grouping(self) -> str:
        """How the Main Server groups a round's devices (one server copy per group): a name in
        ``GROUPINGS`` (``shared/algorithms/registry.py``), carried to it in the round plan."""
        return "singleton"

    # --- device side ---------------------------------------------------------------------------
    @classmethod
    def device_logic(cls, params: JsonMap, criterion: Loss | None = None, train: TrainConfig | None = None) -> DeviceLogic:
        """The device's per-round logic, from the parameters sent in the task, with the run's loss
        ``criterion`` (None: cross-entropy) and the task's ``train`` settings (None: the defaults)."""
        logic = cls.Logic(params)
        if criterion is not None:
            logic.criterion = criterion
        if train is not None:
            logic.train = train
        return logic


def refuse_split_settings(config: "RunConfig") -> None:
    """ValueError in one line when ``config`` sets a split-learning switch (``split.sliding``,
    ``grouping.label_balance``, ``grouping.method``) for its algorithm, which trains the whole model
    on the device only (split depth zero): the setting would silently do nothing."""
    for key, value in (("split.sliding", config.split.sliding), ("grouping.label_balance", config.grouping.label_balance),
                       ("grouping.method", config.grouping.method)):
        if value is not None:
            raise ValueError(f"algorithm {config.algorithm!r} trains the whole model on the device (split depth zero), "
                             f"so {key} does not apply: leave it unset")

