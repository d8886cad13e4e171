"""Grouping by cut and speed (shared/algorithms/speed_grouping.py)."""
from __future__ import annotations

import numpy as np
import pytest

from shared.algorithms.grouping import GroupCandidate, form_round_groups
from shared.algorithms.label_balance import group_sizes
from shared.algorithms.registry import build_grouping
from shared.algorithms.speed_grouping import SpeedGrouping

RNG = np.random.default_rng(0)


def _member(split: int, times: dict[int, float] | None = None) -> GroupCandidate:
    return GroupCandidate(np.asarray([5, 5], dtype=np.int64), split, 10, "mid", times or {}, None)


def test_within_a_cut_devices_of_similar_time_share_a_group():
    # Six devices at one cut, their ids not in the order of their times: the three fastest
    # together, the three slowest together.
    times = {"a": 9.0, "b": 1.0, "c": 8.5, "d": 1.2, "e": 7.9, "f": 0.8}
    members = {d: _member(2, {2: t}) for d, t in times.items()}
    assert SpeedGrouping().form(members, 3, RNG) == [["f", "b", "d"], ["e", "c", "a"]]


def test_one_cut_per_group_smaller_cuts_first_and_the_balanced_groupings_sizes_per_cut():
    splits = {"a": 3, "b": 1, "c": 3, "d": 1, "e": 1, "f": 3, "g": 2, "h": 1, "i": 1}
    members = {d: _member(s, {s: float(ord(d))}) for d, s in splits.items()}
    groups = SpeedGrouping().form(members, 2, RNG)
    assert sorted(d for g in groups for d in g) == sorted(splits)                  # each device once
    assert all(len({splits[d] for d in g}) == 1 for g in groups)                    # one cut per group
    assert [splits[g[0]] for g in groups] == sorted(splits[g[0]] for g in groups)   # smaller cuts first
    for split in (1, 2, 3):
        mine = sum(s == split for s in splits.values())
        assert [len(g) for g in groups if splits[g[0]] == split] == group_sizes(mine, 2)


def test_a_device_not_measured_at_its_cut_is_ordered_by_its_nearest_measured_cut():
    # S2FL's warm-up: at round 2 every device sits at the second cut, measured only at the first.
    member = _member(2, {1: 4.0, 3: 6.0})
    assert SpeedGrouping.time_of(member) == 4.0                                 # a tie: the smaller cut
    assert SpeedGrouping.time_of(_member(3, {1: 4.0, 2: 5.0})) == 5.0           # the nearest
    assert SpeedGrouping.time_of(_member(2, {1: 4.0, 2: 9.0})) == 9.0           # its own cut first
    assert SpeedGrouping.time_of(_member(2)) is None
    warm_up = {"a": _member(2, {1: 3.0}), "b": _member(2, {1: 1.0}), "c": _member(2, {1: 2.0}),
               "d": _member(2, {1: 0.5})}
    assert SpeedGrouping().form(warm_up, 2, RNG) == [["d", "b"], ["c", "a"]]


def test_devices_never_measured_come_last_in_id_order():
    members = {"z": _member(1), "y": _member(1, {1: 5.0}), "x": _member(1), "w": _member(1, {1: 0.0})}
    assert SpeedGrouping().form(members, 2, RNG) == [["w", "y"], ["x", "z"]]
    assert SpeedGrouping().form({d: _member(1) for d in "cab"}, 2, RNG) == [["a", "b"], ["c"]]


def test_no_devices_give_no_groups():
    assert SpeedGrouping().form({}, 3, RNG) == []


@pytest.mark.parametrize("seed", [0, 1])
def test_it_is_registered_as_speed_and_ignores_the_generator(seed):
    members = {"a": _member(1, {1: 2.0}), "b": _member(1, {1: 1.0}), "c": _member(2, {2: 1.0})}
    assert form_round_groups(build_grouping("speed"), members, 4, seed, 1) == [["b", "a"], ["c"]]
