"""Random grouping: members drawn at random, with the group count and sizes of the balanced grouping.

Not in the paper. It isolates what Eq. 2 balancing adds over merely training several devices on
one server copy: the groups are as many and as large as :class:`BalancedGrouping` forms, only
their membership ignores the label counts. Registered as ``random`` in ``GROUPINGS``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.algorithms.grouping import GroupCandidate, Grouping, consecutive_groups


class RandomGrouping(Grouping):
    """A uniformly random permutation of the device ids, cut into ``group_sizes`` consecutive groups."""

    uses_label_counts = False

    def form(self, members: Mapping[str, GroupCandidate], group_size: int, rng: np.random.Generator) -> list[list[str]]:
        # Sorted before shuffling, so the groups depend only on the id set and the generator's seed.
        ids = sorted(members)
        return consecutive_groups([ids[i] for i in rng.permutation(len(ids))], group_size)
