"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020), Algorithm 1 with option II.

Control variates correct each device's drift from the global optimum on non-IID data. The Fed
Server holds ``c``, each device its own ``c_i``; a round on device i, given the global model x and c:

- ``y <- x``, then K local steps ``y <- y - lr (g_i(y) - c_i + c)``;
- option II: ``c_i+ = c_i - c + (x - y) / (K lr)``;
- it sends ``Δy = y - x`` (as the trained weights) and ``Δc_i = c_i+ - c_i``, and keeps ``c_i+``.

The Fed Server, over the devices S aggregated out of N: ``x <- x + η_g Δx`` and
``c <- c + (|S| / N) Δc``, with ``Δc = (1 / |S|) Σ Δc_i``, so c stays the mean of all N c_i.

The device's ``c_i`` crosses rounds as its logic's ``State`` (``device_agent/device_state.py``),
c travels in each task and ``Δc_i`` with each upload, both as :data:`ParameterTensors`.
Split depth zero only. Choices the paper leaves open, and why (docs/algorithms/scaffold.md):

- ``Δx`` is the run's aggregation rule (default: the data-size-weighted mean with its bounds, as
  every algorithm here weighs), ``Δc`` the plain mean of the paper, so that c remains the mean
  of the devices' c_i.
- c and every c_i start at 0; a device that was never aggregated has ``c_i = 0``.
- A device cannot know whether its upload will be aggregated (an attempt may fail after it), so
  its ``c_i+`` stays pending until a later task's ``last_aggregated`` names that round; otherwise
  it is dropped and the device goes on from its last confirmed c_i. c and the c_i thus agree
  through failed attempts and Fed Server restarts.
- N is ``data.num_devices``, the run's population.
- The corrected step is the gradient of the run's loss plus ``<c - c_i, y>``, under the run's SGD:
  ``train.momentum`` must be 0 (option II reads K plain steps of ``lr`` back from ``x - y``),
  ``train.weight_decay`` is part of g_i.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import (
    Algorithm, AlgorithmParams, DeviceLogic, JsonMap, ParameterTensors, Payload, RoundContext, Tensors,
    refuse_split_settings, trainable_parameters,
)
from shared.algorithms.proximal import frozen_parameters
from shared.wire import decode_state, encode_state

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.data import ArrayDataset

log = logging.getLogger(__name__)


class ScaffoldParams(AlgorithmParams):
    """``algorithm_params`` of SCAFFOLD."""

    #: The global step size η_g; 1 (the paper's usual choice) takes the aggregation rule's model as it is.
    global_lr: float = Field(1.0, gt=0, allow_inf_nan=False)


class ScaffoldTaskExtras(Payload):
    """What a device's task carries: the server control variate, the round, and the last round in
    which the Fed Server aggregated this device's upload (None: never)."""

    c: ParameterTensors
    round_index: int = Field(ge=1)
    last_aggregated: int | None = Field(None, ge=1)


class ScaffoldUploadExtras(Payload):
    """What an upload carries besides the trained weights: ``Δc_i = c_i+ - c_i``."""

    delta_c: ParameterTensors


class ScaffoldState(Payload):
    """What a device keeps between its rounds: its confirmed ``c_i`` (None: 0) and the ``c_i+`` of
    round ``pending_round``, confirmed once a task's ``last_aggregated`` names that round."""

    c_i: ParameterTensors | None = None
    pending: ParameterTensors | None = None
    pending_round: int | None = Field(None, ge=1)


