"""HiCS-FL: heterogeneity-guided client sampling (Chen & Vikalo, NeurIPS 2024), a selection policy.

The Fed Server estimates how class-balanced each device's data is from the update of the output
layer's bias during the device's local training (``Δb = b_after - b_before``;
docs/algorithms/hics.md#what-it-does): ``Ĥ_k = H(softmax(Δb_k / T))`` in nats (high = balanced).
Devices are clustered with the distance ``arccos(cos∠(Δb_u, Δb_k)) + λ|Ĥ_u - Ĥ_k|`` (Eq. 9) by Ward
linkage on the rows of the distance matrix (as the official code does,
docs/algorithms/hics.md#clustering-input), a cluster is drawn from ``softmax(γ^t H̄_m)`` with
``γ^t = γ⁰(1 - t/𝒯)`` and a device inside it proportionally to its data size (Eq. 10). Until every
device has been observed once, unobserved devices are selected first (the warm-up,
docs/algorithms/hics.md#warm-up).

Used as ``RunConfig.selection = "hics"`` under any algorithm; aggregation is the algorithm's own
(FedAvg: data-size weighted — the paper's is the plain mean, see docs/algorithms/hics.md).

Only numpy is used (Ward linkage is implemented here; SciPy is not a dependency).
"""
from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext
from shared.algorithms.selection import DeviceSelector, SelectorParams

if TYPE_CHECKING:
    from shared.config import RunConfig

log = logging.getLogger(__name__)

__all__ = [
    "HiCSParams", "HiCSSelector", "estimate_entropy", "distance_matrix", "ward_clusters",
    "cluster_probabilities", "annealed_gamma", "draw_without_replacement", "output_signal",
]


class HiCSParams(SelectorParams):
    """HiCS-FL hyperparameters (``RunConfig.selection_params``); defaults = paper, FMNIST."""

    # T of Eq. 7 / 26. Must match the scale of Δb (which grows with lr and local steps): the paper
    # uses 0.0025 with SGD at lr 0.001; with this project's default lr (0.05) a larger T is needed
    # (docs/algorithms/hics.md), or use normalize="max_abs" with a dimensionless T.
    temperature: float = Field(0.0025, gt=0)
    # λ of Eq. 9 (paper: 10 in all experiments).
    lambda_entropy: float = Field(10.0, ge=0)
    # γ⁰ of the annealed cluster softmax (paper: 4 for FMNIST/CIFAR-10, 2 for Mini-ImageNet).
    gamma0: float = Field(4.0, ge=0)
    # "linear": γ^t = γ⁰(1 - t/𝒯) (paper); "constant": γ^t = γ⁰.
    annealing: Literal["linear", "constant"] = "linear"
    # 𝒯 of the annealing; None = RunConfig.rounds.
    total_rounds: int | None = Field(None, ge=1)
    # M; None = the number of devices selected per round (paper: M = K).
    num_clusters: int | None = Field(None, ge=1)
    # Signal fed to the entropy estimate (docs/algorithms/hics.md#signal): the bias update (paper) or
    # the row means of the output weight update (official code).
    signal: Literal["bias", "weight_row_mean"] = "bias"
    # Non-paper scale fixes (docs/algorithms/hics.md#temperature): divide Δb by the device's local
    # SGD steps, or by max|Δb|.
    normalize: Literal["none", "per_step", "max_abs"] = "none"
    # Refresh a device's stored Δb whenever it trains (paper) or only on its first observation
    # (the official code's multi-alpha runs, docs/algorithms/hics.md#refresh).
    refresh: Literal["every_participation", "first_only"] = "every_participation"
    # Within-cluster sampling ∝ data size (paper) or uniform (official code,
    # docs/algorithms/hics.md#within-cluster).
    within_cluster: Literal["data_size", "uniform"] = "data_size"
    # Top the last warm-up round up to K with uniformly random already-observed devices (the paper's
    # last warm-up round has only N mod K devices).
    warmup_fill: bool = False


