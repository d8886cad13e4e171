"""Devices that let a deadline pass sit out the next attempts, doubling with each miss in a row."""
from __future__ import annotations

import pytest

from fed_server.missed_deadlines import MissedDeadlines


def test_each_miss_in_a_row_doubles_the_attempts_sat_out_up_to_the_bound():
    missed = MissedDeadlines(max_skip=4)
    sat_out = []
    attempt = 1
    for _ in range(5):   # selected again at the first attempt it may be, and misses again
        sat_out.append(missed.missed(["d"], attempt)["d"])
        assert "d" in missed.skipped(attempt + sat_out[-1])
        attempt += sat_out[-1] + 1
        assert "d" not in missed.skipped(attempt)
    assert sat_out == [1, 2, 4, 4, 4]


def test_an_upload_or_a_new_registration_clears_the_record():
    missed = MissedDeadlines(max_skip=16)
    missed.missed(["a", "b"], 3)
    missed.missed(["a"], 5)
    assert missed.skipped(5) == {"a"} and missed.skipped(4) == {"a", "b"}
    missed.answered(["a"])
    assert missed.skipped(4) == {"b"}
    assert missed.missed(["a"], 10) == {"a": 1}   # its next miss counts from one again


def test_zero_never_skips_and_the_state_survives_a_checkpoint():
    assert MissedDeadlines(max_skip=0).missed(["d"], 1) == {"d": 0}
    missed = MissedDeadlines(max_skip=8)
    missed.missed(["a"], 2)
    missed.missed(["a", "b"], 4)
    restored = MissedDeadlines(max_skip=8)
    restored.load_state_dict(missed.state_dict())
    assert restored.state_dict() == missed.state_dict() == {"a": [2, 7], "b": [1, 6]}
    assert restored.skipped(6) == {"a"}
    with pytest.raises(ValueError):
        MissedDeadlines(max_skip=-1)
