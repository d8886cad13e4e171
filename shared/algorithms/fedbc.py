"""FedBC: Federated Learning Beyond Consensus (Bedi et al.; docs/algorithms/fedbc.md).

Split depth zero. Each device i has a dual variable lambda_i >= 0 and a tolerance gamma_i >= 0,
both kept by the Fed Server across rounds (``state_dict`` -> checkpoint). In a round:

* task: the global model z plus ``lambda_i``, ``gamma_i`` (and the seed of the device's fixed local
  80/20 train/test split);
* device: trains on its 80 % part with the local objective (the official code's loss,
  docs/algorithms/fedbc.md#what-it-does) ``CE(w; batch) + lambda_i * (||w - z||^2 - gamma_i)``, the squared norm summed over the trainable
  parameters by name against a frozen copy of z; then evaluates its local model on its 20 % part
  and uploads ``d`` (its own ||x_i - z||^2), local correct/total counts and its training-set size;
* Fed Server (Algorithm 1 line 8 placed on the server, docs/algorithms/fedbc.md#server-placement):
  recomputes ``d_i = ||x_i - z||^2`` from the received weights (authoritative; the device's value is only
  compared), takes one projected dual-ascent step ``lambda_i <- P[lambda_i + eta_l (d_i - gamma_i)]``
  and, in ``adaptive`` mode, ``gamma_i <- gamma_i + eta_g * lambda_i(old)``; then sets
  ``z <- sum_j lambda_j x_j / sum_j lambda_j`` over the round's participants with the *updated*
  duals (Eq. 13), over every floating state_dict entry (max for integer buffers). When every
  participant's lambda is 0 (always in round 1 from lambda = 0 ... unless d > gamma, and often in
  ``fixed`` mode with a large gamma) the formula is 0/0: the round falls back to the
  data-size-weighted FedAvg average, logs a warning and records ``fallback: true``.

Open choices and deviations, each also in docs/algorithms/fedbc.md#deviations:
* local start point = the global model (official code; Algorithm 2's ``previous_local`` would need
  state on the device across rounds, which the DeviceLogic interface does not keep);
* lambda bounds [lambda_min, lambda_max] default [0, inf) (code); dual momentum default 0 (Eq. 11),
  optional, with per-device buffers updated only when the device participates (not the code's
  shared buffer);
* gamma uses the pre-update lambda (simultaneous step, as in the code);
* the device's local test split is held back from its *shard* (seeded, stratified by class) —
  on Synthetic the shard already is the generated device's 80 % training part, so a device trains
  on 80 % of that (64 % of its generated samples; the paper: 80 %). ``local_test_fraction = 0``
  trains on the whole shard (then no local accuracy is reported);
* local accuracy: pooled over this round's participants (``local_acc_pooled``, the code's metric),
  their unweighted mean (``local_acc_mean``, the paper's wording), and pooled over the latest
  counts of every device ever sampled (``local_acc_pooled_latest``).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, model_validator

from shared.algorithms.aggregation import Contribution, check_state, layerwise_aggregate
from shared.algorithms.base import Algorithm, AlgorithmParams, DeviceLogic, JsonMap, Payload, RoundContext
from shared.algorithms.proximal import frozen_parameters, proximal_penalty
from shared.data.holdout import holdout_seed, holdout_split
from shared.evaluation import evaluation_sums

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.data import ArrayDataset

__all__ = [
    "FedBC", "FedBCLogic", "FedBCParams", "FedBCTaskExtras", "FedBCUploadExtras", "dual_step",
    "lambda_weighted_average", "squared_distance",
]

log = logging.getLogger("fed_server.fedbc")

#: Relative difference between the device's and the server's distance that is worth a log line.
DISTANCE_LOG_RTOL = 1e-4


class FedBCParams(AlgorithmParams):
    """FedBC's hyperparameters (``RunConfig.algorithm_params``); defaults: docs/algorithms/fedbc.md#parameters.

    The local optimiser is the project's ``train`` section (the paper: SGD lr 0.01, momentum 0.5,
    batch 20): set it with ``--set train.lr=0.01 --set train.momentum=0.5 --set train.batch_size=20``.
    """

    dual_lr: float = Field(1e-3, ge=0)
    """eta_lambda: step size of the dual ascent (paper alpha; code ``lamb_lr``)."""
    gamma_lr: float | None = Field(None, ge=0)
    """eta_gamma: step of the adaptive tolerance; None = ``dual_lr`` (paper/code)."""
    gamma_mode: Literal["adaptive", "fixed"] = "adaptive"
    """``adaptive``: gamma_i <- gamma_i + eta_gamma * lambda_i (paper heuristic, used for all tables);
    ``fixed``: gamma_i = ``gamma`` forever (Fig. 2)."""
    gamma: float = Field(0.0, ge=0)
    """Initial tolerance (adaptive) or the fixed tolerance (fixed)."""
    lambda_init: float = Field(0.0, ge=0)
    """lambda_i^0 of every device."""
    lambda_min: float = Field(0.0, ge=0)
    lambda_max: float | None = Field(None, gt=0)
    """Projection interval of the duals; None = no upper bound (code).
    docs/algorithms/fedbc.md#dual-bounds suggests 1 / train.lr when ``dual_lr`` is tuned upward (the
    penalty's curvature 2 lambda must stay < 2 / lr)."""
    dual_momentum: float = Field(0.0, ge=0, lt=1)
    """Heavy-ball momentum of the dual/tolerance steps, per device (code: 0.5 with a shared buffer)."""
    local_test_fraction: float = Field(0.2, ge=0, lt=1)
    """Share of each device's shard held back (seeded, stratified) for its local test accuracy."""
    eval_batch_size: int = Field(128, ge=1)
    """Batch size of the device's local evaluation."""

    @model_validator(mode="after")
    def _check(self) -> "FedBCParams":
        values = [self.dual_lr, self.gamma, self.lambda_init, self.lambda_min, self.local_test_fraction]
        values += [v for v in (self.gamma_lr, self.lambda_max) if v is not None]
        if not all(math.isfinite(v) for v in values):
            raise ValueError("FedBC parameters must be finite")
        if self.lambda_max is not None and self.lambda_max < self.lambda_min:
            raise ValueError(f"lambda_max={self.lambda_max} is below lambda_min={self.lambda_min}")
        if not self.lambda_min <= self.lambda_init <= (self.lambda_max if self.lambda_max is not None else math.inf):
            raise ValueError(f"lambda_init={self.lambda_init} is outside [lambda_min, lambda_max]")
        return self

    @property
    def tolerance_lr(self) -> float:
        return self.dual_lr if self.gamma_lr is None else self.gamma_lr