# --- pure math (unit-tested against hand-computed values) -----------------------------------------
def estimate_entropy(delta: np.ndarray, temperature: float) -> float:
    """Ĥ = H(softmax(Δb / T)) in nats (paper Eq. 7), with a max-shifted, overflow-free softmax."""
    z = np.asarray(delta, dtype=np.float64) / float(temperature)
    if z.ndim != 1 or z.size == 0 or not np.all(np.isfinite(z)):
        raise ValueError(f"bias update must be a non-empty finite vector, got {delta!r}")
    z = z - z.max()
    e = np.exp(z)
    p = e / e.sum()
    nz = p > 0.0
    return float(max(0.0, -np.sum(p[nz] * np.log(p[nz]))))


def distance_matrix(deltas: np.ndarray, entropies: np.ndarray, lam: float) -> np.ndarray:
    """Eq. 9: ``D[u,k] = arccos(cos∠(Δb_u, Δb_k)) + λ|Ĥ_u - Ĥ_k|`` (radians + nats), symmetric, zero diagonal.

    The cosine is clipped to [-1, 1] (rounding can give 1.0000000002). A zero vector has no angle;
    as in the official code its angular term is 0 (it cannot happen for observed devices that trained).
    """
    x = np.asarray(deltas, dtype=np.float64)
    h = np.asarray(entropies, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1)
    safe = np.where(norms > 0.0, norms, 1.0)
    unit = x / safe[:, None]
    cos = np.clip(unit @ unit.T, -1.0, 1.0)
    angle = np.arccos(cos)
    zero = norms == 0.0
    angle[zero, :] = 0.0
    angle[:, zero] = 0.0
    d = angle + float(lam) * np.abs(h[:, None] - h[None, :])
    d = 0.5 * (d + d.T)
    np.fill_diagonal(d, 0.0)
    return d


def ward_clusters(points: np.ndarray, n_clusters: int) -> list[int]:
    """Agglomerative clustering with Ward linkage (Euclidean) of the rows of ``points``, cut at ``n_clusters``.

    Same result as ``scipy.cluster.hierarchy.cut_tree(linkage(points, "ward"), n_clusters)`` (up to label
    names and exact ties): Lance–Williams updates on squared distances, ``d²(k, i∪j) = ((n_i+n_k)d²(k,i)
    + (n_j+n_k)d²(k,j) - n_k d²(i,j)) / (n_i+n_j+n_k)``; Ward merge heights are monotone, so stopping after
    N - M merges equals cutting the tree at M clusters. O(N³) time, fine for a few hundred devices.
    Ties go to the lexicographically first pair (deterministic). Labels are 0..M-1, numbered by the
    first row of each cluster.
    """
    x = np.asarray(points, dtype=np.float64)
    n = x.shape[0]
    if n == 0:
        return []
    m = max(1, min(int(n_clusters), n))
    sq = np.sum(x * x, axis=1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)
    np.fill_diagonal(d2, np.inf)
    size = np.ones(n)
    active = np.ones(n, dtype=bool)
    members: dict[int, list[int]] = {i: [i] for i in range(n)}
    for _ in range(n - m):
        flat = int(np.argmin(d2))
        i, j = divmod(flat, n)
        if i > j:
            i, j = j, i
        ni, nj, dij = size[i], size[j], d2[i, j]
        others = active.copy()
        others[[i, j]] = False
        nk = size[others]
        new = ((ni + nk) * d2[i, others] + (nj + nk) * d2[j, others] - nk * dij) / (ni + nj + nk)
        d2[i, others] = new
        d2[others, i] = new
        d2[j, :] = np.inf
        d2[:, j] = np.inf
        active[j] = False
        size[i] = ni + nj
        members[i].extend(members.pop(j))
    labels = [0] * n
    for label, root in enumerate(sorted(members, key=lambda r: min(members[r]))):
        for row in members[root]:
            labels[row] = label
    return labels


