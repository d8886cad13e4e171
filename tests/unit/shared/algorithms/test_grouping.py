"""What a grouping knows of a device: a frozen record built from the round plan's participant entry
(the one builder both servers use), the defaults of a benchmark's replay, and groups cut from an
order."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shared.algorithms.grouping import GroupCandidate, candidates_from_counts, consecutive_groups, group_candidate
from shared.algorithms.label_balance import group_sizes
from shared.algorithms.registry import GROUPINGS, build_grouping
from shared.schemas import Participant


def test_a_candidate_is_frozen_and_typed():
    candidate = GroupCandidate.of([3, 1], split_point=2, num_samples=4)
    assert candidate.label_counts.dtype == np.int64 and candidate.label_counts.tolist() == [3, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        candidate.split_point = 3


def test_candidates_from_counts_train_on_every_counted_sample_at_split_one():
    members = candidates_from_counts({"a": [3, 1], "b": [0, 5]})
    assert {d: (m.split_point, m.num_samples) for d, m in members.items()} == {"a": (1, 4), "b": (1, 5)}
    assert candidates_from_counts({"a": [2, 2]}, split_point=3)["a"].split_point == 3


def test_group_candidate_carries_everything_the_round_plan_says_of_the_device():
    participant = Participant(device_id="a", split_point=2, num_samples=7, token_nonce="n", download_s=0.5,
                              kind="low", round_times=[(1, 3.5), (2, 1.25)], link_rate=2e6)
    candidate = group_candidate(participant, [4, 3])
    assert candidate.label_counts.dtype == np.int64 and candidate.label_counts.tolist() == [4, 3]
    assert (candidate.split_point, candidate.num_samples, candidate.kind) == (2, 7, "low")
    assert candidate.round_times == {1: 3.5, 2: 1.25} and candidate.link_rate == 2e6
    # A participant the Fed Server knows nothing more of (no kind, never measured).
    bare = group_candidate(Participant(device_id="b", split_point=1, num_samples=1), [1])
    assert (bare.kind, dict(bare.round_times), bare.link_rate) == (None, {}, None)


@pytest.mark.parametrize("devices, size, expected", [
    (7, 3, [3, 2, 2]), (6, 3, [3, 3]), (2, 4, [2]), (0, 3, []), (5, 1, [1, 1, 1, 1, 1]),
])
def test_consecutive_groups_cut_the_order_into_the_balanced_groupings_sizes(devices, size, expected):
    ordered = [f"d{9 - i}" for i in range(devices)]   # not in id order: the order given is kept
    groups = consecutive_groups(ordered, size)
    assert [len(g) for g in groups] == expected == group_sizes(devices, size)
    assert [d for g in groups for d in g] == ordered


@pytest.mark.parametrize("name", sorted(GROUPINGS))
def test_a_grouping_says_truly_whether_it_reads_the_label_counts(name):
    # A run whose devices withhold their counts may only name a grouping that says it does not
    # read them (shared/run_config.py): the same devices with other counts must then group alike,
    # and a grouping that reads them groups these two populations differently.
    def candidates(classes: list[int]) -> dict[str, GroupCandidate]:
        return {f"d{i}": GroupCandidate(np.eye(2, dtype=np.int64)[c] * 50, 1, 50) for i, c in enumerate(classes)}
    grouping = build_grouping(name)
    apart = grouping.form(candidates([0, 0, 0, 1, 1, 1]), 2, np.random.default_rng(0))
    mixed = grouping.form(candidates([0, 1, 1, 0, 1, 0]), 2, np.random.default_rng(0))
    assert grouping.uses_label_counts == (apart != mixed), (apart, mixed)