class ScaffoldLogic(DeviceLogic[ScaffoldTaskExtras]):
    """Device side: the corrected local steps and option II's ``c_i+``."""

    State = ScaffoldState

    def __init__(self, params: JsonMap) -> None:
        super().__init__(params)
        self.kept = ScaffoldState()

    def restore_state(self, state: Payload | None) -> None:
        assert state is None or isinstance(state, ScaffoldState)
        self.kept = state or ScaffoldState()

    def begin_round(self, model: torch.nn.Module, extras: ScaffoldTaskExtras, data: "ArrayDataset") -> None:
        kept = self.kept
        if kept.c_i is None and kept.pending is None and extras.last_aggregated is not None:
            log.warning("round %d: this device's c_i from round %d is lost (its agent restarted without --state-dir?): "
                        "it starts again from c_i = 0, and c no longer equals the mean of the devices' c_i",
                        extras.round_index, extras.last_aggregated)
        confirmed = kept.pending if kept.pending_round is not None and kept.pending_round == extras.last_aggregated \
            else kept.c_i
        self.x = frozen_parameters(model)
        self.c_i = {n: confirmed[n].to(x.device) if confirmed is not None else torch.zeros_like(x)
                    for n, x in self.x.items()}
        self.c = {n: c.to(self.x[n].device) for n, c in extras.c.items()}
        self.correction = {n: self.c[n] - self.c_i[n] for n in self.x}
        self.round_index = extras.round_index
        self.steps = 0
        self.next_state: ScaffoldState | None = None

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        params = dict(model.named_parameters())
        linear = torch.stack([(params[n] * corr).sum() for n, corr in self.correction.items()]).sum()
        # Adds exactly c - c_i to each gradient and nothing to the value: the round's recorded
        # train loss stays the run's loss.
        return self.criterion.mean(model(x), y) + (linear - linear.detach())

    def upload_extras(self, model: torch.nn.Module, data: "ArrayDataset") -> ScaffoldUploadExtras:
        assert self.steps > 0, "a round takes at least one local step"
        scale = 1.0 / (self.steps * self.train.lr)
        y = trainable_parameters(model)
        c_plus = {n: self.c_i[n] - self.c[n] + (self.x[n] - y[n].detach()) * scale for n in self.x}
        self.next_state = ScaffoldState(c_i=self.c_i, pending=c_plus, pending_round=self.round_index)
        return ScaffoldUploadExtras(delta_c={n: c_plus[n] - self.c_i[n] for n in self.x})

    def kept_state(self) -> ScaffoldState | None:
        return self.next_state


class Scaffold(Algorithm[ScaffoldUploadExtras]):
    """Fed Server side: c, each device's last aggregated round, and the global update."""

    Params = ScaffoldParams
    Logic = ScaffoldLogic
    TaskExtras = ScaffoldTaskExtras
    UploadExtras = ScaffoldUploadExtras
    individual_updates = "each device sends the change of its control variate beside its update"

    def __init__(self, config: "RunConfig") -> None:
        super().__init__(config)
        self.params: ScaffoldParams
        refuse_split_settings(config)
        if config.train.momentum != 0:
            raise ValueError("algorithm 'scaffold' takes plain SGD steps (option II reads K steps of train.lr back "
                             f"from the model's move): set train.momentum to 0 (got {config.train.momentum:g})")
        self.num_devices = config.data.num_devices
        self.c: Tensors = {}
        self.last_aggregated: dict[str, int] = {}

    def bind_model(self, model: torch.nn.Module) -> None:
        super().bind_model(model)
        self.c = {n: torch.zeros_like(p, device="cpu") for n, p in trainable_parameters(model).items()}

    def task_extras(self, device_id: str, ctx: RoundContext) -> ScaffoldTaskExtras:
        return ScaffoldTaskExtras(c=self.c, round_index=ctx.index, last_aggregated=self.last_aggregated.get(device_id))

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution],
                  extras: Mapping[str, ScaffoldUploadExtras]) -> dict[str, torch.Tensor]:
        new = self.apply_aggregation_rule(ctx, global_state, contributions)
        if self.params.global_lr != 1.0:
            for n in self.c:
                new[n] = global_state[n] + self.params.global_lr * (new[n] - global_state[n])
        for n in self.c:
            self.c[n] = self.c[n] + torch.stack([extras[d].delta_c[n] for d in contributions]).sum(0) / self.num_devices
        for device in contributions:
            self.last_aggregated[device] = ctx.index
        return new

    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, ScaffoldUploadExtras]) -> JsonMap:
        return {"c_norm": float(torch.stack([c.double().square().sum() for c in self.c.values()]).sum().sqrt())}

    def state_dict(self) -> dict[str, Any]:
        return {"c": encode_state(self.c), "last_aggregated": dict(self.last_aggregated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        decoded = decode_state(state["c"], expect=self.c, what="checkpoint scaffold c")
        self.c = {n: t.clone() for n, t in decoded.items()}
        self.last_aggregated = {str(d): int(r) for d, r in state["last_aggregated"].items()}