def annealed_gamma(gamma0: float, round_id: int, total_rounds: int, annealing: str = "linear") -> float:
    """γ^t = γ⁰(1 - t/𝒯), t = round_id (1-based, paper Eq. 10), clipped at 0 past 𝒯."""
    if annealing == "constant":
        return float(gamma0)
    return float(gamma0) * max(0.0, 1.0 - float(round_id) / float(total_rounds))


def cluster_probabilities(mean_entropies: Sequence[float], gamma: float) -> np.ndarray:
    """π_m = softmax_m(γ H̄_m) (paper Eq. 10), max-shifted."""
    z = float(gamma) * np.asarray(mean_entropies, dtype=np.float64)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


def draw_without_replacement(weights: np.ndarray, k: int, rng: random.Random) -> list[int]:
    """``k`` distinct indices, each next one drawn ∝ ``weights`` over the indices not yet drawn.

    This is exactly the distribution of the paper's loop "draw a cluster m ~ π, a device ~ p̃_m, add it
    to S^t until |S^t| = K" (a repeat is a rejected draw, so the next *new* device is ∝ its per-draw
    probability π_{m(k)}·p̃_k among the unchosen), without its unbounded retries when π is very skewed.
    If all remaining weights are zero (underflow), the rest is drawn uniformly. Uses ``rng.random()``
    once per draw: deterministic given the rng.
    """
    w_all = np.asarray(weights, dtype=np.float64)
    remaining = list(range(w_all.size))
    chosen: list[int] = []
    for _ in range(min(int(k), w_all.size)):
        w = w_all[remaining]
        total = float(w.sum())
        if not total > 0.0:
            w, total = np.ones(len(remaining)), float(len(remaining))
        idx = int(np.searchsorted(np.cumsum(w), rng.random() * total, side="right"))
        chosen.append(remaining.pop(min(idx, len(remaining) - 1)))
    return chosen


def output_signal(state: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                  output_layer: str, signal: str = "bias") -> np.ndarray | None:
    """The C-vector the estimate uses, from one state holding the output layer (None if it does not).

    ``bias``: ``Δb = b_new - b_old`` (new minus old: with the reverse sign a one-class device looks balanced);
    ``weight_row_mean``: row means of ``ΔW`` (official code). Raises ValueError for shape/finite problems.
    """
    key = f"{output_layer}.bias" if signal == "bias" else f"{output_layer}.weight"
    if not output_layer or key not in state:
        return None
    if key not in global_state:
        raise ValueError(f"output-layer key {key!r} is not in the global state")
    new = state[key].detach().to("cpu", torch.float64)
    old = global_state[key].detach().to("cpu", torch.float64)
    if tuple(new.shape) != tuple(old.shape):
        raise ValueError(f"{key}: uploaded shape {tuple(new.shape)} != global shape {tuple(old.shape)}")
    delta = new - old
    if signal != "bias":
        delta = delta.reshape(delta.shape[0], -1).mean(dim=1)
    out = delta.numpy().reshape(-1)
    if out.size == 0 or not np.all(np.isfinite(out)):
        raise ValueError(f"{key}: output-layer update is empty or not finite")
    return out


