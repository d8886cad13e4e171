"""Aggregation rules: how the Fed Server combines a round's uploads (``RunConfig.aggregation``).

Every rule works layer by layer on Algorithm 1's mixed portions (``shared/algorithms/aggregation.py``):
for each state key the candidates are what each device supplies for it, its own client portion
or else its group's server-side copy, and a rule combines the candidates' *updates* (value minus
the global value) into the key's new value. A group copy stands for each of its members, as in
Algorithm 1: the median, the trimmed mean and the norm bound count it once per member, with each
member's weight; Krum compares *distinct* candidates (a group copy once, with its members' summed
weight), since copies of one tensor would be each other's nearest neighbours at distance zero and
make Krum favour whatever a large group's copy holds.

Two bounds come before any rule, each a parameter every rule takes (``RuleParams``):

* ``max_weight_ratio`` k: every device's weight is clamped to k times the median weight of the
  round's devices, so a device that claims 10**12 samples weighs at most k median devices;
* ``clip`` c: for every floating key, each candidate's update is scaled down onto c times the
  median update norm of that key over the round's devices (a group copy once per member), so one
  update x1e6 moves the key no further than c honest-sized updates would.

Both medians are the usual ones (the mean of the two middle values for an even count), so one
harmful device among three or more cannot set either bound. ``mean`` takes both bounds switched
off (Algorithm 1 exactly); every other rule, ``bounded_mean`` (the default) among them, takes
them on. Integer and bool entries (``num_batches_tracked``) are the weighted mean rounded, as in
Algorithm 1, with the bounded weights, under every rule.

Adding a rule: a subclass of :class:`AggregationRule` with its own ``Params`` (a subclass of
:class:`RuleParams`) and :meth:`AggregationRule.combine`, and one line in ``AGGREGATION_RULES``
(``shared/algorithms/registry.py``); docs/configuration.md (``aggregation.*``) describes the rules.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.algorithms.aggregation import Contribution, check_contributions, layerwise_aggregate
from shared.algorithms.plugin_params import params_error

__all__ = ["AggregationRule", "Aggregated", "BoundedMean", "Krum", "Mean", "Median", "MultiKrum", "RuleParams",
           "TrimmedMean"]

#: The defaults of the two bounds (docs/configuration.md, ``aggregation.*``, says how they were chosen).
DEFAULT_CLIP = 3.0
DEFAULT_MAX_WEIGHT_RATIO = 4.0
#: Coordinates per slice for a coordinate-wise rule (``AggregationRule.coordinatewise``): ten
#: float64 slices of this size fit in a core's cache (64 Ki to 256 Ki ran equally fast here).
SLICE = 65536
#: The most candidates whose order :func:`ranks` counts by pairwise comparison (uint8 counts).
PAIRWISE_MAX = 64


class RuleParams(BaseModel):
    """The bounds every rule takes (``aggregation.params``); null switches a bound off."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    clip: float | None = Field(DEFAULT_CLIP, gt=0)
    max_weight_ratio: float | None = Field(DEFAULT_MAX_WEIGHT_RATIO, ge=1)


@dataclass
class Aggregated:
    """A rule's result: the new state, and where the bounds changed an input (for the log).

    ``clipped``: device -> the keys whose value that device supplied was clipped (a group copy
    counts for each member it stands for); ``capped``: device -> its weight after the bound.
    """

    state: dict[str, torch.Tensor]
    clipped: dict[str, list[str]] = field(default_factory=dict)
    capped: dict[str, float] = field(default_factory=dict)


