"""Grouping by split point: devices cut at the same block share a server-side copy.

Not in the paper. S2FL's groups mix devices at different split points (the sliding split gives
slow devices fewer layers), so a group's server copy starts at its smallest split point and the
members cut later bring activations of a deeper block. Grouping by split point keeps every
group's members on one cut: each copy trains exactly the blocks none of its members holds, and a
group step stacks activations of one shape. Within one split point the groups are balanced by
Eq. 2 with the configured ``grouping.group_size`` (``label_balance.balanced_groups``), so label
balance is kept as far as the split points allow; a split point held by fewer devices than a
group gives a smaller group. Registered as ``split_point`` in ``GROUPINGS``
(``grouping.method: split_point``); the worked example of docs/extending.md.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.algorithms.grouping import GroupCandidate, Grouping
from shared.algorithms.label_balance import balanced_groups


class SplitPointGrouping(Grouping):
    """The devices of each split point, grouped by Eq. 2 among themselves; smaller split points first."""

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        by_split: dict[int, dict[str, np.ndarray]] = {}
        for device, member in sorted(members.items()):
            by_split.setdefault(member.split_point, {})[device] = member.label_counts
        return [group for split in sorted(by_split) for group in balanced_groups(by_split[split], group_size)]
