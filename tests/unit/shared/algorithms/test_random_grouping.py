"""The random grouping plug-in: balanced-grouping sizes, membership from the seeded generator."""
from __future__ import annotations

import numpy as np
import pytest

from shared.algorithms.grouping import candidates_from_counts
from shared.algorithms.label_balance import group_sizes, num_groups_for
from shared.algorithms.random_grouping import RandomGrouping
from shared.algorithms.registry import GROUPINGS, build_grouping


def _counts(ids: list[str]) -> dict[str, np.ndarray]:
    return {d: np.array([i + 1, 1]) for i, d in enumerate(ids)}


def _form(ids: list[str], size: int, seed: int) -> list[list[str]]:
    return RandomGrouping().form(candidates_from_counts(_counts(ids)), size, np.random.default_rng(seed))


@pytest.mark.parametrize("n,size", [(1, 3), (4, 4), (7, 3), (11, 4), (20, 6)])
def test_partition_with_balanced_sizes(n, size):
    ids = [f"d{i:02d}" for i in range(n)]
    groups = _form(ids, size, seed=3)
    flat = [m for g in groups for m in g]
    assert sorted(flat) == ids and len(flat) == len(set(flat))  # every device in exactly one group
    assert len(groups) == num_groups_for(n, size)
    assert [len(g) for g in groups] == group_sizes(n, size)


def test_seeded_and_independent_of_dict_order():
    ids = [f"d{i}" for i in range(10)]
    first = _form(ids, 3, seed=5)
    assert _form(list(reversed(ids)), 3, seed=5) == first
    assert any(_form(ids, 3, seed=s) != first for s in range(6, 10))


def test_membership_is_not_id_order():
    # Over a few seeds some group is not a run of consecutive ids: the draw does shuffle.
    ids = [f"d{i}" for i in range(12)]
    consecutive = [ids[i:i + 3] for i in range(0, 12, 3)]
    assert any(_form(ids, 3, seed=s) != consecutive for s in range(5))


def test_no_devices_no_groups():
    assert RandomGrouping().form({}, 3, np.random.default_rng(0)) == []


def test_registered_as_random():
    assert GROUPINGS["random"] is RandomGrouping
    assert isinstance(build_grouping("random"), RandomGrouping)
    with pytest.raises(ValueError, match="unknown grouping 'nope'.*random"):
        build_grouping("nope")
