"""Member-level defences of a group's server copy: plug-ins of the Main Server's group trainer.

In S2FL a group's members train one shared server-side copy on their concatenated activations and
labels. The Fed Server's aggregation rule sees only the group copies, one per group, so it cannot
take one member's influence out: a member that sends scaled activations, flipped labels or a
backdoor's triggered samples moves the copy, which its honest group mates then carry into
aggregation. These defences act inside the group step, on each member's own part of it:

* ``standardise``: at each block where members join the group's batch, a member whose activations'
  root mean square is more than ``ratio`` times the median there is scaled down to it. The median
  is over the round's members at that block, every group's on this Main Server (the last
  ``window`` values seen there, with the step's own): a group's own median says nothing where
  harmful members are half of a small group. It needs at least ``min_members`` values;
* ``clip``: each member's own gradient of the copy is scaled down to at most ``multiple`` times
  the median member's gradient norm, so no member moves the copy further than a typical one;
* ``median`` / ``trimmed_mean``: the copy steps on the coordinate-wise median (or trimmed mean)
  of the members' own gradients instead of their weighted sum, so a minority of the group cannot
  steer it;
* ``member_updates``: each member's own part of the copy's update goes to the Fed Server, whose
  aggregation rule then compares members across the round instead of a few group copies
  (:class:`MemberUpdates`).

All but ``standardise`` need each member's own gradient of the copy (``per_member_gradients``): the step
then takes one backward pass per member instead of one for the group. A group loss weighs each
member's mean loss (:meth:`shared.algorithms.group_loss.GroupLoss.member_weights`), and the
combined gradient keeps its scale: a centre of the members' own gradients times the sum of their
weights, which for the weighted mean is exactly the plain step.

A run names any of them, in order, in ``grouping.member_defences`` with their parameters in
``grouping.member_defence_params.<name>``; at most one may replace the mean (``centers``). Adding
one is a :class:`MemberDefence` subclass and one line in ``MEMBER_DEFENCES``
(``shared/algorithms/registry.py``); docs/security.md measures them.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

#: One member's gradient of the copy: a tensor per trainable parameter, in the copy's order.
Gradient = list[torch.Tensor]


class DefenceParams(BaseModel):
    """A defence's parameters (``grouping.member_defence_params.<name>``); none by default."""

    model_config = ConfigDict(extra="forbid")


class MemberDefence:
    """A defence's hooks; the base changes nothing. One instance serves every group of a round,
    from the trainer's worker threads: what it keeps across steps it guards itself."""

    Params: ClassVar[type[DefenceParams]] = DefenceParams
    #: True: the step computes each member's own gradient of the copy for :meth:`adjust` and
    #: :meth:`center` (one backward pass per member).
    per_member_gradients: ClassVar[bool] = False
    #: True: :meth:`center` replaces the members' weighted mean; a run may name one such defence.
    centers: ClassVar[bool] = False
    #: True: the Main Server sends the Fed Server each member's own part of its group's copy
    #: (:class:`MemberUpdates`), which the mean then must combine.
    uploads_members: ClassVar[bool] = False

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = self.Params.model_validate(dict(params or {}))

    def activation_scales(self, rms: Sequence[float], block: int) -> list[float]:
        """What to multiply each member's rows by at ``block`` (its index in the model), where
        members join the batch, given each present member's activation root mean square there
        (1: unchanged)."""
        return [1.0] * len(rms)

    def adjust(self, gradients: list[Gradient]) -> list[Gradient]:
        """Each member's own gradient (of its mean loss), as the step should count it."""
        return gradients

    def center(self, gradients: list[Gradient], weights: Sequence[float]) -> Gradient:
        """One gradient standing for the members' own ones (weighted by their ``weights``, which
        sum to 1): their weighted mean."""
        return weighted_mean(gradients, weights)


def weighted_mean(gradients: list[Gradient], weights: Sequence[float]) -> Gradient:
    """``sum_m w_m g_m`` parameter by parameter (``weights`` sum to 1)."""
    out = [g.mul(weights[0]) for g in gradients[0]]
    for member, w in zip(gradients[1:], weights[1:]):
        for total, g in zip(out, member):
            total.add_(g, alpha=w)
    return out


class StandardiseParams(DefenceParams):
    ratio: float = Field(2.0, ge=1.0, allow_inf_nan=False)
    min_members: int = Field(3, ge=2)
    window: int = Field(64, ge=1, le=100_000)


