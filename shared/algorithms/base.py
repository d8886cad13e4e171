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
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from shared.algorithms.aggregation import Contribution, layerwise_aggregate

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.data import ArrayDataset

SplitMode = Literal["sliding", "fixed", "zero"]
#: JSON-like values carried in tasks, reports and uploads (numbers, strings, lists, maps).
Extras = dict[str, Any]


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


class DeviceLogic:
    """What an algorithm changes on a device in one round. Defaults: plain cross-entropy.

    Only split-depth-zero rounds use :meth:`loss` (in split mode the Main Server computes the
    loss); the other hooks apply in every mode.
    """

    def __init__(self, params: Extras) -> None:
        self.params = params

    def begin_round(self, model: torch.nn.Module, extras: Extras, data: "ArrayDataset") -> None:
        """Called with the freshly loaded model (the global weights) before training."""

    def training_data(self, data: "ArrayDataset") -> "ArrayDataset":
        """The part of the shard that is trained on (FedBC keeps a local test split back)."""
        return data

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The local objective on one mini-batch."""
        return F.cross_entropy(model(x), y)

    def report(self, model: torch.nn.Module, data: "ArrayDataset") -> Extras:
        """Two-phase algorithms: what the device tells the Fed Server after training."""
        return {}

    def follow_up(self, model: torch.nn.Module, data: "ArrayDataset", instruction: Extras) -> None:
        """Two-phase algorithms: act on the Fed Server's answer to the report (e.g. refine)."""

    def upload_extras(self, model: torch.nn.Module, data: "ArrayDataset") -> Extras:
        """Extra values sent with the trained weights."""
        return {}


class Algorithm:
    """Fed Server side. Defaults: split depth zero, Algorithm 1 aggregation.

    Which devices train is not the algorithm's business: the coordinator composes the configured
    selection policy (``shared/algorithms/selection.py``) with :meth:`eligible`.
    """

    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    Logic: ClassVar[type[DeviceLogic]] = DeviceLogic
    #: True when devices report after training and wait for a follow-up before uploading.
    needs_report: ClassVar[bool] = False

    def __init__(self, config: "RunConfig") -> None:
        self.config = config
        self.params = self.Params.model_validate(config.algorithm_params)

    def bind_model(self, model: torch.nn.Module) -> None:
        """Called once by the Fed Server with the global model (names of its output layer etc.)."""
        self.output_layer: str = getattr(model, "output_layer", "")

    # --- Fed Server decisions ------------------------------------------------------------------
    def split_mode(self) -> SplitMode:
        """``zero``: the whole model trains on the device; ``fixed``: every device gets the
        largest client portion; ``sliding``: per-device split from the client time table."""
        return "zero"

    def eligible(self, devices: Sequence[str]) -> list[str]:
        """Devices that may be selected at all (FedIPG's exit strategy removes some)."""
        return list(devices)

    def device_params(self) -> Extras:
        """Hyperparameters every device needs for :class:`DeviceLogic` (sent in each task)."""
        return self.params.model_dump(mode="json")

    def task_extras(self, device_id: str, ctx: RoundContext) -> Extras:
        """Per-device values for this round's task (e.g. FedBC's dual variable)."""
        return {}

    def plan_follow_ups(self, ctx: RoundContext, reports: Mapping[str, Extras]) -> dict[str, Extras]:
        """Two-phase algorithms: each reporting device's instruction (raise ValueError on bad reports)."""
        return {device: {} for device in reports}

    def accept_update(self, device_id: str, ctx: RoundContext, state: Mapping[str, torch.Tensor], extras: Extras,
                      num_samples: int, global_state: Mapping[str, torch.Tensor]) -> None:
        """Check an upload's extras (ValueError -> 422, nothing stored) before it is accepted."""

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution], extras: Mapping[str, Extras]) -> dict[str, torch.Tensor]:
        """New global model from the round's uploads, keyed by device (S2FL Algorithm 1; FedAvg
        when nothing is split). Also the place to update per-device state from the uploads."""
        return layerwise_aggregate(global_state, list(contributions.values()))

    def evaluate(self, model: torch.nn.Module) -> Extras:
        """Extra evaluation of the new global model (e.g. out-of-distribution accuracy)."""
        return {}

    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, Extras]) -> Extras:
        """Extra fields for the round's metrics record."""
        return {}

    def state_dict(self) -> Extras:
        """Per-run state that a checkpoint must keep (JSON-able)."""
        return {}

    def load_state_dict(self, state: Extras) -> None:
        """Restore what :meth:`state_dict` returned."""

    # --- Main Server decisions -----------------------------------------------------------------
    def grouping(self) -> str:
        """How the Main Server groups a round's devices (one server copy per group): a name in
        ``GROUPINGS`` (``shared/algorithms/registry.py``), carried to it in the round plan."""
        return "singleton"

    # --- device side ---------------------------------------------------------------------------
    @classmethod
    def device_logic(cls, params: Extras) -> DeviceLogic:
        """The device's per-round logic, from the parameters sent in the task."""
        return cls.Logic(params)


def finite_number(value: Any, what: str, minimum: float | None = None) -> float:
    """``value`` as a float if it is a finite number (not a bool), else ValueError naming ``what``.
    For numbers that crossed the network in extras and reports."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return float(value)
