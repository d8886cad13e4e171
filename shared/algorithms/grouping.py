"""How the Main Server splits a round's devices into groups: the grouping plug-in.

One copy of the server portion is trained per group. :class:`Grouping` is the interface, a round
plan names one of ``GROUPINGS`` (``shared/algorithms/registry.py``). This module holds the paper's
two (:class:`BalancedGrouping` for S2FL, over Eq. 2 in ``label_balance.py``; :class:`SingletonGrouping`
for SFL); adding a policy is one module with a :class:`Grouping` subclass and one registry line
(``random_grouping.py`` is one; docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from shared.algorithms.label_balance import balanced_groups

__all__ = ["grouping_rng", "form_round_groups", "Grouping", "BalancedGrouping", "SingletonGrouping"]


def grouping_rng(seed: int, round_id: int) -> np.random.Generator:
    """The generator a round's grouping draws from: the run's seed and the round id, so a replay
    (or a benchmark recomputing the groups) regroups identically and rounds differ."""
    return np.random.default_rng([seed, round_id])


def form_round_groups(grouping: "Grouping", counts: Mapping[str, Sequence[int]], group_size: int, seed: int,
                      round_id: int) -> list[list[str]]:
    """A round's groups: ``grouping`` over ``counts`` (in device-id order, as int64 arrays) with the
    round's :func:`grouping_rng`.

    The one place groups are formed: by the Main Server from the joins (one replica, as in the
    paper) and by the Fed Server from the counts sent at registration (several replicas, which
    need the groups before tasks go out), so the same devices and counts give the same groups.
    """
    arrays = {d: np.asarray(counts[d], dtype=np.int64) for d in sorted(counts)}
    return grouping.form(arrays, group_size, grouping_rng(seed, round_id))


class Grouping:
    """How the Main Server splits a round's joined devices into groups (one server copy each).

    ``counts`` maps each joined device to its label counts, in device-id order; ``group_size``
    is the configured ``grouping.group_size``; ``rng`` is :func:`grouping_rng` of the round
    (deterministic policies ignore it). Returns the groups'
    member lists, every device in exactly one group, ``[]`` for no devices. The order of the
    groups is their ``group_id``.
    """

    def form(self, counts: Mapping[str, np.ndarray], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        raise NotImplementedError


class BalancedGrouping(Grouping):
    """S2FL's data-balance grouping: :func:`balanced_groups` (Eq. 2)."""

    def form(self, counts: Mapping[str, np.ndarray], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        return balanced_groups(dict(counts), group_size)


class SingletonGrouping(Grouping):
    """One group per device, in device-id order (SFL and the "no data balance" ablations)."""

    def form(self, counts: Mapping[str, np.ndarray], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        return [[d] for d in sorted(counts)]
