"""Eq. 2 and the grouping search pinned to exact answers: the groups of fixed inputs, each chosen
because a search that skips a step (the moves, the local search, its later steps) or a wrong
Eq. 2 term groups it differently, and with a higher summed distance."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared.algorithms.label_balance import (
    _pooled_distance, balanced_groups, group_sizes, label_distance, num_groups_for, total_distance,
)


def arrays(counts: dict[str, list[int]]) -> dict[str, np.ndarray]:
    return {d: np.asarray(c) for d, c in counts.items()}


def test_pooled_distance_is_eq2_per_row_and_zero_for_no_samples():
    pooled = np.array([[3.0, 1.0], [0.0, 0.0], [2.0, 2.0], [0.0, 5.0]])
    # [3,1]: sqrt(0.25^2 + 0.25^2) = sqrt(0.125); [0,0]: 0 (no samples); [2,2]: 0; [0,5]: sqrt(0.5).
    np.testing.assert_allclose(_pooled_distance(pooled), [math.sqrt(0.125), 0.0, 0.0, math.sqrt(0.5)], atol=1e-15)
    # Leading axes broadcast: a [2, 2, 3] block gives a [2, 2] answer, each cell its own Eq. 2.
    block = np.array([[[4, 0, 0], [1, 1, 1]], [[0, 0, 0], [2, 1, 1]]], dtype=float)
    np.testing.assert_allclose(_pooled_distance(block), [[math.sqrt(6 / 9), 0.0], [0.0, math.sqrt(1 / 24)]],
                               atol=1e-15)


def test_label_distance_rejects_bad_shapes_and_values():
    with pytest.raises(ValueError, match=r"counts must be \[members, n_classes\], got shape \(1, 1, 2\)"):
        label_distance(np.ones((1, 1, 2)))
    with pytest.raises(ValueError, match="finite and non-negative"):
        label_distance(np.array([[1.0, math.nan]]))
    assert label_distance(np.zeros((3, 0))) == 0.0   # no classes: nothing to be unbalanced


def test_counts_are_checked_per_device():
    with pytest.raises(ValueError, match="device 'b' has 3 classes, expected 2"):
        balanced_groups(arrays({"a": [1, 2], "b": [1, 2, 3]}), 2)
    with pytest.raises(ValueError, match="device 'b' has 2 classes, expected 3"):
        balanced_groups(arrays({"a": [1, 2, 3], "b": [1, 2]}), 2)
    with pytest.raises(ValueError, match="device 'b': label counts must be finite and non-negative"):
        balanced_groups(arrays({"a": [1, 2], "b": [1, -2]}), 2)
    with pytest.raises(ValueError, match="device 'a': label counts must be finite and non-negative"):
        total_distance([["a"]], {"a": np.array([math.inf, 1.0])})


def test_group_count_and_sizes():
    assert [num_groups_for(n, 3) for n in (0, 1, 3, 4, 6, 7)] == [1, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="group_size must be >= 1, got 0"):
        num_groups_for(4, 0)
    with pytest.raises(ValueError, match="num_devices must be >= 0, got -1"):
        num_groups_for(-1, 2)
    assert group_sizes(5, 2) == [2, 2, 1]
    assert group_sizes(8, 3) == [3, 3, 2]
    assert group_sizes(1, 4) == [1]


def test_greedy_fills_each_group_with_its_best_partner():
    # All totals 10, so the order is by id: a and b open the groups; c ([9,1]) lowers b's distance
    # most (to [9,11], 0.0707) and joins b; d fills a ([11,9]). The local search then swaps d and b
    # (or a and c): {a,b} and {c,d} are both exactly uniform.
    counts = arrays({"a": [10, 0], "b": [0, 10], "c": [9, 1], "d": [1, 9]})
    assert balanced_groups(counts, 2) == [["a", "b"], ["c", "d"]]
    assert total_distance([["a", "b"], ["c", "d"]], counts) == 0.0


def test_largest_devices_seed_the_groups():
    # e and f (20 samples each) open the two groups, so the two identical large devices never
    # share one; every small device then balances one of them.
    counts = arrays({"a": [0, 2], "b": [2, 0], "e": [20, 0], "f": [20, 0], "c": [0, 18], "d": [0, 18]})
    assert balanced_groups(counts, 3) == [["a", "c", "e"], ["b", "d", "f"]]


# (counts, group size, the groups, the groups a weaker search returns, which one)
PINNED = [
    ({"A": [6, 6, 8], "B": [3, 4, 5], "C": [5, 9, 1], "D": [4, 2, 8], "E": [5, 0, 1]}, 3,
     [["A", "B", "E"], ["C", "D"]], [["A", "B"], ["C", "D", "E"]]),                    # without the moves
    ({"A": [3, 8], "B": [4, 7], "C": [3, 2], "D": [7, 8], "E": [0, 0]}, 2,
     [["A", "D"], ["B", "C"], ["E"]], [["A", "C"], ["B", "D"], ["E"]]),                # after one search step
    ({"A": [3, 8, 5], "B": [0, 7, 7], "C": [8, 1, 0], "D": [8, 0, 5], "E": [0, 2, 4], "F": [4, 4, 0]}, 2,
     [["A", "D"], ["B", "C"], ["E", "F"]], [["A", "E"], ["B", "C"], ["D", "F"]]),      # greedy alone
    ({"A": [9, 2], "B": [7, 1], "C": [3, 9], "D": [4, 5], "E": [2, 1], "F": [4, 6]}, 3,
     [["A", "D", "F"], ["B", "C", "E"]], [["A", "E", "F"], ["B", "C", "D"]]),          # swaps within a group tried
    ({"A": [0, 6], "B": [2, 2], "C": [6, 7], "D": [8, 2], "E": [8, 8], "F": [3, 0], "G": [7, 8]}, 3,
     [["A", "D"], ["B", "E"], ["C", "F", "G"]], [["A", "B", "D"], ["C", "E"], ["F", "G"]]),  # gain as a ratio
    ({"A": [9, 3], "B": [2, 0], "C": [5, 1], "D": [5, 4], "E": [9, 2], "F": [7, 1], "G": [5, 2]}, 3,
     [["A", "E", "F"], ["B", "D"], ["C", "G"]], [["A", "C"], ["B", "D"], ["E", "F", "G"]]),  # a move's gain as a ratio
]


@pytest.mark.parametrize("counts, size, groups, weaker", PINNED)
def test_the_local_search_reaches_the_pinned_groups(counts, size, groups, weaker):
    arr = arrays(counts)
    assert balanced_groups(arr, size) == groups
    assert total_distance(groups, arr) < total_distance(weaker, arr) - 1e-6


def test_greedy_measures_a_join_by_the_change_of_distance():
    # A ([7,7]) opens a group at distance 0: a join is judged by new - old distance (a ratio to 0
    # would divide by zero).
    counts = arrays({"A": [7, 7], "B": [8, 1], "C": [5, 8], "D": [3, 1], "E": [4, 0], "F": [2, 8], "G": [6, 8]})
    assert balanced_groups(counts, 3) == [["A", "C", "E"], ["B", "F"], ["D", "G"]]


def test_a_zero_d_count_is_refused():
    with pytest.raises(ValueError, match=r"counts must be \[members, n_classes\], got shape \(\)"):
        label_distance(np.float64(3.0))


def test_eq2_term_decides_the_groups():
    # Eq. 2's per-class term is (share - 1/n); with (share * 1/n) the search prefers
    # {A,C,E} / {B,D,F}, whose true summed distance is higher.
    counts = arrays({"A": [3, 6, 9], "B": [6, 8, 6], "C": [7, 3, 8], "D": [1, 5, 7], "E": [8, 5, 3], "F": [3, 4, 4]})
    assert balanced_groups(counts, 3) == [["A", "E", "F"], ["B", "C", "D"]]
    assert total_distance([["A", "E", "F"], ["B", "C", "D"]], counts) < total_distance(
        [["A", "C", "E"], ["B", "D", "F"]], counts)


def test_a_group_of_one_sample_is_as_far_from_uniform_as_its_class_makes_it():
    # One sample of three classes: shares (1, 0, 0), Eq. 2 = sqrt((2/3)^2 + 2 (1/3)^2) = sqrt(6/9);
    # a total of one is a distribution like any other, not "no samples".
    one = math.sqrt(6 / 9)
    assert label_distance(np.array([0, 1, 0])) == pytest.approx(one, abs=1e-15)
    assert label_distance(np.array([[0, 0, 1], [0, 0, 0]])) == pytest.approx(one, abs=1e-15)
    np.testing.assert_allclose(_pooled_distance(np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.0]])),
                               [one, 0.0, math.sqrt(1 / 6)], atol=1e-15)


def test_devices_of_one_sample_each_are_grouped_one_class_each():
    # Six devices of one sample each, two per class, groups of three: the only groups at distance
    # zero take one device of each class. The local search's moves and swaps price one-sample
    # groups (a group of two less one member), which a rule that took them for empty would not.
    counts = arrays({"a0": [1, 0, 0], "a1": [1, 0, 0], "b0": [0, 1, 0], "b1": [0, 1, 0], "c0": [0, 0, 1],
                     "c1": [0, 0, 1]})
    groups = balanced_groups(counts, 3)
    assert total_distance(groups, counts) == pytest.approx(0.0, abs=1e-12)
    assert [sorted(d[0] for d in g) for g in groups] == [["a", "b", "c"], ["a", "b", "c"]], groups
    # Five one-sample devices in groups of at most two: three groups of sizes 2, 2, 1; the lone
    # device is the one whose class is left over.
    five = arrays({"a0": [1, 0], "a1": [1, 0], "a2": [1, 0], "b0": [0, 1], "b1": [0, 1]})
    groups = balanced_groups(five, 2)
    assert sorted(len(g) for g in groups) == [1, 2, 2]
    assert all(len(g) == 1 or {d[0] for d in g} == {"a", "b"} for g in groups), groups
    assert total_distance(groups, five) == pytest.approx(0.5 ** 0.5, abs=1e-12)   # the lone one: sqrt(2 (1/2)^2)