# --------------------------------------------------------------------------------------------- payloads
class FedBCTaskExtras(Payload):
    """Per-device values of a task: the device's dual variable and tolerance and its split seed."""

    model_config = ConfigDict(populate_by_name=True)  # ``lam=`` in Python, ``lambda`` on the wire

    lam: float = Field(alias="lambda", ge=0)
    """lambda_i, the weight of the proximal penalty (wire key ``lambda``, a Python keyword)."""
    gamma: float = Field(ge=0)
    """gamma_i, the tolerance subtracted inside the penalty."""
    split_seed: int = 0
    """Seed of the device's fixed local train/test split (:func:`shared.data.holdout.holdout_seed`)."""


class FedBCUploadExtras(Payload):
    """What a device sends with its weights: its own d and its local test counts.

    That ``train_samples + local_total`` is the upload's ``num_samples`` needs the upload itself,
    so :meth:`FedBC.accept_update` checks it."""

    d: float = Field(ge=0)
    """||x_i - z||^2 as the device computed it (the server recomputes and uses its own)."""
    local_correct: int = Field(ge=0)
    local_total: int = Field(ge=0)
    """Correct predictions / size of the local 20 % test split (0 / 0 without one)."""
    train_samples: int = Field(ge=1)
    """Size of the part the device trained on (the weight of the FedAvg fallback)."""

    @model_validator(mode="after")
    def _check_counts(self) -> "FedBCUploadExtras":
        if self.local_correct > self.local_total:
            raise ValueError(f"local_correct={self.local_correct} exceeds local_total={self.local_total}")
        return self


