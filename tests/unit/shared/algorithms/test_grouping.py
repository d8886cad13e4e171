"""What a grouping knows of a device: a frozen record, and the defaults of a benchmark's replay."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shared.algorithms.grouping import GroupCandidate, candidates_from_counts


def test_a_candidate_is_frozen_and_typed():
    candidate = GroupCandidate.of([3, 1], split_point=2, num_samples=4)
    assert candidate.label_counts.dtype == np.int64 and candidate.label_counts.tolist() == [3, 1]
    with pytest.raises(dataclasses.FrozenInstanceError):
        candidate.split_point = 3


def test_candidates_from_counts_train_on_every_counted_sample_at_split_one():
    members = candidates_from_counts({"a": [3, 1], "b": [0, 5]})
    assert {d: (m.split_point, m.num_samples) for d, m in members.items()} == {"a": (1, 4), "b": (1, 5)}
    assert candidates_from_counts({"a": [2, 2]}, split_point=3)["a"].split_point == 3
