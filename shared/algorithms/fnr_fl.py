"""FNR-FL: Feature Norm Regularized Federated Learning (Hu, Qiu, Tang; arXiv 2312.06951).

FedAvg plus a per-round correction of the worst participants, in two phases per round:

1. *train*: every participant trains the global model on its own data (plain cross-entropy, the
   base trainer), then evaluates the trained model ``w_i`` on a public labelled set ``D_pub`` and
   **reports** its accuracy ``A_i`` and its class-average feature norms ``F_i[k]`` (mean L2 norm
   of the penultimate features of the ``D_pub`` samples of class k; Alg. 1, Eq. 6-7).
2. *follow-up*: the Fed Server picks the ``floor(n*p)`` lowest-accuracy reporters ``S_re`` (ties:
   smaller device id first) and computes for each ``j in S_re`` the summed differences
   ``Delta_j[l] = sum_{m in S \\ S_re} (F_m[l] - F_j[l])`` (Alg. 2). Picked devices then run
   ``refine_epochs`` epochs over ``D_pub`` with ``CE + lambda * J_j(B)``,
   ``J_j(B) = sum_{l in labels(B)} rho_l(B) * Delta_j[l]`` (Alg. 3, Eq. 9); the others upload as
   they are. Aggregation is FedAvg over all uploads (data-size weighted; the base class default).

**The penalty has no gradient as written in the paper (and in the official code).** ``Delta_j`` is
computed on the server from numbers reported *before* refinement and ``J_j(B)`` depends only on the
batch's label proportions, so ``lambda * J_j(B)`` is a constant added to the loss: the refinement is
exactly cross-entropy fine-tuning on ``D_pub`` and ``lambda`` changes only the logged loss value.
``penalty="paper"`` (default) implements this literally. ``penalty="differentiable"`` is an opt-in
extension that is *not* in the paper (docs/algorithms/fnr-fl.md#differentiable-penalty): it
recomputes the batch's class-average feature norms with autograd and penalises
``J = sum_{l in labels(B)} rho_l(B) * (Fbar[l] - Fhat_B[l](w))^2`` with ``Fbar[l]`` the mean of
the reference devices' ``F_m[l]``.

``D_pub`` is by default a seeded, stratified hold-out of the *training* set
(``data.public_samples``), disjoint from every shard and from the evaluation set. The paper's code
uses the evaluation test set instead; ``public_set="test_set_leaky"`` reproduces that and marks
every round record with ``leaky: true``. Details and every open choice: docs/algorithms/fnr-fl.md.
"""
from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BeforeValidator, ConfigDict, Field, model_validator
from torch import nn

from shared.algorithms.base import Algorithm, AlgorithmParams, DeviceLogic, JsonMap, Payload, RoundContext
from shared.algorithms.two_phase import TwoPhaseAlgorithm, TwoPhaseLogic
from shared.data import ArrayDataset, DataSpec, load_dataset, load_public_set
from shared.torch_device import model_device

if TYPE_CHECKING:
    from shared.config import RunConfig

__all__ = [
    "FNRFL", "FNRFLFollowUp", "FNRFLLogic", "FNRFLParams", "FNRFLReport", "FNRFLUploadExtras",
    "class_average_feature_norms", "feature_norm_differences",
    "features_and_logits", "penalty_term", "refine_on_public", "reference_norms", "select_for_refinement",
]


