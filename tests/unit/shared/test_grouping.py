"""Tests for the data-balance grouping (paper Eq. 2) and the paper's two grouping plug-ins."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared.algorithms.grouping import BalancedGrouping, SingletonGrouping, grouping_rng, candidates_from_counts
from shared.algorithms.label_balance import balanced_groups, group_sizes, label_distance, num_groups_for, total_distance
from shared.algorithms.random_grouping import RandomGrouping


def dirichlet_counts(num_devices: int, n_classes: int, alpha: float, per_class: int, seed: int) -> dict[str, np.ndarray]:
    """Label counts of a Dirichlet(alpha) partition: for each class, split its samples over devices."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((num_devices, n_classes), dtype=np.int64)
    for c in range(n_classes):
        props = rng.dirichlet(alpha * np.ones(num_devices))
        counts[:, c] = rng.multinomial(per_class, props)
    return {f"dev{i:02d}": counts[i] for i in range(num_devices)}


def check_partition(groups: list[list[str]], ids: list[str], group_size: int) -> None:
    flat = [m for g in groups for m in g]
    assert sorted(flat) == sorted(ids)  # every device in exactly one group
    assert len(flat) == len(set(flat))
    assert len(groups) == num_groups_for(len(ids), group_size)
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1


def test_label_distance_hand_computed():
    # Two devices [3,1] and [1,3]: pooled [4,4] / 8 = [0.5,0.5]; uniform 1/2 -> distance 0.
    assert label_distance(np.array([[3, 1], [1, 3]])) == pytest.approx(0.0, abs=1e-15)
    # One device [3,1]: [0.75,0.25] -> sqrt((0.75-0.5)^2 + (0.25-0.5)^2) = sqrt(0.125) ~ 0.353553.
    assert label_distance(np.array([[3, 1]])) == pytest.approx(math.sqrt(0.125))
    assert label_distance(np.array([3, 1])) == pytest.approx(math.sqrt(0.125))  # 1-D = one member
    # Three classes, devices [2,0,0] and [0,1,1]: pooled [2,1,1]/4 = [0.5,0.25,0.25];
    # minus 1/3 -> [1/6,-1/12,-1/12]; squares 1/36 + 1/144 + 1/144 = 6/144 -> sqrt(1/24).
    assert label_distance(np.array([[2, 0, 0], [0, 1, 1]])) == pytest.approx(math.sqrt(1 / 24))
    # Single class out of n=4: [1,0,0,0] -> sqrt(0.75^2 + 3*0.25^2) = sqrt(0.75).
    assert label_distance(np.array([[5, 0, 0, 0]])) == pytest.approx(math.sqrt(0.75))


def test_label_distance_empty_and_invalid():
    assert label_distance(np.zeros((0, 10))) == 0.0  # empty group -> 0 (documented)
    assert label_distance(np.zeros((2, 10))) == 0.0  # no samples -> 0 (documented)
    with pytest.raises(ValueError):
        label_distance(np.array([[1, -1]]))


def test_total_distance_sums_groups():
    counts = {"a": np.array([3, 1]), "b": np.array([1, 3]), "c": np.array([3, 1])}
    assert total_distance([["a", "b"], ["c"]], counts) == pytest.approx(math.sqrt(0.125))
    assert total_distance([["a", "c"], ["b"]], counts) == pytest.approx(2 * math.sqrt(0.125))


def test_num_groups_for():
    assert num_groups_for(10, 5) == 2
    assert num_groups_for(11, 5) == 3
    assert num_groups_for(3, 10) == 1
    assert num_groups_for(0, 4) == 1
    with pytest.raises(ValueError):
        num_groups_for(4, 0)


@pytest.mark.parametrize("n_classes", [2, 3, 5, 10])
def test_perfect_grouping_reaches_zero(n_classes):
    # n single-class devices per copy, 2 copies, groups of n: perfect grouping = one of each class.
    counts = {}
    for copy in range(2):
        for c in range(n_classes):
            v = np.zeros(n_classes, dtype=np.int64)
            v[c] = 50
            counts[f"c{c}_{copy}"] = v
    groups = balanced_groups(counts, group_size=n_classes)
    check_partition(groups, list(counts), n_classes)
    assert total_distance(groups, counts) == pytest.approx(0.0, abs=1e-12)


def test_perfect_grouping_three_groups_unequal_sizes():
    # 3 classes x 3 copies with unequal sample counts per class copy still admits Dist = 0 when
    # each group holds one device per class with equal counts inside the group.
    counts = {}
    for copy, size in enumerate([10, 20, 40]):
        for c in range(3):
            v = np.zeros(3, dtype=np.int64)
            v[c] = size
            counts[f"d{c}{copy}"] = v
    groups = balanced_groups(counts, group_size=3)
    check_partition(groups, list(counts), 3)
    assert total_distance(groups, counts) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("alpha", [0.1, 0.5])
