"""FedOpt's adaptive server optimizers (Reddi et al., "Adaptive Federated Optimization", ICLR
2021, Algorithm 2): FedAdagrad, FedAdam and FedYogi.

Devices train as in FedAvg (plain local SGD, the run's settings). The Fed Server treats the round's
mean update ``Δ_t`` as a pseudo-gradient and steps the global model with an adaptive optimizer:

- ``m_t = β1 m_{t-1} + (1 - β1) Δ_t``
- FedAdagrad ``v_t = v_{t-1} + Δ_t²``; FedYogi ``v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)``;
  FedAdam ``v_t = β2 v_{t-1} + (1 - β2) Δ_t²``
- ``x_{t+1} = x_t + η m_t / (sqrt(v_t) + τ)``

with ``m_{-1} = 0`` and ``v_{-1} = τ²``, per coordinate of every trainable parameter. No bias
correction: Algorithm 2 has none. Split depth zero. One module, three algorithms: each variant is
a class here with its own line in ``ALGORITHMS`` (``fedadagrad``, ``fedadam``, ``fedyogi``).

Choices the paper leaves open, and why (docs/algorithms/fedopt.md):

- ``Δ_t`` is the run's aggregation rule minus ``x_t`` (default: the data-size-weighted mean with
  its bounds, as every algorithm here weighs; the paper writes the plain mean).
- ``v_{-1} = τ²``, the smallest the paper allows (it asks ``v_{-1} ≥ τ²``).
- Buffers (e.g. BatchNorm's running statistics) take the aggregation rule's value: they are not
  trained by gradients, so no optimizer steps them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import Field

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import (
    Algorithm, AlgorithmParams, Payload, RoundContext, Tensors, refuse_split_settings, trainable_parameters,
)
from shared.wire import decode_state, encode_state

if TYPE_CHECKING:
    from shared.config import RunConfig


class FedOptParams(AlgorithmParams):
    """``algorithm_params`` of FedAdagrad (and, with ``beta2``, of FedAdam and FedYogi)."""

    #: The server learning rate η (the paper tunes it per task).
    server_lr: float = Field(0.01, gt=0, allow_inf_nan=False)
    #: The first moment's decay β1 (the paper's experiments: 0.9).
    beta1: float = Field(0.9, ge=0, lt=1)
    #: The adaptivity τ: the smaller, the more adaptive (the paper tunes it; 1e-3 is in its range).
    tau: float = Field(1e-3, gt=0, allow_inf_nan=False)


class AdaptiveMomentParams(FedOptParams):
    """``algorithm_params`` of FedAdam and FedYogi."""

    #: The second moment's decay β2 (the paper's experiments: 0.99).
    beta2: float = Field(0.99, ge=0, lt=1)


class FedOpt(Algorithm[Payload]):
    """Fed Server side of the three: the moments and the server step; a variant gives
    :meth:`second_moment`. Registered only through its variants."""

    Params = FedOptParams

    def __init__(self, config: "RunConfig") -> None:
        super().__init__(config)
        self.params: FedOptParams
        refuse_split_settings(config)
        self.m: Tensors = {}
        self.v: Tensors = {}

    def bind_model(self, model: torch.nn.Module) -> None:
        super().bind_model(model)
        layout = trainable_parameters(model)
        self.m = {n: torch.zeros_like(p, device="cpu") for n, p in layout.items()}
        self.v = {n: torch.full_like(p, self.params.tau ** 2, device="cpu") for n, p in layout.items()}

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        """``v_t`` from ``v_{t-1}`` and ``Δ_t²``."""
        raise NotImplementedError

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution], extras: Mapping[str, Payload]) -> dict[str, torch.Tensor]:
        new = self.apply_aggregation_rule(ctx, global_state, contributions)
        p = self.params
        for n in self.m:
            x = global_state[n]
            delta = new[n] - x
            self.m[n] = p.beta1 * self.m[n] + (1 - p.beta1) * delta
            self.v[n] = self.second_moment(self.v[n], delta * delta)
            new[n] = x + p.server_lr * self.m[n] / (self.v[n].sqrt() + p.tau)
        return new

    def state_dict(self) -> dict[str, Any]:
        return {"m": encode_state(self.m), "v": encode_state(self.v)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m = {n: t.clone() for n, t in decode_state(state["m"], expect=self.m, what="checkpoint m").items()}
        self.v = {n: t.clone() for n, t in decode_state(state["v"], expect=self.v, what="checkpoint v").items()}


class FedAdagrad(FedOpt):
    """``v_t = v_{t-1} + Δ_t²``."""

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq


class FedAdam(FedOpt):
    """``v_t = β2 v_{t-1} + (1 - β2) Δ_t²``."""

    Params = AdaptiveMomentParams
    params: AdaptiveMomentParams

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        beta2 = self.params.beta2
        return beta2 * v + (1 - beta2) * delta_sq


class FedYogi(FedOpt):
    """``v_t = v_{t-1} - (1 - β2) Δ_t² sign(v_{t-1} - Δ_t²)``."""

    Params = AdaptiveMomentParams
    params: AdaptiveMomentParams

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.params.beta2) * delta_sq * torch.sign(v - delta_sq)