class Standardise(MemberDefence):
    """``standardise``: scale a member whose activations' RMS is more than ``ratio`` x the median
    at its block down to that. The median is over the present members and the last ``window``
    values the round's steps met at that block before (every group's), once there are at least
    ``min_members`` values: two scaled members of a group of four move their group's median as
    far as themselves, not the round's."""

    Params = StandardiseParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        super().__init__(params)
        self._lock = threading.Lock()
        self._seen: dict[int, deque[float]] = {}

    def activation_scales(self, rms: Sequence[float], block: int) -> list[float]:
        params = self.params
        assert isinstance(params, StandardiseParams)
        with self._lock:
            seen = self._seen.setdefault(block, deque(maxlen=params.window))
            pool = [*seen, *rms]
            seen.extend(rms)
        if len(pool) < params.min_members:
            return [1.0] * len(rms)
        cap = params.ratio * _median(pool)
        return [cap / r if r > cap > 0 else 1.0 for r in rms]


class ClipParams(DefenceParams):
    multiple: float = Field(1.0, gt=0, allow_inf_nan=False)


class ClipMembers(MemberDefence):
    """``clip``: each member's own gradient at most ``multiple`` x the median member's norm."""

    Params = ClipParams
    per_member_gradients = True

    def adjust(self, gradients: list[Gradient]) -> list[Gradient]:
        params = self.params
        assert isinstance(params, ClipParams)
        norms = [gradient_norm(g) for g in gradients]
        bound = params.multiple * _median(norms)
        return [[t * (bound / n) for t in g] if n > bound else g for g, n in zip(gradients, norms)]


class MedianOfMembers(MemberDefence):
    """``median``: the coordinate-wise median of the members' own gradients (for an even count,
    the mean of the two middle values), each member counting once whatever its data."""

    per_member_gradients = True
    centers = True

    def center(self, gradients: list[Gradient], weights: Sequence[float]) -> Gradient:
        cut = (len(gradients) - 1) // 2   # the one middle value, or the two
        return [_trimmed(torch.stack(parts), cut) for parts in zip(*gradients)]


class TrimmedMeanParams(DefenceParams):
    trim: float = Field(0.25, ge=0.0, lt=0.5)


class TrimmedMeanOfMembers(MemberDefence):
    """``trimmed_mean``: per coordinate, the mean of the members' own gradients less the
    ``floor(trim x members)`` largest and smallest (at least one each way where there are three
    or more members: with fewer there is nothing to trim), each member counting once."""

    Params = TrimmedMeanParams
    per_member_gradients = True
    centers = True

    def center(self, gradients: list[Gradient], weights: Sequence[float]) -> Gradient:
        params = self.params
        assert isinstance(params, TrimmedMeanParams)
        n = len(gradients)
        cut = max(math.floor(params.trim * n), 1 if n >= 3 else 0)
        return [_trimmed(torch.stack(parts), cut) for parts in zip(*gradients)]


class MemberUpdates(MemberDefence):
    """``member_updates``: each member's own part of the copy's round goes to the Fed Server, whose
    aggregation rule then sees members, not groups.

    The copy trains as before (the members' own gradients summed with their weights); the trainer
    keeps, for each member, the update its contributions alone would have made (``-lr`` times its
    weighted gradient, as the step scaled it), and the Main Server uploads beside the group's copy
    ``W`` one state per member, ``W + D_m / s_m - D`` (``D_m`` its update, ``D`` every contributor's,
    ``s_m`` its share of the data of the members that pass each block). Their weighted mean is the
    group's copy, so the mean rule aggregates exactly as from the copy; a robust rule
    (``trimmed_mean``, ``median``, ...) now compares every device of the round, where it compared a
    handful of group copies, each mixing its members (docs/security.md). A member dropped during
    the round has its part taken out. Costs one server portion per member on the Main Server to
    Fed Server link."""

    per_member_gradients = True
    uploads_members = True


def _trimmed(stacked: torch.Tensor, cut: int) -> torch.Tensor:
    """Along the first dimension, the mean of the values left once the ``cut`` smallest and
    ``cut`` largest are dropped (``cut`` 0: the plain mean)."""
    n = stacked.shape[0]
    ordered = stacked.sort(dim=0).values if cut else stacked
    return ordered[cut:n - cut].mean(dim=0)


def gradient_norm(gradient: Gradient) -> float:
    """The L2 norm of a whole gradient (every parameter's entries together)."""
    return math.sqrt(sum(float(t.pow(2).sum()) for t in gradient))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2