@pytest.mark.parametrize("num_devices", [10, 20])
def test_balanced_beats_random_on_dirichlet(alpha, num_devices):
    group_size = 5
    for data_seed in range(3):
        counts = dirichlet_counts(num_devices, 10, alpha, per_class=100 * num_devices // 10, seed=data_seed)
        ids = list(counts)
        groups = balanced_groups(counts, group_size)
        check_partition(groups, ids, group_size)
        ours = total_distance(groups, counts)
        rand = [total_distance(RandomGrouping().form(candidates_from_counts(counts), group_size, np.random.default_rng(s)),
                               counts)
                for s in range(20)]
        assert ours < float(np.mean(rand))
        assert ours <= min(rand) + 1e-12  # in practice it also beats the best of 20 random draws


def test_balanced_groups_deterministic_and_order_independent():
    counts = dirichlet_counts(13, 10, 0.3, per_class=130, seed=7)
    first = balanced_groups(counts, 4)
    check_partition(first, list(counts), 4)
    assert balanced_groups(counts, 4) == first
    reversed_counts = {k: counts[k] for k in reversed(list(counts))}
    assert balanced_groups(reversed_counts, 4) == first
    shuffled = {k: counts[k] for k in np.random.default_rng(1).permutation(list(counts))}
    assert balanced_groups(shuffled, 4) == first


@pytest.mark.parametrize("n,size", [(1, 3), (4, 4), (7, 3), (11, 4), (20, 6)])
def test_group_sizes_differ_by_at_most_one(n, size):
    counts = dirichlet_counts(n, 5, 0.5, per_class=10 * n, seed=n)
    check_partition(balanced_groups(counts, size), list(counts), size)
    sizes = group_sizes(n, size)
    assert sum(sizes) == n and len(sizes) == num_groups_for(n, size) and max(sizes) - min(sizes) <= 1


def test_balanced_groups_edge_cases():
    assert balanced_groups({}, 3) == []
    with pytest.raises(ValueError):
        balanced_groups({"a": np.array([1, 2]), "b": np.array([1, 2, 3])}, 2)
    # group_size 1 -> singletons
    counts = {"a": np.array([1, 0]), "b": np.array([0, 1])}
    assert balanced_groups(counts, 1) == [["a"], ["b"]]


def test_group_sizes_larger_first_and_empty():
    assert group_sizes(7, 3) == [3, 2, 2]
    assert group_sizes(6, 3) == [3, 3]
    assert group_sizes(0, 3) == []


def test_balanced_plug_in_is_balanced_groups():
    counts = dirichlet_counts(11, 10, 0.3, per_class=110, seed=4)
    shuffled = {k: counts[k] for k in reversed(list(counts))}
    # The plug-in ignores its generator: any seed, any dict order gives the function's answer.
    assert BalancedGrouping().form(candidates_from_counts(shuffled), 4, grouping_rng(0, 1)) == balanced_groups(counts, 4)
    assert BalancedGrouping().form(candidates_from_counts(counts), 4, grouping_rng(9, 9)) == balanced_groups(counts, 4)


def test_singleton_plug_in_orders_by_id():
    counts = {"b": np.array([1, 0]), "a": np.array([0, 1]), "c": np.array([2, 2])}
    assert SingletonGrouping().form(candidates_from_counts(counts), 3, grouping_rng(0, 1)) == [["a"], ["b"], ["c"]]
    assert SingletonGrouping().form({}, 3, grouping_rng(0, 1)) == []


def test_grouping_rng_depends_on_seed_and_round():
    draw = lambda seed, round_id: grouping_rng(seed, round_id).permutation(20).tolist()  # noqa: E731
    assert draw(3, 7) == draw(3, 7)
    assert draw(3, 7) != draw(3, 8)
    assert draw(3, 7) != draw(4, 7)


def test_form_round_groups_is_the_plug_in_on_the_rounds_rng():
    from shared.algorithms.grouping import form_round_groups
    counts = {f"d{i}": [i + 1, 0, 9 - i] for i in range(7)}
    arrays = {d: np.asarray(c) for d, c in counts.items()}
    members = candidates_from_counts(counts)
    assert form_round_groups(BalancedGrouping(), members, 3, 1, 4) == balanced_groups(arrays, 3)
    assert form_round_groups(RandomGrouping(), members, 3, 1, 4) == RandomGrouping().form(members, 3, grouping_rng(1, 4))
    shuffled = dict(reversed(list(members.items())))   # insertion order does not matter
    assert form_round_groups(RandomGrouping(), shuffled, 3, 1, 4) == form_round_groups(RandomGrouping(), members, 3, 1, 4)