# ------------------------------------------------------------------------------------------------
# parameters
# ------------------------------------------------------------------------------------------------
class FNRFLParams(AlgorithmParams):
    """``RunConfig.algorithm_params`` of FNR-FL (defaults: docs/algorithms/fnr-fl.md#parameters; the
    paper gives no lambda or p)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    p: float = Field(0.5, ge=0, le=1)
    """Fraction of the round's reporters to refine: ``n_re = floor(n * p)`` (code default 0.5)."""
    lam: float = Field(0.5, ge=0)
    """lambda, weight of the regulariser (code default 1.0, README run 0.5). No effect on the
    weights with ``penalty="paper"`` (the term is a constant)."""
    refine_epochs: int = Field(5, ge=0, le=100)
    """E_re: epochs over ``D_pub`` for each picked device (paper 5)."""
    public_batch_size: int = Field(32, ge=1, le=4096)
    """Batch size on ``D_pub`` for the report's evaluation and for refinement (paper/code 32)."""
    refine_lr: float | None = Field(None, gt=0)
    """Learning rate of the refinement SGD; None = ``train.lr`` (paper: the same eta)."""
    reference_set: Literal["non_selected", "all_others"] = "non_selected"
    """Whom Delta_j compares against: the paper's ``S \\ S_re`` or the official code's all m != j."""
    penalty: Literal["paper", "differentiable"] = "paper"
    """``paper``: J as written (a constant, zero gradient); ``differentiable``: opt-in extension."""
    public_set: Literal["holdout", "test_set_leaky"] = "holdout"
    """``holdout``: ``data.public_samples`` held out of the training set (leak-free);
    ``test_set_leaky``: the evaluation test set, as the paper's code (runs are marked leaky)."""


class _DeviceParams(FNRFLParams):
    """What a device receives (``Algorithm.device_params``): the algorithm's parameters plus what
    the device logic cannot know otherwise (devices have no run config)."""

    feature_block: str = Field(min_length=1)
    num_classes: int = Field(ge=1)
    data: dict[str, Any]
    lr: float = Field(gt=0)
    momentum: float = Field(ge=0, lt=1)
    weight_decay: float = Field(ge=0)


# ------------------------------------------------------------------------------------------------
# payloads
# ------------------------------------------------------------------------------------------------
def _class_key(key: Any) -> Any:
    """Map keys cross the network as strings: ``"3"`` is class 3. Only the plain decimal form is
    taken (no ``"03"``, ``" 3"``, ``"3.0"``: two spellings of one class would silently collide)."""
    if isinstance(key, str) and re.fullmatch(r"0|[1-9][0-9]*", key):
        return int(key)
    return key


#: A class id as a map key (``[0, num_classes)`` is checked by whoever knows ``num_classes``).
ClassId = Annotated[int, BeforeValidator(_class_key), Field(ge=0)]
#: Class-indexed numbers (Delta_j); on the wire the keys are decimal strings.
ClassTable = dict[ClassId, float]
#: Class-average feature norms (F_i, Fbar): non-negative.
NormTable = dict[ClassId, Annotated[float, Field(ge=0)]]


class FNRFLReport(Payload):
    """A device's report after local training (Alg. 3 lines 26-27), on ``D_pub``."""

    public_accuracy: float = Field(ge=0, le=1)
    """A_i, the trained model's accuracy on ``D_pub``."""
    feature_norms: NormTable = Field(min_length=1)
    """F_i: class -> mean L2 norm of the penultimate features of that class's samples."""
    num_samples: int = Field(ge=1)
    """Size of the device's shard (informational)."""


class FNRFLFollowUp(Payload):
    """The Fed Server's answer to a report: refine or not, and with what (Alg. 2)."""

    refine: bool
    """True for the devices in S_re."""
    delta: ClassTable | None = None
    """Delta_j (refined devices; absent = no class to correct)."""
    reference_norms: NormTable | None = None
    """Fbar, the reference devices' mean norms (refined devices, ``penalty="differentiable"``)."""
    excluded: str | None = None
    """Why the device's report was refused (it is not refined and its upload will be refused)."""


class FNRFLUploadExtras(Payload):
    """Sent with the weights: whether they are refined, and the refinement's diagnostics."""

    refined: bool
    refine_steps: int | None = Field(None, ge=0)
    refine_ce: float | None = None
    refine_penalty: float | None = None
    refine_loss: float | None = None
    """Optimizer steps and mean CE, J and Phi of the refinement (exactly when ``refined``)."""

    @model_validator(mode="after")
    def _check_stats(self) -> "FNRFLUploadExtras":
        stats = (self.refine_steps, self.refine_ce, self.refine_penalty, self.refine_loss)
        if self.refined and any(v is None for v in stats):
            raise ValueError("a refined upload needs refine_steps, refine_ce, refine_penalty and refine_loss")
        if not self.refined and any(v is not None for v in stats):
            raise ValueError("refine_* diagnostics are only sent with refined=true")
        return self


