"""FedIPG (Hao et al., "Invariant Federated Learning ..."; also called FedIPM): invariant penalty
plus exit strategy, split depth zero. Reference and choices: ``docs/algorithms/fedipg.md``.

Device side (:class:`FedIPGLogic`): each mini-batch minimises the paper's Eq. (8)

    f_i(w) = R_i(w) + lam * <grad R_i(w), w>^2

with R the batch-mean cross-entropy. The statistic ``s = <grad R, w>`` is built with
``create_graph=True`` and the explicit ``w`` factor is *not* detached, so ``backward`` produces the
exact gradient of Eq. (29): ``grad R + 2 lam s (grad R + H w)`` (double backpropagation).

Fed Server side (:class:`FedIPG`): the exit strategy. Devices in ``I_OOD`` (exited) are removed by
:meth:`FedIPG.eligible`, so they are never selected, never asked to train, their uploads (if any)
are refused, and they are left out of aggregation; like every device they receive the final global
model with the run's "done" task (the Fed Server sends it to all devices). Aggregation is the
normalised sample-weighted average over the round's ID uploads (Algorithm 1). ``evaluate`` reports
in-distribution and out-of-distribution accuracy of the global model on rotated / coloured copies
of the test set (``shared/data/domains.py``).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import Algorithm, AlgorithmParams, DeviceLogic, JsonMap, Payload, RoundContext
from shared.evaluation import classification_accuracy
from shared.losses import Loss

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.data import ArrayDataset

log = logging.getLogger("fedipg")


class FedIPGParams(AlgorithmParams):
    """``RunConfig.algorithm_params`` of FedIPG (defaults: docs/algorithms/fedipg.md#parameters)."""

    lam: float = Field(1e-3, ge=0.0, allow_inf_nan=False)
    """Penalty strength lambda (paper Fig. 4: 1e-4..1e-2 helps). 0 = plain FedAvg local objective."""
    penalty_scope: Literal["all", "head"] = "all"
    """Parameters entering s = <grad R, w>: ``all`` trainable parameters (paper) or the output
    layer only (``head`` = per-client IRMv1, cheaper; a deviation from the paper)."""
    weighting: Literal["samples", "uniform"] = "samples"
    """Aggregation weights over the round's ID uploads: n_i / sum n_j (Algorithm 1) or uniform (FedIIR code)."""
    exit_policy: Literal["none", "static", "contribution"] = "none"
    """``none``: every device trains. ``static``: the devices in ``excluded`` are in I_OOD for the
    whole run (the paper's experiments). ``contribution``: EXTENSION, not in the paper — ``excluded``
    plus devices whose estimated contribution (Eq. 12, descent-lemma form) is negative for
    ``exit_patience`` consecutive rounds after ``exit_warmup_rounds``."""
    excluded: list[str] = Field(default_factory=list)
    """Device ids (e.g. ``dev-005``) in I_OOD from the start."""
    # --- contribution exit rule (extension) ---
    exit_warmup_rounds: int = Field(3, ge=0)
    """Rounds in which nobody exits automatically ("all clients participate at the beginning")."""
    exit_patience: int = Field(2, ge=1)
    """Consecutive negative-contribution rounds after which a device exits (k)."""
    exit_curvature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """L-hat = L * eta in the contribution estimate (docs/algorithms/fedipg.md#contribution-estimate);
    0 = sign of <mean update, own update>."""
    min_devices: int = Field(1, ge=1)
    """The automatic rule never shrinks the eligible set below this many devices."""
    # --- evaluation ---
    ood_angle: float | None = Field(None, allow_inf_nan=False)
    """Held-out rotation (degrees) of the test set for ``ood_accuracy`` (e.g. 90)."""
    ood_color_env: int | None = Field(None, ge=0, le=9)
    """Held-out colour environment of the test set for ``ood_accuracy`` (needs data.transform=rgb32)."""
    ood_color_strength: float = Field(0.9, ge=0.0, le=1.0)
    """Colour-label correlation of the held-out colour environment."""

    @field_validator("excluded")
    @classmethod
    def _check_excluded(cls, value: list[str]) -> list[str]:
        if any(not isinstance(d, str) or not d.strip() for d in value):
            raise ValueError(f"excluded must be a list of non-empty device ids, got {value!r}")
        if len(set(value)) != len(value):
            raise ValueError(f"excluded lists a device twice: {value!r}")
        return value

    @model_validator(mode="after")
    def _check_policy(self) -> "FedIPGParams":
        if self.exit_policy == "none" and self.excluded:
            raise ValueError("excluded devices need exit_policy='static' (or 'contribution'); got exit_policy='none'")
        if self.exit_policy == "static" and not self.excluded:
            raise ValueError("exit_policy='static' needs a non-empty 'excluded' list of device ids")
        return self


class FedIPGDeviceParams(Payload):
    """What a device receives as ``params`` (:meth:`FedIPG.device_params`): no exit lists."""

    lam: float = Field(ge=0.0)
    penalty_scope: Literal["all", "head"] = "all"
    output_layer: str = ""


class FedIPGUploadExtras(Payload):
    """Diagnostics sent with the weights: means over the round's local steps (a few floats, so
    communication stays FedAvg's). The penalty pair is sent exactly when lam > 0, which needs the
    run's parameters and is checked by :meth:`FedIPG.accept_update`."""

    risk: float = Field(ge=0.0)
    """Mean local cross-entropy R."""
    penalty_s2: float | None = Field(None, ge=0.0)
    """Mean s^2, s = <grad R, w> (only when lam > 0)."""
    penalty_abs_s: float | None = Field(None, ge=0.0)
    """Mean |s| (only when lam > 0)."""

    @model_validator(mode="after")
    def _check_pair(self) -> "FedIPGUploadExtras":
        if (self.penalty_s2 is None) != (self.penalty_abs_s is None):
            raise ValueError("penalty_s2 and penalty_abs_s are sent together or not at all")
        return self


def penalty_parameters(model: torch.nn.Module, scope: str, output_layer: str = "") -> list[torch.nn.Parameter]:
    """The trainable parameters that form ``w`` in ``s = <grad R, w>`` for ``scope`` (all / head).

    BatchNorm running statistics are buffers, never parameters, so they are never part of ``w``.
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if scope == "head":
        if not output_layer:
            raise ValueError("penalty_scope='head' needs the model's output layer name")
        params = [(n, p) for n, p in params if n.startswith(output_layer + ".")]
    elif scope != "all":
        raise ValueError(f"penalty_scope must be 'all' or 'head', got {scope!r}")
    if not params:
        raise ValueError(f"penalty_scope={scope!r} selects no trainable parameters (output layer {output_layer!r})")
    return [p for _, p in params]


def invariance_statistic(risk: torch.Tensor, params: Sequence[torch.Tensor], create_graph: bool = True) -> torch.Tensor:
    """``s = sum_k <dR/dw_k, w_k>``, differentiable w.r.t. both factors when ``create_graph``.

    ``s`` is the derivative of R along the radial direction: d/de R((1+e) w) at e = 0
    (docs/algorithms/fedipg.md#radial-derivative).
    """
    grads = torch.autograd.grad(risk, list(params), create_graph=create_graph, allow_unused=True)
    terms = [(g * p).sum() for g, p in zip(grads, params) if g is not None]
    if not terms:
        return risk.new_zeros(())
    return torch.stack(terms).sum()


def fedipg_objective(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lam: float, scope: str = "all",
                     output_layer: str = "", criterion: Loss | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(f = R + lam s^2, R, s) on one batch, R the run's loss ``criterion`` (None: cross-entropy).
    With ``lam == 0`` the penalty is skipped (s is None), so the objective and its gradient are
    exactly FedAvg's."""
    risk = criterion.mean(model(x), y) if criterion is not None else F.cross_entropy(model(x), y)
    if lam == 0.0:
        return risk, risk, None
    s = invariance_statistic(risk, penalty_parameters(model, scope, output_layer), create_graph=True)
    return risk + lam * s * s, risk, s


class FedIPGLogic(DeviceLogic):
    """Device side: the penalised local objective of Eq. (8) and per-round diagnostics."""

    def __init__(self, params: JsonMap) -> None:
        super().__init__(params)
        cfg = FedIPGDeviceParams.model_validate(params)
        self.lam, self.scope, self.output_layer = cfg.lam, cfg.penalty_scope, cfg.output_layer
        self._risk_sum = 0.0
        self._s2_sum = 0.0
        self._abs_s_sum = 0.0
        self._steps = 0

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """f = R + lam <grad R, w>^2 on the batch (the trainer backpropagates it: 2nd-order gradient)."""
        f, risk, s = fedipg_objective(model, x, y, self.lam, self.scope, self.output_layer, self.criterion)
        self._steps += 1
        self._risk_sum += float(risk.detach())
        if s is not None:
            s_val = float(s.detach())
            self._s2_sum += s_val * s_val
            self._abs_s_sum += abs(s_val)
        return f

    def upload_extras(self, model: torch.nn.Module, data: "ArrayDataset") -> FedIPGUploadExtras:
        """Means over the round's steps of R, s^2 and |s| (a few floats: communication stays FedAvg's)."""
        n = max(1, self._steps)
        if self.lam == 0.0:
            return FedIPGUploadExtras(risk=self._risk_sum / n)
        return FedIPGUploadExtras(risk=self._risk_sum / n, penalty_s2=self._s2_sum / n,
                                  penalty_abs_s=self._abs_s_sum / n)


class FedIPG(Algorithm[FedIPGUploadExtras]):
    """Fed Server side: exit strategy (I_OOD never selected nor aggregated) and ID/OOD evaluation."""

    Params = FedIPGParams
    Logic = FedIPGLogic
    UploadExtras = FedIPGUploadExtras
    needs_classes = "its exit strategy and evaluation use the accuracy on in- and out-of-distribution domains"
    individual_updates = "its exit strategy scores each device's own update and risk"

    def __init__(self, config: "RunConfig") -> None:
        super().__init__(config)
        self.params: FedIPGParams
        if len(self.params.excluded) >= config.data.num_devices:
            raise ValueError(f"excluded lists {len(self.params.excluded)} devices but the run has only "
                             f"{config.data.num_devices}: at least one device must train")
        if self.params.ood_color_env is not None:
            from shared.data import dataset_input_shape

            if dataset_input_shape(config.data)[0] != 3:
                raise ValueError("ood_color_env needs 3-channel data: set data.transform=rgb32")
        #: I_OOD: device -> {"round": round it left (0 = from the start), "reason": policy}.
        self.exited: dict[str, dict[str, Any]] = {d: {"round": 0, "reason": "static"} for d in self.params.excluded}
        #: contribution rule (extension): consecutive negative rounds and the last estimate.
        self.streaks: dict[str, int] = {}
        self.last_contribution: dict[str, float] = {}
        self.last_weights: dict[str, float] = {}
        self._known: set[str] = set()
        self._param_names: set[str] | None = None
        self._domains: dict[str, tuple[str, "ArrayDataset"]] | None = None

    def bind_model(self, model: torch.nn.Module) -> None:
        super().bind_model(model)
        self._param_names = {n for n, p in model.named_parameters() if p.requires_grad}

    # --- exit strategy -------------------------------------------------------------------------
    def model_parts_needed(self) -> tuple[str, ...]:
        """The head-only penalty is taken over the output layer's parameters."""
        return ("output_layer",) if self.params.penalty_scope == "head" else ()

    def eligible(self, devices: Sequence[str]) -> list[str]:
        """I_ID: every available device that has not exited (exited devices are never selected)."""
        new = set(devices) - self._known
        self._known |= set(devices)
        if new and len(self._known) >= self.config.data.num_devices:
            unknown = sorted(set(self.params.excluded) - self._known)
            if unknown:
                log.warning("excluded device ids %s are not registered devices (ids look like %s)",
                            unknown, sorted(self._known)[:3])
        pool = [d for d in devices if d not in self.exited]
        if devices and not pool:
            raise ValueError(f"every available device has exited ({sorted(self.exited)}): nothing can train")
        return pool

    def device_params(self) -> JsonMap:
        """What a device needs: lambda, the scope and the output layer's name (no exit lists)."""
        return FedIPGDeviceParams(lam=self.params.lam, penalty_scope=self.params.penalty_scope,
                                  output_layer=getattr(self, "output_layer", "")).to_wire()

    def accept_update(self, device_id: str, ctx: RoundContext, state: Mapping[str, torch.Tensor],
                      extras: FedIPGUploadExtras, num_samples: int, global_state: Mapping[str, torch.Tensor]) -> None:
        """Refuse uploads of exited devices and penalty diagnostics that do not fit lam (ValueError -> 422)."""
        if device_id in self.exited:
            raise ValueError(f"device {device_id!r} has exited training (I_OOD) and may not upload")
        if (extras.penalty_s2 is not None) != (self.params.lam != 0.0):
            raise ValueError(f"penalty_s2/penalty_abs_s must be sent exactly when lam > 0 (lam={self.params.lam})")

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution],
                  extras: Mapping[str, FedIPGUploadExtras]) -> dict[str, torch.Tensor]:
        """w^{t+1} = sum_{i in I_ID^t} a_i w_i^t with a_i normalised over the round's ID uploads,
        combined by the configured aggregation rule (default: with bounded weights and updates).
        ``last_weights`` are the a_i before the rule's weight bound."""
        kept = {d: c for d, c in contributions.items() if d not in self.exited}  # defence in depth
        if not kept:
            self.last_weights = {}
            return {k: v.clone() for k, v in global_state.items()}
        if self.params.weighting == "uniform":
            kept = {d: Contribution(weight=1.0, client_state=c.client_state, server_state=c.server_state)
                    for d, c in kept.items()}
        total = sum(c.weight for c in kept.values())
        self.last_weights = {d: c.weight / total for d, c in sorted(kept.items())}
        if self.params.exit_policy == "contribution":
            self._contribution_exit(ctx.index, global_state, kept)
        return self.apply_aggregation_rule(ctx, global_state, kept)

    def _contribution_exit(self, index: int, global_state: Mapping[str, torch.Tensor],
                           kept: Mapping[str, Contribution]) -> None:
        """EXTENSION (not in the paper, which designates aberrant clients by hand): estimate Eq. 12's
        C_i from pseudo-gradients D_j = w^t - w_j: C_i = a_i(<D, D_i> - (L/2)|D_i|^2)/|D|^2 with
        D = sum a_j D_j; a device negative for ``exit_patience`` rounds in a row after the warm-up exits."""
        names = [k for k in global_state if global_state[k].is_floating_point()
                 and (self._param_names is None or k in self._param_names)]
        total = sum(c.weight for c in kept.values())
        deltas = {d: torch.cat([(global_state[k].double() - c.client_state[k].double()).flatten()
                                for k in names if k in c.client_state]) for d, c in kept.items()}
        weighted = [(c.weight / total) * deltas[d] for d, c in kept.items()]
        mean = sum(weighted[1:], weighted[0])  # ``kept`` is never empty (aggregate returns before)
        norm2 = float(mean.dot(mean))
        if norm2 <= 0.0 or not math.isfinite(norm2):
            return
        for d, c in sorted(kept.items()):
            a = c.weight / total
            est = a * (float(mean.dot(deltas[d])) - 0.5 * self.params.exit_curvature * float(deltas[d].dot(deltas[d]))) / norm2
            self.last_contribution[d] = est
            # Streaks only count after the warm-up (every device takes part in the first rounds).
            warm = index > self.params.exit_warmup_rounds
            self.streaks[d] = self.streaks.get(d, 0) + 1 if (est < 0 and warm) else 0
        if index <= self.params.exit_warmup_rounds:
            return
        for d in sorted(kept, key=lambda d: self.last_contribution[d]):
            remaining = len(self._known - set(self.exited)) if self._known else len(kept)
            if self.streaks[d] >= self.params.exit_patience and remaining - 1 >= self.params.min_devices:
                self.exited[d] = {"round": index, "reason": "contribution"}
                log.info("round %d: %s exits (contribution %.3g negative for %d rounds)", index, d,
                         self.last_contribution[d], self.streaks[d])

    # --- metrics and evaluation ---------------------------------------------------------------
    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, FedIPGUploadExtras]) -> JsonMap:
        """Exited devices, aggregation weights and the devices' mean risk / penalty diagnostics."""
        out: JsonMap = {}
        out["exited"] = sorted(self.exited)
        out["aggregation_weights"] = dict(self.last_weights)
        for key in FedIPGUploadExtras.model_fields:  # the diagnostics, averaged over the devices
            values = [value for e in extras.values() if (value := getattr(e, key)) is not None]
            out[key] = sum(values) / len(values) if values else None
        if self.params.exit_policy == "contribution":
            out["contribution"] = dict(sorted(self.last_contribution.items()))
        return out

    def _domain_sets(self) -> dict[str, tuple[str, "ArrayDataset"]]:
        """Test-set copies per domain: name -> ("id" | "ood", data). Built once (not state)."""
        if self._domains is not None:
            return self._domains
        from shared.data import load_dataset
        from shared.data.domains import ColorRegion, color_dataset, color_domain, rotate_dataset, rotation_angle

        spec = self.config.data
        if spec.dataset == "local":  # the domains are copies of a built-in test set, which a local run has not
            self._domains = {}
            return self._domains
        test = load_dataset(spec)[1]
        domains: dict[str, tuple[str, ArrayDataset]] = {}
        region: ColorRegion = "foreground"
        if spec.device_transform == "rotation":
            for i in range(spec.num_devices):
                angle = rotation_angle(i, spec.device_transform_params)
                domains.setdefault(f"rot{angle:g}", ("id", rotate_dataset(test, angle)))
        elif spec.device_transform == "color":
            for i in range(spec.num_devices):
                env, strength, region = color_domain(i, spec.device_transform_params)
                domains.setdefault(f"color{env}@{strength:g}",
                                   ("id", color_dataset(test, env, strength, region, spec.seed + 1)))
        ood = test
        name = ""
        if self.params.ood_color_env is not None:
            ood = color_dataset(ood, self.params.ood_color_env, self.params.ood_color_strength, region, spec.seed + 2)
            name += f"color{self.params.ood_color_env}@{self.params.ood_color_strength:g}"
        if self.params.ood_angle is not None:
            ood = rotate_dataset(ood, self.params.ood_angle)
            name += f"rot{self.params.ood_angle:g}"
        if name:
            domains[f"ood:{name}"] = ("ood", ood)
        self._domains = domains
        return domains

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> JsonMap:
        """Accuracy of the global model per test domain: ``id_accuracy`` = mean over the training
        domains (all devices' rotations / colourings), ``ood_accuracy`` on the held-out domain."""
        domains = self._domain_sets()
        if not domains:
            return {}
        acc = {name: classification_accuracy(model, data) for name, (_, data) in domains.items()}
        ids = [acc[n] for n, (kind, _) in domains.items() if kind == "id"]
        oods = [acc[n] for n, (kind, _) in domains.items() if kind == "ood"]
        return {"domain_accuracy": acc, "id_accuracy": sum(ids) / len(ids) if ids else None,
                "ood_accuracy": oods[0] if oods else None}

    # --- checkpoint ----------------------------------------------------------------------------
    def state_dict(self) -> JsonMap:
        return {"exited": {d: dict(v) for d, v in sorted(self.exited.items())},
                "streaks": dict(sorted(self.streaks.items())),
                "last_contribution": dict(sorted(self.last_contribution.items()))}

    def load_state_dict(self, state: JsonMap) -> None:
        exited = state.get("exited", {})
        if not isinstance(exited, dict):
            raise ValueError("checkpoint 'exited' must be a mapping device -> {round, reason}")
        for d, v in exited.items():
            self.exited[str(d)] = {"round": int(v.get("round", 0)), "reason": str(v.get("reason", "static"))}
        self.streaks = {str(d): int(v) for d, v in state.get("streaks", {}).items()}
        self.last_contribution = {str(d): float(v) for d, v in state.get("last_contribution", {}).items()}
