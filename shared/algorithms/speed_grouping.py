"""Grouping by cut and speed: devices at the same split point with similar round times share a
server-side copy.

Not in the paper. A group's server copy takes a step once every member's activations of that step
have arrived (the Main Server's per-step barrier), so a group moves at the pace of its slowest
member, and its faster members wait at every step. S2FL's sliding split evens out the devices'
round times around the median, but not exactly; within one cut, this grouping puts the devices
of similar time together, so a group's members reach its barriers together. Like
:class:`~shared.algorithms.split_point_grouping.SplitPointGrouping`, each group keeps to one cut.

The time it goes by is the Fed Server's client time table (``GroupCandidate.round_times``): the
device's running average at its split point this round, or, not measured there yet (S2FL's
warm-up measures one split point per round), at the nearest split point it was measured at (the
smaller one on a tie): within a round every device of the warm-up has the same history, so their
times are compared at the same split. Devices never measured come last, in id order.

Choices of its own: within a cut, the devices ordered by that time (ties by id) are cut into
consecutive groups of the sizes the balanced grouping gives as many devices
(``consecutive_groups``), so the groups are as many and as large as Eq. 2's; label counts
are not used (Eq. 2's balance is given up for speed). Registered as ``speed`` in ``GROUPINGS``
(``grouping.method: speed``); the second worked example of docs/extending.md.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.algorithms.grouping import GroupCandidate, Grouping, consecutive_groups


class SpeedGrouping(Grouping):
    """The devices of each split point, ordered by round time and cut into consecutive groups; smaller split points first."""

    uses_label_counts = False

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        by_split: dict[int, list[str]] = {}
        for device, member in sorted(members.items()):
            by_split.setdefault(member.split_point, []).append(device)
        groups: list[list[str]] = []
        for split in sorted(by_split):
            times = {d: self.time_of(members[d]) for d in by_split[split]}
            ordered = sorted(by_split[split], key=lambda d: (times[d] is None, times[d] or 0.0, d))
            groups += consecutive_groups(ordered, group_size)
        return groups

    @staticmethod
    def time_of(member: GroupCandidate) -> float | None:
        """The round time a member is ordered by: its time table entry at its split point, else at
        the nearest split point measured (the smaller on a tie); None if it was never measured."""
        if not member.round_times:
            return None
        nearest = min(member.round_times, key=lambda split: (abs(split - member.split_point), split))
        return member.round_times[nearest]