# --- the selector --------------------------------------------------------------------------------
class HiCSSelector(DeviceSelector):
    """HiCS-FL client sampling (paper Algorithm 1) over the devices the algorithm makes eligible.

    State (JSON-able, in the checkpoint): per-device latest signal, data size, round observed and
    source ("client" upload or group "server" copy); the round counter; last round's diagnostics.
    """

    Params: ClassVar[type[SelectorParams]] = HiCSParams
    needs_classes = "it estimates each device's label distribution from its output layer's update"
    individual_updates = needs_classes

    def __init__(self, config: "RunConfig", output_layer: str | None = None) -> None:
        super().__init__(config, output_layer)
        self.params: HiCSParams
        # device -> {"delta": [float], "weight": float, "round": int, "source": "client"|"server"}
        self.estimates: dict[str, dict[str, Any]] = {}
        self.round_id = 0
        self.visited: set[str] = set()
        self._last: dict[str, Any] = {}
        self._observed_now: list[str] = []
        self._skipped_now = 0

    # --- estimates ---------------------------------------------------------------------------
    def model_parts_needed(self) -> tuple[str, ...]:
        """The entropy estimate reads the output layer's update (its bias in the paper)."""
        return ("output_layer",)

    def _scaled(self, device: str) -> np.ndarray:
        """The stored signal, with the optional (non-paper) normalisation applied."""
        entry = self.estimates[device]
        delta = np.asarray(entry["delta"], dtype=np.float64)
        if self.params.normalize == "per_step":
            train = self.config.train
            steps = train.local_epochs * max(1, math.ceil(entry["weight"] / train.batch_size))
            delta = delta / steps
        elif self.params.normalize == "max_abs":
            peak = float(np.max(np.abs(delta)))
            delta = delta / peak if peak > 0.0 else delta
        return delta

    def entropy(self, device: str) -> float:
        """Ĥ of an observed device (recomputed from the stored update,
        docs/algorithms/hics.md#state-kept-across-rounds)."""
        return estimate_entropy(self._scaled(device), self.params.temperature)

    def observe(self, device_id: str, contribution: Contribution, global_state: Mapping[str, torch.Tensor]) -> None:
        """Store the device's output-layer update (before aggregation changes ``global_state``).

        Split mode: the output layer usually lives on the Main Server, so the device's upload lacks
        it and the group's server copy is used: a *group-level* estimate shared by the group's members
        (no per-device Δb exists there; a deviation forced by split learning). A bad upload is logged
        and skipped (the device stays unobserved) rather than failing the round's aggregation.
        """
        if self.params.refresh == "first_only" and device_id in self.estimates:
            return
        try:
            weight = float(contribution.weight)
            if not math.isfinite(weight) or weight <= 0.0:
                raise ValueError(f"data size must be finite and > 0, got {contribution.weight}")
            source = "client"
            delta = output_signal(contribution.client_state, global_state, self.output_layer or "", self.params.signal)
            if delta is None and contribution.server_state is not None:
                source = "server"
                delta = output_signal(contribution.server_state, global_state, self.output_layer or "",
                                      self.params.signal)
            if delta is None:
                raise ValueError(f"no output layer {self.output_layer!r} in the upload or its group's server copy")
            if self.estimates:
                size = len(next(iter(self.estimates.values()))["delta"])
                if delta.size != size:
                    raise ValueError(f"output-layer update has {delta.size} entries, others have {size}")
        except ValueError as exc:
            log.warning("hics: device %s not observed in round %d: %s", device_id, self.round_id, exc)
            self._skipped_now += 1
            return
        self.estimates[device_id] = {"delta": [float(v) for v in delta], "weight": weight,
                                     "round": int(self.round_id), "source": source}
        self._observed_now.append(device_id)

    # --- selection ---------------------------------------------------------------------------
    def select(self, ctx: RoundContext, available: Sequence[str], count: int, rng: random.Random) -> list[str]:
        """Unobserved devices first (warm-up, uniformly random), the rest by the HiCS procedure.
        The paper's t is the logical round (``ctx.index``)."""
        round_id = ctx.index
        self.round_id = int(round_id)
        self._observed_now, self._skipped_now = [], 0
        pool = sorted(available)
        count = min(int(count), len(pool))
        unseen = [d for d in pool if d not in self.estimates]
        seen = [d for d in pool if d in self.estimates]
        forced = sorted(rng.sample(unseen, min(count, len(unseen))))
        warmup = bool(unseen)
        rest = count - len(forced)
        info: dict[str, Any] = {"hics_warmup": int(warmup), "hics_forced": len(forced), "hics_clusters": 0,
                                "hics_gamma": None, "hics_selected_entropy_mean": None}
        picked: list[str] = []
        if rest > 0 and seen:
            # Paper: the warm-up is ⌈N/K⌉ rounds and its last round holds only N mod K devices. In a live
            # system (drops, late joiners) unseen devices come first and the HiCS procedure fills up.
            in_paper_warmup = round_id <= math.ceil(len(pool) / max(1, count))
            if not warmup or not in_paper_warmup:
                picked = self._hics_pick(seen, rest, count, rng, info)
            elif self.params.warmup_fill:
                picked = sorted(rng.sample(seen, rest))
        selected = sorted(forced + picked)
        scored = [self.entropy(d) for d in selected if d in self.estimates]
        if scored:
            info["hics_selected_entropy_mean"] = float(np.mean(scored))
        info["hics_observed"] = len(seen)
        self.visited.update(selected)
        self._last = info
        return selected

    def _hics_pick(self, seen: list[str], k: int, count: int, rng: random.Random, info: dict[str, Any]) -> list[str]:
        """Clusters the observed devices and draws ``k`` distinct ones (paper Algorithm 1,
        docs/algorithms/hics.md#what-it-does)."""
        if k >= len(seen):
            return list(seen)
        deltas = np.stack([self._scaled(d) for d in seen])
        entropies = np.array([estimate_entropy(v, self.params.temperature) for v in deltas])
        dist = distance_matrix(deltas, entropies, self.params.lambda_entropy)
        m = min(self.params.num_clusters or count, len(seen))
        labels = np.asarray(ward_clusters(dist, m))  # rows of D as points (official code)
        n_labels = int(labels.max()) + 1
        mean_h = [float(entropies[labels == c].mean()) for c in range(n_labels)]
        total = self.params.total_rounds or self.config.rounds
        gamma = annealed_gamma(self.params.gamma0, self.round_id, total, self.params.annealing)
        pi = cluster_probabilities(mean_h, gamma)
        sizes = np.array([self.estimates[d]["weight"] for d in seen], dtype=np.float64)
        if self.params.within_cluster == "uniform":
            sizes = np.ones_like(sizes)
        within = np.empty(len(seen))
        for c in range(n_labels):
            mask = labels == c
            within[mask] = sizes[mask] / sizes[mask].sum()
        # Per-draw probability of device k: π_{m(k)} · p̃_k. The paper draws (cluster, device) pairs until
        # K distinct devices are in S^t; rejecting repeats makes each next *new* device distributed ∝ these
        # weights over the devices not yet chosen, which is drawn here directly (same distribution, no
        # unbounded loop when π is very skewed).
        chosen = draw_without_replacement(pi[labels] * within, k, rng)
        info.update({"hics_clusters": n_labels, "hics_gamma": gamma,
                     "hics_cluster_probability_max": float(pi.max()),
                     "hics_entropy_mean_all": float(entropies.mean())})
        return [seen[i] for i in chosen]

    # --- records and checkpoints -------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        """This round's selection diagnostics plus the fresh estimates of the round's devices."""
        fresh = [self.entropy(d) for d in self._observed_now if d in self.estimates]
        return {**self._last, "hics_round_entropy_mean": float(np.mean(fresh)) if fresh else None,
                "hics_round_entropies": {d: round(self.entropy(d), 6) for d in sorted(self._observed_now)
                                         if d in self.estimates},
                "hics_skipped": self._skipped_now}

    def state_dict(self) -> dict[str, Any]:
        return {"round_id": self.round_id, "visited": sorted(self.visited),
                "estimates": {d: dict(e) for d, e in sorted(self.estimates.items())}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round_id = int(state.get("round_id", 0))
        self.visited = set(state.get("visited", []))
        self.estimates = {}
        for device, entry in dict(state.get("estimates", {})).items():
            delta = [float(v) for v in entry["delta"]]
            weight = float(entry["weight"])
            if not delta or not all(math.isfinite(v) for v in delta) or not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"hics state: invalid estimate for device {device!r}")
            self.estimates[str(device)] = {"delta": delta, "weight": weight, "round": int(entry.get("round", 0)),
                                           "source": str(entry.get("source", "client"))}