# --------------------------------------------------------------------------------------------- math
def trainable_names(model: torch.nn.Module) -> list[str]:
    """Names of the trainable parameters (= their state_dict keys), in model order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def squared_distance(state: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                     names: Sequence[str]) -> float:
    """sum over ``names`` of ||state[name] - reference[name]||^2, in float64 (d_i of
    docs/algorithms/fedbc.md#what-it-does)."""
    total = 0.0
    for name in names:
        if name not in state or name not in reference:
            raise ValueError(f"parameter {name!r} is missing from the weights")
        a, b = state[name], reference[name]
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"parameter {name!r} has shape {tuple(a.shape)}, expected {tuple(b.shape)}")
        # On the CPU: weights on a GPU come over (MPS has no float64); a no-op for CPU tensors.
        diff = a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)
        total += float((diff * diff).sum())
    return total


def dual_step(lam: float, gamma: float, distance: float, dual_lr: float, gamma_lr: float, adaptive: bool,
              lambda_min: float = 0.0, lambda_max: float | None = None, momentum: float = 0.0,
              lam_buf: float = 0.0, gamma_buf: float = 0.0) -> tuple[float, float, float, float]:
    """One device's dual and tolerance step (Eq. 11 and the gamma heuristic, docs/algorithms/fedbc.md#what-it-does).

    ``lambda' = P[lambda + eta_l * v]`` with ``v = (d - gamma) + momentum * lam_buf``;
    adaptive: ``gamma' = gamma + eta_g * u`` with ``u = lambda(old) + momentum * gamma_buf``
    (the descent step on the Lagrangian, whose derivative in gamma is -lambda). Returns
    (lambda', gamma', new lam_buf, new gamma_buf); with momentum 0 the buffers are the raw directions.
    """
    v = (distance - gamma) + momentum * lam_buf
    new_lam = max(lambda_min, lam + dual_lr * v)
    if lambda_max is not None:
        new_lam = min(new_lam, lambda_max)
    if adaptive:
        u = lam + momentum * gamma_buf
        new_gamma = max(0.0, gamma + gamma_lr * u)
    else:
        u = gamma_buf
        new_gamma = gamma
    return new_lam, new_gamma, v, u