# ------------------------------------------------------------------------------------------------
# device-side math (pure functions, unit-tested)
# ------------------------------------------------------------------------------------------------
def features_and_logits(model: nn.Module, x: torch.Tensor, feature_block: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward pass giving the flat penultimate features ``[B, d]`` (output of
    ``feature_block``, i.e. the input of the output layer) and the logits.

    Works on a :class:`~shared.models.SplitModel` and on a whole-model ``Portion`` (what the device
    trains in split depth zero); both hold their blocks in ``model.blocks``.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or feature_block not in blocks:
        raise ValueError(f"model has no block {feature_block!r} to take the penultimate features from")
    if getattr(model, "start", 0) != 0:
        raise ValueError("FNR-FL needs the whole model on the device (a portion starting at block 0)")
    feats: torch.Tensor | None = None
    out = x
    for name, block in blocks.items():
        out = block(out)
        if name == feature_block:
            feats = out.flatten(1)
    assert feats is not None
    return feats, out


def class_average_feature_norms(model: nn.Module, data: ArrayDataset, feature_block: str,
                                batch_size: int = 32) -> tuple[dict[int, float], float]:
    """Algorithm 1 and the public accuracy: ``({class: mean ||Mf(x)||_2}, accuracy)`` on ``data``.

    Only classes present in ``data`` get a key (Alg. 1 line 11). Computed in eval mode without
    gradients (docs/algorithms/fnr-fl.md#eval-mode; the official code leaves BN in train mode):
    BatchNorm statistics, the parameters and every RNG stream are untouched, so a round with
    ``p=0`` is FedAvg bit for bit. The model's train/eval mode is restored afterwards.
    """
    if len(data) == 0:
        raise ValueError("the public set is empty")
    was_training = model.training
    model.eval()
    sums = torch.zeros(data.num_classes, dtype=torch.float64)
    counts = torch.zeros(data.num_classes, dtype=torch.float64)
    correct = 0
    device = model_device(model)
    try:
        with torch.no_grad():
            for start in range(0, len(data), batch_size):
                x, y = data.x[start:start + batch_size], data.y[start:start + batch_size]
                feats, logits = features_and_logits(model, x.to(device), feature_block)
                # Norms in float64 on the CPU (MPS has no float64; a no-op on the CPU).
                u = feats.cpu().double().norm(p=2, dim=1)
                sums.index_add_(0, y, u)
                counts.index_add_(0, y, torch.ones_like(u))
                correct += int((logits.argmax(dim=1).cpu() == y).sum())
    finally:
        model.train(was_training)
    norms = {int(k): float(sums[k] / counts[k]) for k in torch.nonzero(counts > 0).flatten().tolist()}
    return norms, correct / len(data)


def penalty_term(labels: torch.Tensor, delta: Mapping[int, float]) -> float:
    """``J_j(B) = sum_{l in labels(B)} rho_l(B) * Delta_j[l]`` (Alg. 3 lines 33-38), a plain
    number: a label missing from ``delta`` contributes 0."""
    if labels.numel() == 0:
        return 0.0
    values, counts = torch.unique(labels, return_counts=True)
    n = labels.numel()
    return float(sum((int(c) / n) * float(delta.get(int(v), 0.0)) for v, c in zip(values.tolist(), counts.tolist())))


def _differentiable_penalty(feats: torch.Tensor, labels: torch.Tensor, reference: Mapping[int, float]) -> torch.Tensor:
    """Opt-in extension (not in the paper): ``sum_l rho_l(B) * (Fbar[l] - mean_{y=l} ||f||)^2``
    over the batch's labels that have a reference norm; differentiable in the feature extractor."""
    norms = feats.norm(p=2, dim=1)
    total = norms.new_zeros(())
    n = labels.numel()
    for label in torch.unique(labels).tolist():
        if int(label) not in reference:
            continue
        mask = labels == label
        rho = float(mask.sum()) / n
        total = total + rho * (float(reference[int(label)]) - norms[mask].mean()) ** 2
    return total


def refine_on_public(model: nn.Module, public: ArrayDataset, delta: Mapping[int, float], *, lam: float, epochs: int,
                     batch_size: int, lr: float, momentum: float, weight_decay: float, feature_block: str,
                     penalty: Literal["paper", "differentiable"] = "paper",
                     reference: Mapping[int, float] | None = None) -> dict[str, float | int]:
    """FeatureNormRefine (Alg. 3 lines 29-43): ``epochs`` passes over ``public`` in its given,
    fixed order (the code's unshuffled loader; ``public_set`` returns a seeded random order) with
    ``Phi = mean CE + lam * J``, a fresh SGD (same settings as local training,
    docs/algorithms/fnr-fl.md#refinement-optimizer), model in train mode. Continues from the
    weights the model holds (the locally trained ``w_j``, not the global ``w``).

    Returns the number of optimizer steps and the mean CE, J and Phi over the steps.
    """
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    steps, ce_sum, j_sum, phi_sum = 0, 0.0, 0.0, 0.0
    device = model_device(model)
    for _ in range(epochs):
        for start in range(0, len(public), batch_size):
            x, y = public.x[start:start + batch_size].to(device), public.y[start:start + batch_size].to(device)
            if penalty == "paper":
                ce = F.cross_entropy(model(x), y)
                j_value = penalty_term(y, delta)
                # As written: a Python float added to the loss -> zero gradient (module docstring).
                loss = ce + lam * j_value
            else:
                feats, logits = features_and_logits(model, x, feature_block)
                ce = F.cross_entropy(logits, y)
                j = _differentiable_penalty(feats, y, reference or {})
                j_value = float(j.detach())
                loss = ce + lam * j
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            ce_sum += float(ce.detach())
            j_sum += j_value
            phi_sum += float(loss.detach())
    div = max(1, steps)
    return {"steps": steps, "ce": ce_sum / div, "penalty": j_sum / div, "loss": phi_sum / div}


# ------------------------------------------------------------------------------------------------
# server-side math (pure functions, unit-tested)
# ------------------------------------------------------------------------------------------------
def _id_key(device_id: str) -> list[Any]:
    """Natural order of device ids ("dev-2" < "dev-10"), used to break accuracy ties."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", device_id)]


def select_for_refinement(accuracies: Mapping[str, float], p: float) -> list[str]:
    """``S_re``: the ``floor(n * p)`` devices with the lowest public accuracy (Alg. 3 line 10;
    the code's ``int(n * p)``). Ties: smaller device id first (docs/algorithms/fnr-fl.md#ties; the
    code keeps dict order)."""
    n_re = int(math.floor(len(accuracies) * p))
    order = sorted(accuracies, key=lambda d: (accuracies[d], _id_key(d)))
    return order[:n_re]


def _reference_devices(j: str, participants: Sequence[str], selected: Sequence[str], reference_set: str) -> list[str]:
    if reference_set == "all_others":
        return [m for m in participants if m != j]
    return [m for m in participants if m not in set(selected)]


def feature_norm_differences(j: str, participants: Sequence[str], selected: Sequence[str],
                             norms: Mapping[str, Mapping[int, float]],
                             reference_set: str = "non_selected") -> dict[int, float]:
    """Algorithm 2: ``Delta_j[l] = sum_{m in ref, l in F_m} (F_m[l] - F_j[l])`` for ``l in F_j``.

    ``ref`` is ``S \\ S_re`` (paper) or every ``m != j`` (official code, ``"all_others"``). A class
    that no reference device has gets no key (Alg. 2 would index a missing entry; skipping it is
    this project's reading, docs/algorithms/fnr-fl.md#missing-class). Empty when the reference set is empty (p = 1)."""
    delta: dict[int, float] = {}
    own = norms[j]
    for m in _reference_devices(j, participants, selected, reference_set):
        for label, value in own.items():
            if label in norms[m]:
                delta[label] = delta.get(label, 0.0) + (float(norms[m][label]) - float(value))
    return delta


def reference_norms(j: str, participants: Sequence[str], selected: Sequence[str],
                    norms: Mapping[str, Mapping[int, float]], reference_set: str = "non_selected") -> dict[int, float]:
    """``Fbar[l]``: mean ``F_m[l]`` over the reference devices having class l (differentiable mode)."""
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for m in _reference_devices(j, participants, selected, reference_set):
        for label, value in norms[m].items():
            sums[label] = sums.get(label, 0.0) + float(value)
            counts[label] = counts.get(label, 0) + 1
    return {label: sums[label] / counts[label] for label in sums}


# ------------------------------------------------------------------------------------------------
# wire helpers and validation
# ------------------------------------------------------------------------------------------------
def _check_classes(table: Mapping[int, float], num_classes: int, what: str) -> None:
    """ValueError unless every class key is a class id of the model, ``[0, num_classes)``."""
    outside = sorted(label for label in table if label >= num_classes)
    if outside:
        raise ValueError(f"{what}: class keys {outside} are not class ids in [0, {num_classes})")


def _to_wire(table: Mapping[int, float]) -> dict[str, float]:
    """A class table for the metrics record: decimal string keys, in class order."""
    return {str(k): float(v) for k, v in sorted(table.items())}


#: Tag of the seeded permutation that fixes the order of ``D_pub`` (see ``_public_set_cached``).
_PUBLIC_ORDER_STREAM = 0x5055_4200


@functools.lru_cache(maxsize=4)
def _public_set_cached(spec_json: str, source: str) -> ArrayDataset:
    """``D_pub`` of a data spec in its fixed refinement order, loaded once per process (many
    virtual devices share it read-only).

    The official code iterates its public set (the CIFAR-10 test set, whose samples come in random
    class order) unshuffled. The project's sets are stored in index order, which may be grouped by
    class (the embedded MNIST is): iterating that in order gives one-class batches and wrecks the
    refinement. So ``D_pub`` is put once into a seeded random order (from ``data.seed``), the same
    on every device and in every epoch: the code's "fixed order over a randomly ordered set".
    """
    spec = DataSpec.model_validate_json(spec_json)
    if source == "test_set_leaky":
        data = load_dataset(spec)[1]  # the evaluation set: leaky, paper-reproduction only
    else:
        data = load_public_set(spec)
    rng = np.random.default_rng(np.random.SeedSequence([int(spec.seed) & 0xFFFFFFFF, _PUBLIC_ORDER_STREAM]))
    return data.subset(rng.permutation(len(data)))


def public_set(data: Mapping[str, Any] | DataSpec, source: str = "holdout") -> ArrayDataset:
    """The public labelled set every participant holds (see ``FNRFLParams.public_set``)."""
    spec = data if isinstance(data, DataSpec) else DataSpec.model_validate(dict(data))
    return _public_set_cached(spec.model_dump_json(), source)


# ------------------------------------------------------------------------------------------------
# device logic
# ------------------------------------------------------------------------------------------------
class FNRFLLogic(DeviceLogic[Payload], TwoPhaseLogic[FNRFLFollowUp]):
    """Device side: plain CE local training (base), then the two-phase part: report (A_i, F_i),
    refinement if instructed."""

    def __init__(self, params: JsonMap) -> None:
        super().__init__(params)
        self.cfg = _DeviceParams.model_validate(params)
        self.refined = False
        self.stats: dict[str, float | int] = {}

    def _public(self) -> ArrayDataset:
        return public_set(self.cfg.data, self.cfg.public_set)

    def report(self, model: nn.Module, data: ArrayDataset) -> FNRFLReport:
        """Alg. 3 lines 26-27 on the locally trained model: accuracy and class-average feature
        norms on ``D_pub`` (eval mode, no gradients)."""
        norms, accuracy = class_average_feature_norms(model, self._public(), self.cfg.feature_block,
                                                      self.cfg.public_batch_size)
        return FNRFLReport(public_accuracy=accuracy, feature_norms=norms, num_samples=len(data))

    def follow_up(self, model: nn.Module, data: ArrayDataset, instruction: FNRFLFollowUp) -> None:
        """Refine on ``D_pub`` when picked (Alg. 3 lines 29-43); otherwise keep ``w_i`` as it is."""
        if not instruction.refine:
            return
        delta = instruction.delta or {}
        reference = instruction.reference_norms or {}
        _check_classes(delta, self.cfg.num_classes, "delta")
        _check_classes(reference, self.cfg.num_classes, "reference_norms")
        self.stats = refine_on_public(
            model, self._public(), delta, lam=self.cfg.lam, epochs=self.cfg.refine_epochs,
            batch_size=self.cfg.public_batch_size, lr=self.cfg.lr, momentum=self.cfg.momentum,
            weight_decay=self.cfg.weight_decay, feature_block=self.cfg.feature_block, penalty=self.cfg.penalty,
            reference=reference,
        )
        self.refined = True

    def upload_extras(self, model: nn.Module, data: ArrayDataset) -> FNRFLUploadExtras:
        """Whether this upload is a refined model, with the refinement's diagnostics."""
        if not self.refined:
            return FNRFLUploadExtras(refined=False)
        return FNRFLUploadExtras(refined=True, refine_steps=int(self.stats["steps"]), refine_ce=float(self.stats["ce"]),
                                 refine_penalty=float(self.stats["penalty"]), refine_loss=float(self.stats["loss"]))


# ------------------------------------------------------------------------------------------------
# Fed Server side
# ------------------------------------------------------------------------------------------------
class FNRFL(Algorithm[FNRFLUploadExtras], TwoPhaseAlgorithm[FNRFLReport, FNRFLFollowUp]):
    """FNR-FL on the Fed Server: ranks reports, plans refinements (the two-phase protocol), FedAvg
    aggregation (base)."""

    Params = FNRFLParams
    Logic = FNRFLLogic
    needs_classes = "it ranks devices by their per-class feature norms and public-set accuracy"
    individual_updates = "it ranks each device by its own report and refines the worst ones"
    Report = FNRFLReport
    FollowUp = FNRFLFollowUp
    UploadExtras = FNRFLUploadExtras

    def __init__(self, config: "RunConfig") -> None:
        super().__init__(config)
        self.params: FNRFLParams
        if self.params.public_set == "holdout" and config.data.public_samples <= 0:
            raise ValueError("fnr-fl needs a public labelled set: set data.public_samples > 0 (a stratified "
                             "hold-out of the training set), or algorithm_params.public_set=test_set_leaky "
                             "to reproduce the paper's leaky protocol")
        self.feature_block = ""
        self.num_classes = 0
        self._plan: dict[str, Any] = {}

    def bind_model(self, model: nn.Module) -> None:
        super().bind_model(model)
        self.feature_block = getattr(model, "feature_block", None) or ""
        self.num_classes = int(getattr(model, "num_classes", 0))
        if not self.feature_block or self.num_classes < 1:
            raise ValueError("fnr-fl needs a model that declares feature_block and num_classes")

    def model_parts_needed(self) -> tuple[str, ...]:
        """The penultimate features are the feature block's output."""
        return ("feature_block",)

    @property
    def leaky(self) -> bool:
        return self.params.public_set == "test_set_leaky"

    def device_params(self) -> JsonMap:
        """The parameters plus what the device logic needs: feature block, class count, the data
        spec (to load ``D_pub``) and the refinement optimizer settings (those of local training)."""
        train = self.config.train
        return {**self.params.model_dump(mode="json"), "feature_block": self.feature_block,
                "num_classes": self.num_classes, "data": self.config.data.model_dump(mode="json"),
                "lr": self.params.refine_lr or train.lr, "momentum": train.momentum, "weight_decay": train.weight_decay}

    def plan_follow_ups(self, ctx: RoundContext, reports: Mapping[str, FNRFLReport]) -> dict[str, FNRFLFollowUp]:
        """Rank the valid reports, pick ``S_re``, compute each picked device's ``Delta_j``.

        Malformed reports (non-finite, out of range) were refused when they arrived. A report
        naming a class the model does not have (which only the bound model knows) takes no part
        in ranking or as a reference, is told not to refine, and its upload is refused
        (``accept_update``), like a FedAvg upload with NaN weights. Other devices go on.
        """
        accuracies: dict[str, float] = {}
        norms: dict[str, dict[int, float]] = {}
        invalid: dict[str, str] = {}
        for device in sorted(reports, key=_id_key):
            report = reports[device]
            try:
                _check_classes(report.feature_norms, self.num_classes, "feature_norms")
            except ValueError as exc:
                invalid[device] = str(exc)
                continue
            accuracies[device], norms[device] = report.public_accuracy, dict(report.feature_norms)
        participants = sorted(accuracies, key=_id_key)
        selected = select_for_refinement(accuracies, self.params.p)
        deltas = {j: feature_norm_differences(j, participants, selected, norms, self.params.reference_set)
                  for j in selected}
        instructions: dict[str, FNRFLFollowUp] = {}
        for device in reports:
            if device in invalid:
                instructions[device] = FNRFLFollowUp(refine=False, excluded=invalid[device])
            elif device in deltas:
                reference = reference_norms(device, participants, selected, norms, self.params.reference_set) \
                    if self.params.penalty == "differentiable" else None
                instructions[device] = FNRFLFollowUp(refine=True, delta=deltas[device], reference_norms=reference)
            else:
                instructions[device] = FNRFLFollowUp(refine=False)
        # Keyed by the logical round: a retried or resumed attempt of the same round is the same round.
        self._plan = {"round": ctx.index, "accuracies": accuracies, "norms": norms, "selected": selected,
                      "deltas": deltas, "invalid": invalid}
        return instructions

    def accept_update(self, device_id: str, ctx: RoundContext, state: Mapping[str, torch.Tensor],
                      extras: FNRFLUploadExtras, num_samples: int, global_state: Mapping[str, torch.Tensor]) -> None:
        """The upload must say truthfully whether it was refined (the plan of this round knows)."""
        if self._plan.get("round") != ctx.index:
            raise ValueError(f"no follow-up plan for round {ctx.index}")
        if device_id in self._plan["invalid"]:
            raise ValueError(f"the report of {device_id} was rejected: {self._plan['invalid'][device_id]}")
        expected = device_id in self._plan["deltas"]
        if extras.refined != expected:
            raise ValueError(f"{device_id} was {'' if expected else 'not '}asked to refine "
                             f"but says refined={extras.refined}")

    def round_metrics(self, ctx: RoundContext, extras: Mapping[str, FNRFLUploadExtras]) -> JsonMap:
        """Who was refined and why: public accuracies, S_re, Delta_j, the refinement losses, and
        ``leaky`` (true when ``D_pub`` is the evaluation set)."""
        metrics: JsonMap = {**super().round_metrics(ctx, extras), "leaky": self.leaky,
                           "public_set": self.params.public_set, "penalty": self.params.penalty}
        plan = self._plan if self._plan.get("round") == ctx.index else {}
        selected = plan.get("selected", [])
        metrics.update({
            "reported": len(plan.get("accuracies", {})),
            "refine_selected": list(selected),
            "refined": sorted((d for d, e in extras.items() if e.refined), key=_id_key),
            "public_accuracy": dict(plan.get("accuracies", {})),
            "feature_norms": {d: _to_wire(t) for d, t in plan.get("norms", {}).items()},
            "delta": {d: _to_wire(t) for d, t in plan.get("deltas", {}).items()},
            "refine_stats": {d: e.model_dump(exclude={"refined"}) for d, e in sorted(extras.items()) if e.refined},
        })
        if plan.get("invalid"):
            metrics["invalid_reports"] = dict(plan["invalid"])
        return metrics