class AggregationRule:
    """Base of the rules: bounds the weights and updates, then :meth:`combine` per floating key."""

    Params: ClassVar[type[RuleParams]] = RuleParams
    #: True: :meth:`combine` gets distinct candidates (a group copy once, its members' weights summed).
    distinct: ClassVar[bool] = False
    #: True: each coordinate's result depends on that coordinate alone, so :meth:`combine` is given a
    #: key's coordinates a slice at a time (``SLICE``).
    coordinatewise: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = self.Params.model_validate(dict(params))

    def aggregate(self, global_state: Mapping[str, torch.Tensor],
                  contributions: Mapping[str, Contribution]) -> Aggregated:
        """New global state from the round's contributions, keyed by device. Raises ValueError as
        ``layerwise_aggregate`` does (no contribution, a bad weight, an unknown key or shape)."""
        check_contributions(global_state, list(contributions.values()))
        weights, capped = bounded_weights({d: float(c.weight) for d, c in contributions.items()},
                                          self.params.max_weight_ratio)
        bounded, clipped = clip_updates(global_state, contributions, self.params.clip)
        bounded = {d: Contribution(weights[d], c.client_state, c.server_state, c.key_weights) for d, c in bounded.items()}
        # Algorithm 1 over the bounded inputs: the integer entries, keys nobody supplies, and the
        # whole result for the mean.
        state = layerwise_aggregate(global_state, list(bounded.values()))
        if type(self).combine is not AggregationRule.combine:
            with torch.no_grad():
                for key, g in global_state.items():
                    if g.is_floating_point():
                        candidates = _candidates(key, bounded, self.distinct)
                        if candidates:
                            state[key] = self._combine_key(g.detach(), candidates)
        return Aggregated(state, clipped, capped)

    def _combine_key(self, g: torch.Tensor, candidates: list[tuple[torch.Tensor, float]]) -> torch.Tensor:
        """One floating key's new value: :meth:`combine` of its candidates' float64 updates. A
        coordinate-wise rule gets them ``SLICE`` coordinates at a time: a slice of every candidate
        stays in cache through the rule's passes over it."""
        values, ws = zip(*candidates)
        weights = torch.tensor(ws, dtype=torch.float64, device=g.device)
        base = g.reshape(-1).to(torch.float64)
        flat = [v.detach().reshape(-1).to(g.device) for v in values]
        step = SLICE if self.coordinatewise else max(1, base.numel())
        combined = torch.empty_like(base)
        for start in range(0, base.numel(), step):
            end = start + step
            updates = torch.stack([v[start:end] for v in flat]).to(torch.float64)
            updates -= base[start:end]
            combined[start:end] = self.combine(updates, weights)
        return (base + combined).view(g.shape).to(g.dtype)

    def combine(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """One key's combined update from its candidates' ``updates`` (shape ``[n, k]``: the key
        flattened, or a slice of it for a ``coordinatewise`` rule; float64) and their bounded
        ``weights`` (``[n]``, > 0). The base class is the weighted mean, which ``aggregate``
        computes as Algorithm 1 itself (bit for bit), never through here."""
        raise NotImplementedError


class Mean(AggregationRule):
    """Algorithm 1: the ``|D_i|``-weighted mean, both bounds off unless set."""

    class Params(RuleParams):
        clip: float | None = Field(None, gt=0)
        max_weight_ratio: float | None = Field(None, ge=1)


class BoundedMean(AggregationRule):
    """Algorithm 1's weighted mean of the bounded updates and weights (the default rule)."""


class Median(AggregationRule):
    """Coordinate-wise weighted median: per coordinate, the value at which the weight below and
    the weight above are each at most half (the mean of the two values where half falls between
    two candidates, so equal weights give the usual median)."""

    coordinatewise = True

    def combine(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rank = ranks(updates)
        ordered = torch.empty_like(updates).scatter_(0, rank, updates)
        cumulative = torch.empty_like(updates).scatter_(0, rank, weights[:, None].expand_as(updates)).cumsum_(dim=0)
        half = float(weights.sum()) / 2
        # Every weight is positive (checked with the contributions), so the last cumulative weight,
        # the total, exceeds half: both positions fall on a candidate.
        lower = (cumulative < half).sum(dim=0, keepdim=True)
        upper = (cumulative <= half).sum(dim=0, keepdim=True)
        return (ordered.gather(0, lower) + ordered.gather(0, upper)).squeeze(0) / 2


class TrimmedMean(AggregationRule):
    """Coordinate-wise trimmed mean: per coordinate, the ``count`` (or ``fraction`` x n, rounded
    down; neither set: fraction 0.1) smallest and largest candidates are dropped and the rest
    averaged with their weights. At least one candidate always stays (the trim shrinks to
    ``(n - 1) // 2`` at each end)."""

    class Params(RuleParams):
        fraction: float | None = Field(None, ge=0, lt=0.5)
        count: int | None = Field(None, ge=0)

        @model_validator(mode="after")
        def _one_of(self) -> "TrimmedMean.Params":
            if self.fraction is not None and self.count is not None:
                raise ValueError("set fraction or count, not both")
            return self

    params: Params
    coordinatewise = True

    def combine(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = updates.shape[0]
        fraction = 0.1 if self.params.fraction is None else self.params.fraction
        trim = self.params.count if self.params.count is not None else math.floor(fraction * n)
        trim = min(trim, (n - 1) // 2)
        rank = ranks(updates)
        kept_w = ((rank >= trim) & (rank < n - trim)) * weights[:, None]
        return (updates * kept_w).sum(dim=0) / kept_w.sum(dim=0)


class MultiKrum(AggregationRule):
    """Multi-Krum (Blanchard et al. 2017, El Mhamdi et al. 2018) per key over distinct candidates:
    each candidate's score is the sum of its squared distances to its ``n - f - 2`` nearest others
    (at least one); the ``m`` best-scored (default ``n - f``, at least one) are averaged with their
    weights. Scores ignore the weights. Krum's guarantee needs ``n >= 2f + 3`` distinct candidates;
    with fewer the rule still runs, on the nearest neighbours it has."""

    class Params(RuleParams):
        f: int = Field(1, ge=0)
        m: int | None = Field(None, ge=1)

    params: Params
    distinct = True

    def selected(self, n: int) -> int:
        """How many candidates of ``n`` are averaged."""
        return max(1, min(n, self.params.m if self.params.m is not None else n - self.params.f))

    def combine(self, updates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n = updates.shape[0]
        distances = torch.cdist(updates, updates).square()
        neighbours = max(1, n - self.params.f - 2)
        nearest = distances.sort(dim=1).values[:, 1:neighbours + 1]   # column 0: the candidate itself
        chosen = nearest.sum(dim=1).argsort(stable=True)[:self.selected(n)]
        kept_w = torch.zeros_like(weights)
        kept_w[chosen] = weights[chosen]
        return kept_w @ updates / kept_w.sum()


class Krum(MultiKrum):
    """Krum: the one candidate with the best Multi-Krum score."""

    class Params(RuleParams):
        f: int = Field(1, ge=0)

    def selected(self, n: int) -> int:
        return 1


def ranks(updates: torch.Tensor) -> torch.Tensor:
    """Each candidate's position when every coordinate's values are sorted ascending, ties in
    candidate order (a stable sort's): int64, the shape of ``updates`` (``[n, k]``).

    Up to ``PAIRWISE_MAX`` candidates the ranks are counted from one comparison per pair, which
    here took a seventh of ``torch.sort``'s time at 10 candidates and a third at 64
    (benchmarks/why-the-code-is-as-it-is.md); beyond, a stable sort gives them."""
    n = updates.shape[0]
    if n > PAIRWISE_MAX:
        order = updates.sort(dim=0, stable=True).indices
        positions = torch.arange(n, device=updates.device).view(-1, 1).expand_as(order)
        return torch.empty_like(order).scatter_(0, order, positions)
    counts = torch.zeros(updates.shape, dtype=torch.uint8, device=updates.device)
    for i in range(n):
        for j in range(i + 1, n):
            after = updates[j] < updates[i]      # j sorts before i; a tie keeps i first
            counts[i] += after
            counts[j] += ~after
    return counts.long()


def bounded_weights(weights: Mapping[str, float], ratio: float | None) -> tuple[dict[str, float], dict[str, float]]:
    """Each weight clamped to ``ratio`` x the median weight (None: unchanged). Returns the
    weights and those of them the bound changed."""
    if ratio is None:
        return dict(weights), {}
    bound = ratio * statistics.median(weights.values())
    out = {d: min(w, bound) for d, w in weights.items()}
    return out, {d: w for d, w in out.items() if w != weights[d]}


def clip_updates(global_state: Mapping[str, torch.Tensor], contributions: Mapping[str, Contribution],
                 clip: float | None) -> tuple[dict[str, Contribution], dict[str, list[str]]]:
    """The contributions with every floating value whose update norm exceeds ``clip`` x its key's
    median update norm scaled onto that bound (None: unchanged). A value is clipped once however
    many devices supply it (a group copy stays one tensor). Also returns device -> the keys clipped."""
    if clip is None:
        return dict(contributions), {}
    replaced: dict[int, torch.Tensor] = {}   # id of a clipped tensor -> its clipped value
    clipped: dict[str, list[str]] = {}
    # The differences go through one float64 scratch buffer per device (as in layerwise_aggregate):
    # a fresh float64 copy per upload and key made this pass cost five times the mean itself.
    largest = max((g.numel() for g in global_state.values()), default=0)
    scratch: dict[torch.device, torch.Tensor] = {}
    with torch.no_grad():
        for key, g in global_state.items():
            if not g.is_floating_point():
                continue
            supplied = {d: v for d, v in ((d, _value(c, key)) for d, c in contributions.items()) if v is not None}
            if not supplied:
                continue
            base = g.detach().to(torch.float64)
            if g.device not in scratch:
                scratch[g.device] = torch.empty(largest, dtype=torch.float64, device=g.device)
            difference = scratch[g.device][:g.numel()].view(g.shape)
            norms: dict[int, float] = {}
            for value in supplied.values():
                if id(value) not in norms:
                    difference.copy_(value.detach())
                    norms[id(value)] = float(torch.linalg.vector_norm(difference.sub_(base)))
            bound = clip * statistics.median(norms[id(v)] for v in supplied.values())
            for device, value in supplied.items():
                norm = norms[id(value)]
                if norm > bound:
                    if id(value) not in replaced:
                        update = value.detach().to(base.device, torch.float64) - base
                        replaced[id(value)] = (base + update * (bound / norm)).to(value.dtype)
                    clipped.setdefault(device, []).append(key)
    if not replaced:
        return dict(contributions), {}

    def swap(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: replaced.get(id(v), v) for k, v in state.items()}

    return {d: Contribution(c.weight, swap(c.client_state), None if c.server_state is None else swap(c.server_state),
                            c.key_weights)
            for d, c in contributions.items()}, clipped


def rule_params_error(rule: type[AggregationRule], exc: ValidationError) -> str:
    """What is wrong with ``aggregation.params`` for ``rule``, each problem naming its key as the
    config loader does: ``aggregation.params.clip: must be greater than 0 (got -1)``."""
    return params_error("aggregation.params", rule.Params, exc)


def _value(contribution: Contribution, key: str) -> torch.Tensor | None:
    """What a device supplies for ``key`` in Algorithm 1: its client portion, else its group's copy."""
    if key in contribution.client_state:
        return contribution.client_state[key]
    if contribution.server_state is not None:
        return contribution.server_state.get(key)
    return None


def _candidates(key: str, contributions: Mapping[str, Contribution], distinct: bool) -> list[tuple[torch.Tensor, float]]:
    """(value, weight) per device supplying ``key``; with ``distinct``, one per tensor, the
    weights of the devices sharing it summed."""
    out: dict[int | str, list[Any]] = {}  # [value, summed weight] per tensor id or device
    for device, contribution in contributions.items():
        value = _value(contribution, key)
        if value is None:
            continue
        slot = id(value) if distinct else device
        if slot in out:
            out[slot][1] += float(contribution.weight)
        else:
            out[slot] = [value, float(contribution.weight)]
    return [(v, w) for v, w in out.values()]