def lambda_weighted_average(global_state: Mapping[str, torch.Tensor], states: Sequence[Mapping[str, torch.Tensor]],
                            weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """sum_j w_j x_j / sum_j w_j for every floating state_dict entry (float64 accumulation, cast to
    the global dtype); integer/bool entries (``num_batches_tracked``) take the max over the states.
    Keys no state supplies keep the global value. Raises ValueError for an empty or all-zero weight
    vector, a negative / non-finite weight, an unknown key or a shape mismatch.

    The floating entries are the shared Algorithm 1 average (``layerwise_aggregate``) with the
    weights as contribution weights. A zero weight adds nothing to a weighted mean, and that
    function takes positive weights only, so zero-weight states are left out of it; they are still
    checked, and still count for the integer max (FedBC's rule for counters, where Algorithm 1
    rounds the weighted mean).
    """
    if len(states) == 0 or len(states) != len(weights):
        raise ValueError("lambda_weighted_average needs one weight per state and at least one state")
    ws = [float(w) for w in weights]
    if any(not math.isfinite(w) or w < 0 for w in ws) or sum(ws) <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all zero, got {ws}")
    for idx, state in enumerate(states):  # the zero-weight states too
        check_state(global_state, state, f"state {idx}:")
    out = layerwise_aggregate(global_state, [Contribution(weight=w, client_state=s) for w, s in zip(ws, states) if w > 0])
    for key, g in global_state.items():
        supplied = [s[key] for s in states if key in s]
        if supplied and not g.is_floating_point():
            out[key] = torch.stack([value.detach().to(g.device) for value in supplied]).amax(0).to(g.dtype)
    return out


# --------------------------------------------------------------------------------------------- device
class FedBCLogic(DeviceLogic[FedBCTaskExtras]):
    """Device side: the proximal local objective with the round's lambda_i, the local split, and
    the local evaluation sent with the upload."""

    def __init__(self, params: JsonMap) -> None:
        super().__init__(params)
        cfg = FedBCParams.model_validate(params)   # the server's defaults, not restated here
        self.fraction = cfg.local_test_fraction
        self.eval_batch_size = cfg.eval_batch_size
        self.lam = 0.0
        self.gamma = 0.0
        self.reference: dict[str, torch.Tensor] = {}
        self.train_idx: np.ndarray | None = None
        self.test_idx: np.ndarray | None = None

    def begin_round(self, model: torch.nn.Module, extras: FedBCTaskExtras, data: "ArrayDataset") -> None:
        """Read lambda_i, gamma_i; freeze z (the just-loaded global weights); fix the local split."""
        self.lam, self.gamma = extras.lam, extras.gamma
        self.reference = frozen_parameters(model)
        self.train_idx, self.test_idx = holdout_split(data.y.numpy(), self.fraction, extras.split_seed)

    def training_data(self, data: "ArrayDataset") -> "ArrayDataset":
        """The shard minus the held-back local test split."""
        if self.train_idx is None or self.test_idx is None or len(self.test_idx) == 0:
            return data
        return data.subset(self.train_idx)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """CE + lambda_i (||w - z||^2 - gamma_i) (docs/algorithms/fedbc.md#what-it-does). With
        lambda_i = 0 exactly CE (FedAvg); the -lambda gamma constant has no gradient but is kept, as in the code's loss value."""
        ce = self.criterion.mean(model(x), y)
        if self.lam == 0.0:
            return ce
        return ce + self.lam * (proximal_penalty(model, self.reference) - self.gamma)

    def upload_extras(self, model: torch.nn.Module, data: "ArrayDataset") -> FedBCUploadExtras:
        """d = ||x_i - z||^2 (checked by the server), local test counts, training-set size."""
        state = dict(model.named_parameters())
        distance = squared_distance(state, self.reference, list(self.reference))
        correct, total = 0, 0
        if self.test_idx is not None and len(self.test_idx):
            test = data.subset(self.test_idx)
            total = len(test)
            correct = evaluation_sums(model, test, self.criterion, self.eval_batch_size).correct
        n_train = len(self.train_idx) if self.train_idx is not None else len(data)
        return FedBCUploadExtras(d=distance, local_correct=correct, local_total=total, train_samples=int(n_train))


# --------------------------------------------------------------------------------------------- server
class FedBC(Algorithm[FedBCUploadExtras]):
    """Fed Server side: per-device lambda_i, gamma_i; dual/tolerance steps; lambda-weighted average."""

    Params = FedBCParams
    Logic = FedBCLogic
    TaskExtras = FedBCTaskExtras
    UploadExtras = FedBCUploadExtras
    needs_classes = "its devices report the accuracy of their local test split"
    individual_updates = "it weighs each device's update by that device's own dual variable"
    params: FedBCParams

    def __init__(self, config: "RunConfig") -> None:
        super().__init__(config)
        self.lam: dict[str, float] = {}
        self.gamma: dict[str, float] = {}
        self.lam_buf: dict[str, float] = {}
        self.gamma_buf: dict[str, float] = {}
        self.local_counts: dict[str, list[int]] = {}
        self.fallback_rounds = 0
        self.param_names: list[str] = []
        self._round: JsonMap = {}
        self._warned_stability = False
        # d of each device's latest accepted upload, so aggregate need not recompute it (cleared by
        # aggregate; every contribution it receives was accepted in the attempt it closes).
        self._upload_distance: dict[str, float] = {}

    def bind_model(self, model: torch.nn.Module) -> None:
        super().bind_model(model)
        self.param_names = trainable_names(model)

    # --- per-device state ---------------------------------------------------------------------
    def lambda_of(self, device_id: str) -> float:
        return self.lam.get(device_id, self.params.lambda_init)

    def gamma_of(self, device_id: str) -> float:
        return self.gamma.get(device_id, self.params.gamma)

    def task_extras(self, device_id: str, ctx: RoundContext) -> FedBCTaskExtras:
        return FedBCTaskExtras(lam=self.lambda_of(device_id), gamma=self.gamma_of(device_id),
                               split_seed=holdout_seed("fedbc-local-split", self.config.seed, device_id))

    # --- uploads ------------------------------------------------------------------------------
    def accept_update(self, device_id: str, ctx: RoundContext, state: Mapping[str, torch.Tensor],
                      extras: FedBCUploadExtras, num_samples: int, global_state: Mapping[str, torch.Tensor]) -> None:
        """Check the split sizes against the upload and recompute d from the weights (the dual step
        itself happens in :meth:`aggregate`, only for uploads that are aggregated)."""
        if extras.train_samples + extras.local_total != num_samples:
            raise ValueError(f"{device_id}: train_samples={extras.train_samples} + local_total={extras.local_total} "
                             f"must equal the shard's num_samples={num_samples}")
        distance = self._checked_distance(device_id, state, global_state)
        reported = extras.d
        if abs(reported - distance) > DISTANCE_LOG_RTOL * max(abs(distance), 1e-12):
            log.info("fedbc round %d (attempt %d): %s reported d=%.6g, recomputed d=%.6g "
                     "(the server's value is used)", ctx.index, ctx.attempt, device_id, reported, distance)
        self._upload_distance[device_id] = distance

    def aggregate(self, ctx: RoundContext, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution],
                  extras: Mapping[str, FedBCUploadExtras]) -> dict[str, torch.Tensor]:
        """Dual/tolerance steps for the round's participants, then z = sum lambda x / sum lambda
        (data-size FedAvg when all lambda are 0)."""
        p = self.params
        devices = sorted(contributions)
        distances: dict[str, float] = {}
        n_train: dict[str, float] = {}
        for device in devices:
            contribution = contributions[device]
            distance = self._upload_distance.get(device)
            if distance is None:  # an upload that did not pass accept_update (a test calling aggregate)
                distance = self._checked_distance(device, contribution.client_state, global_state)
            distances[device] = distance
            ex = extras.get(device)
            n_train[device] = float(ex.train_samples if ex is not None else contribution.weight)
            lam, gam = self.lambda_of(device), self.gamma_of(device)
            new_lam, new_gam, lb, gb = dual_step(
                lam, gam, distances[device], p.dual_lr, p.tolerance_lr, p.gamma_mode == "adaptive",
                p.lambda_min, p.lambda_max, p.dual_momentum, self.lam_buf.get(device, 0.0),
                self.gamma_buf.get(device, 0.0))
            self.lam[device], self.gamma[device] = new_lam, new_gam
            if p.dual_momentum > 0:
                self.lam_buf[device], self.gamma_buf[device] = lb, gb
            if ex is not None and ex.local_total > 0:
                self.local_counts[device] = [ex.local_correct, ex.local_total]

        self._upload_distance.clear()
        lambdas = [self.lam[d] for d in devices]
        sizes = [n_train[d] for d in devices]
        fallback = sum(lambdas) <= 0.0
        if fallback:
            self.fallback_rounds += 1
            log.warning("fedbc round %d (attempt %d): every participant's lambda is 0; data-size-weighted FedAvg "
                        "this round (fallback %d so far)", ctx.index, ctx.attempt, self.fallback_rounds)
        weights = sizes if fallback else lambdas
        new_state = lambda_weighted_average(global_state, [contributions[d].client_state for d in devices], weights)
        self._check_stability(max(lambdas) if lambdas else 0.0)
        self._round = self._metrics(devices, distances, lambdas, sizes, fallback, extras)
        return new_state

    def _checked_distance(self, device: str, state: Mapping[str, torch.Tensor],
                          global_state: Mapping[str, torch.Tensor]) -> float:
        """d = ||x - z||^2 over the trainable parameters; ValueError if it is not finite."""
        distance = squared_distance(state, global_state, self.param_names)
        if not math.isfinite(distance):
            raise ValueError(f"{device}: distance to the global model is not finite")
        return distance

    def _check_stability(self, max_lambda: float) -> None:
        """Plain SGD on the penalty (curvature 2 lambda) needs lr * 2 lambda < 2
        (docs/algorithms/fedbc.md#dual-bounds)."""
        if not self._warned_stability and max_lambda * self.config.train.lr >= 1.0:
            self._warned_stability = True
            log.warning("fedbc: lambda=%.3g with train.lr=%.3g makes local SGD unstable (needs lambda < 1/lr); "
                        "set algorithm_params.lambda_max or a smaller dual_lr", max_lambda, self.config.train.lr)

    def _metrics(self, devices: list[str], distances: Mapping[str, float], lambdas: list[float], sizes: list[float],
                 fallback: bool, extras: Mapping[str, FedBCUploadExtras]) -> JsonMap:
        """Per-round record (docs/algorithms/fedbc.md#round-metrics; Figs. 3b, 8, 13): lambda, gamma,
        d of the participants, lambda- vs data-size aggregation coefficients, min/max-data participant, local accuracy."""
        lam_total, size_total = sum(lambdas), sum(sizes)
        coef_lambda = {d: (lam / lam_total if lam_total > 0 else None) for d, lam in zip(devices, lambdas)}
        coef_data = {d: n / size_total for d, n in zip(devices, sizes)}

        def ratio(values: list[float | None]) -> float | None:
            vals = [v for v in values if v is not None]
            return max(vals) / min(vals) if vals and min(vals) > 0 else None

        min_user = min(devices, key=lambda d: (sizes[devices.index(d)], d)) if devices else None
        max_user = max(devices, key=lambda d: (sizes[devices.index(d)], d)) if devices else None
        counts = [(extras[d].local_correct, extras[d].local_total) for d in devices
                  if d in extras and extras[d].local_total > 0]
        latest = list(self.local_counts.values())
        return {
            "lambda": {d: self.lam[d] for d in devices},
            "gamma": {d: self.gamma[d] for d in devices},
            "distance": dict(distances),
            "coef_lambda": coef_lambda,
            "coef_data": coef_data,
            "coef_ratio_lambda": ratio(list(coef_lambda.values())),
            "coef_ratio_data": ratio(list(coef_data.values())),
            "min_user": {"device": min_user, "coef_lambda": coef_lambda.get(min_user), "coef_data": coef_data.get(min_user)}
            if min_user else None,
            "max_user": {"device": max_user, "coef_lambda": coef_lambda.get(max_user), "coef_data": coef_data.get(max_user)}
            if max_user else None,
            "fallback": fallback,
            "fallback_rounds": self.fallback_rounds,
            "lambda_mean": sum(self.lam.values()) / len(self.lam) if self.lam else 0.0,
            "gamma_mean": sum(self.gamma.values()) / len(self.gamma) if self.gamma else 0.0,
            "local_acc_pooled": sum(c for c, _ in counts) / sum(t for _, t in counts) if counts else None,
            "local_acc_mean": sum(c / t for c, t in counts) / len(counts) if counts else None,
            "local_acc_pooled_latest": sum(c for c, _ in latest) / sum(t for _, t in latest) if latest else None,
        }

    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, FedBCUploadExtras]) -> JsonMap:
        return dict(self._round)

    # --- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> JsonMap:
        return {
            "lambda": dict(self.lam),
            "gamma": dict(self.gamma),
            "lambda_buf": dict(self.lam_buf),
            "gamma_buf": dict(self.gamma_buf),
            "local_counts": {d: list(v) for d, v in self.local_counts.items()},
            "fallback_rounds": self.fallback_rounds,
        }

    def load_state_dict(self, state: JsonMap) -> None:
        super().load_state_dict(state)

        def floats(key: str, minimum: float | None = 0.0) -> dict[str, float]:
            out = {}
            for device, value in dict(state.get(key, {})).items():
                v = float(value)
                if not math.isfinite(v) or (minimum is not None and v < minimum):
                    raise ValueError(f"checkpoint {key}[{device!r}] = {value!r} is invalid")
                out[str(device)] = v
            return out

        self.lam = floats("lambda")
        self.gamma = floats("gamma")
        self.lam_buf = floats("lambda_buf", None)
        self.gamma_buf = floats("gamma_buf", None)
        self.local_counts = {str(d): [int(v[0]), int(v[1])] for d, v in dict(state.get("local_counts", {})).items()}
        self.fallback_rounds = int(state.get("fallback_rounds", 0))
