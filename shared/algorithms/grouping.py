"""How the Main Server splits a round's devices into groups: the grouping plug-in.

One copy of the server portion is trained per group. :class:`Grouping` is the interface, a round
plan names one of ``GROUPINGS`` (``shared/algorithms/registry.py``). This module holds the paper's
two (:class:`BalancedGrouping` for S2FL, over Eq. 2 in ``label_balance.py``; :class:`SingletonGrouping`
for SFL); adding a policy is one module with a :class:`Grouping` subclass and one registry line
(``random_grouping.py`` is one; docs/extending.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from shared.algorithms.label_balance import balanced_groups, group_sizes

if TYPE_CHECKING:
    from shared.schemas import Participant

__all__ = ["GroupCandidate", "group_candidate", "candidates_from_counts", "grouping_rng", "form_round_groups",
           "consecutive_groups", "Grouping", "BalancedGrouping", "SingletonGrouping"]


@dataclass(frozen=True)
class GroupCandidate:
    """What a grouping knows of one of the round's devices: everything the Fed Server knows of it
    (:func:`group_candidate` builds it from the round plan's participant entry)."""

    label_counts: np.ndarray   # int64, samples per class (the device's join, or its registration); empty: withheld
    split_point: int           # blocks on the device this round
    num_samples: int           # samples it trains on (the round plan's participant count)
    #: The kind the device registered (``high``, ``mid``, ``low`` for an emulated one, ``native``
    #: for a real one); None where not known (a benchmark's replay).
    kind: str | None = None
    #: The Fed Server's client time table row of the device: split point -> running average of
    #: its measured round time there (seconds). Empty before its first measured round.
    round_times: Mapping[int, float] = field(default_factory=dict)
    #: The device's link rate (bytes/s) as measured from its rounds; None before its first.
    link_rate: float | None = None

    @classmethod
    def of(cls, label_counts: Sequence[int], split_point: int, num_samples: int) -> "GroupCandidate":
        """A candidate known by its label counts, split and samples alone (tests, benchmarks)."""
        return cls(np.asarray(label_counts, dtype=np.int64), int(split_point), int(num_samples))


def group_candidate(participant: "Participant", label_counts: Sequence[int]) -> GroupCandidate:
    """What a grouping knows of one device: its round plan entry (``participant``, which the Fed
    Server fills with all it knows of the device: split, samples, kind, time table row, measured
    link rate) and its ``label_counts``.

    The one place a candidate is built, for both servers: the Main Server from each join (the
    counts the device joined with), the Fed Server from the counts the device registered with
    (several replicas), so a grouping sees the same device the same way on either, and a grouping
    that needs more than the counts reads it here, with no change to either server.
    """
    return GroupCandidate(np.asarray(label_counts, dtype=np.int64), participant.split_point, participant.num_samples,
                          participant.kind, dict(participant.round_times), participant.link_rate)


def candidates_from_counts(counts: Mapping[str, Sequence[int]], split_point: int = 1) -> dict[str, GroupCandidate]:
    """Members known by their label counts alone (every one at ``split_point``, training on all
    its counted samples): what a benchmark that replays the Main Server's grouping has."""
    return {d: GroupCandidate.of(c, split_point, int(np.sum(c))) for d, c in counts.items()}


def grouping_rng(seed: int, round_index: int) -> np.random.Generator:
    """The generator a round's grouping draws from: the run's seed and the logical round, so a
    replay (or a benchmark recomputing the groups) regroups identically, rounds differ, and a
    retried attempt or a resumed run draws what the round would have drawn."""
    return np.random.default_rng([seed, round_index])


def form_round_groups(grouping: "Grouping", members: Mapping[str, GroupCandidate], group_size: int, seed: int,
                      round_index: int) -> list[list[str]]:
    """A round's groups: ``grouping`` over ``members`` (in device-id order) with the round's
    :func:`grouping_rng`.

    The one place groups are formed: by the Main Server from the joins (one replica, as in the
    paper) and by the Fed Server from the counts sent at registration (several replicas, which
    need the groups before tasks go out), so the same devices and counts give the same groups.
    """
    return grouping.form({d: members[d] for d in sorted(members)}, group_size, grouping_rng(seed, round_index))


def consecutive_groups(ordered: Sequence[str], group_size: int) -> list[list[str]]:
    """``ordered`` cut into consecutive groups of the sizes the balanced grouping gives as many
    devices (``label_balance.group_sizes``: as many groups, sizes differing by at most one, larger
    first): for a grouping that decides only the order."""
    groups: list[list[str]] = []
    start = 0
    for size in group_sizes(len(ordered), group_size):
        groups.append(list(ordered[start:start + size]))
        start += size
    return groups


class Grouping:
    """How the Main Server splits a round's joined devices into groups (one server copy each).

    ``members`` maps each of the round's devices to what is known of it (:class:`GroupCandidate`:
    label counts, split point, sample count, kind, time table row, measured link rate), in
    device-id order; ``group_size`` is the configured
    ``grouping.group_size``; ``rng`` is :func:`grouping_rng` of the round (deterministic policies
    ignore it). Returns the groups' member lists, every device in exactly one group, ``[]`` for no
    devices. The order of the groups is their ``group_id``.
    """

    #: Whether :meth:`form` reads the members' label counts: a run whose devices withhold them
    #: (``split_privacy.label_counts: withheld``) may only name a grouping that does not.
    uses_label_counts: ClassVar[bool] = True

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        raise NotImplementedError


class BalancedGrouping(Grouping):
    """S2FL's data-balance grouping: :func:`balanced_groups` (Eq. 2)."""

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        return balanced_groups({d: m.label_counts for d, m in members.items()}, group_size)


class SingletonGrouping(Grouping):
    """One group per device, in device-id order (SFL and the "no data balance" ablations)."""

    uses_label_counts = False

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        return [[d] for d in sorted(members)]
