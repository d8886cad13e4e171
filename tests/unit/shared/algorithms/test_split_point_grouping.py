"""Grouping by split point (shared/algorithms/split_point_grouping.py)."""
from __future__ import annotations

import numpy as np

from shared.algorithms.grouping import GroupCandidate, form_round_groups
from shared.algorithms.label_balance import balanced_groups
from shared.algorithms.registry import build_grouping
from shared.algorithms.split_point_grouping import SplitPointGrouping


def _candidates(splits: dict[str, int]) -> dict[str, GroupCandidate]:
    # Skewed label counts, so the balanced grouping within a split point has something to balance.
    return {d: GroupCandidate.of([i + 1, 0, 9 - i], split, 10) for i, (d, split) in enumerate(sorted(splits.items()))}


def test_members_share_their_split_point_and_are_balanced_among_themselves():
    splits = {"a": 2, "b": 1, "c": 2, "d": 1, "e": 1, "f": 2, "g": 3, "h": 1}
    candidates = _candidates(splits)
    groups = SplitPointGrouping().form(candidates, 2, np.random.default_rng(0))
    assert sorted(d for g in groups for d in g) == sorted(splits)               # each device once
    assert all(len({splits[d] for d in g}) == 1 for g in groups)                 # one cut per group
    assert [splits[g[0]] for g in groups] == sorted(splits[g[0]] for g in groups)  # smaller cuts first
    for split in (1, 2, 3):
        mine = {d: c.label_counts for d, c in candidates.items() if c.split_point == split}
        assert [g for g in groups if splits[g[0]] == split] == balanced_groups(mine, 2)


def test_one_split_point_is_the_balanced_grouping_and_none_gives_no_groups():
    candidates = _candidates({f"d{i}": 1 for i in range(7)})
    assert SplitPointGrouping().form(candidates, 3, np.random.default_rng(0)) == \
        balanced_groups({d: c.label_counts for d, c in candidates.items()}, 3)
    assert SplitPointGrouping().form({}, 3, np.random.default_rng(0)) == []


def test_it_is_registered_as_split_point():
    candidates = _candidates({"a": 1, "b": 2})
    assert form_round_groups(build_grouping("split_point"), candidates, 4, 0, 1) == [["a"], ["b"]]
