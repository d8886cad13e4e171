"""The rule behind each device's own deadline (shared/own_deadline.py)."""
from __future__ import annotations

import pytest

from shared.own_deadline import check_patience, counted_arrivals, expected_seconds


def test_nothing_is_expected_before_half_of_the_attempt_uploaded():
    assert expected_seconds(own=3.0, finishers=[(2.0, 1.0)], work=1.0, in_attempt=3) is None
    assert expected_seconds(own=None, finishers=[], work=1.0, in_attempt=0) is None


def test_the_peers_time_is_the_slowest_finisher_scaled_up_by_more_work_never_down():
    finishers = [(2.0, 1.0), (4.0, 2.0)]
    assert expected_seconds(None, finishers, work=1.0, in_attempt=4) == 4.0
    assert expected_seconds(None, finishers, work=6.0, in_attempt=4) == pytest.approx(12.0)


def test_the_scale_for_more_work_is_capped():
    finishers = [(2.0, 1.0), (4.0, 2.0)]
    assert expected_seconds(None, finishers, work=6.0, in_attempt=4, max_scale=2.0) == pytest.approx(8.0)
    assert expected_seconds(None, finishers, work=3.0, in_attempt=4, max_scale=2.0) == pytest.approx(6.0)


def test_a_device_slower_than_its_peers_keeps_its_own_usual_time():
    assert expected_seconds(own=9.0, finishers=[(2.0, 1.0)], work=1.0, in_attempt=2) == 9.0
    assert expected_seconds(own=1.0, finishers=[(2.0, 1.0)], work=1.0, in_attempt=2) == 2.0


def test_bad_settings_are_refused():
    check_patience(None, 0.0)
    with pytest.raises(ValueError, match="patience"):
        check_patience(0.5, 1.0)
    with pytest.raises(ValueError, match="grace_s"):
        check_patience(2.0, -1.0)


def test_the_slowest_finishers_left_out_are_not_the_peers_time():
    # Nine honest finishers at 2 s and one that waited until 16 s: left out, its 16 s is nobody's peers' time.
    finishers = [(2.0, 1.0)] * 8 + [(16.0, 1e9)]
    assert expected_seconds(None, finishers, work=1.0, in_attempt=10, ignore_slowest=1) == 2.0
    assert expected_seconds(None, finishers, work=1.0, in_attempt=10, ignore_slowest=0) == 16.0
    # The left-out finisher's claimed work does not shrink another's scale either.
    assert expected_seconds(None, finishers, work=3.0, in_attempt=10, max_scale=2.0, ignore_slowest=1) == 4.0


def test_the_counted_arrivals_are_always_more_than_half_of_the_attempt():
    assert counted_arrivals(9, 10, 1) == 8
    assert counted_arrivals(9, 10, 4) == 6 and counted_arrivals(9, 10, 8) == 6
    # Two slow boards beside one server: the first board in is counted for the second.
    assert counted_arrivals(2, 3, 1) == 2
    assert expected_seconds(None, [(1.0, 1.0), (20.0, 1.0)], work=1.0, in_attempt=3, ignore_slowest=1) == 20.0
    assert counted_arrivals(3, 4, 1) == 3   # two boards beside two servers: the same
    assert counted_arrivals(1, 2, 5) == 1 and counted_arrivals(0, 1, 1) == 0


def test_bad_ignore_slowest_is_refused():
    with pytest.raises(ValueError, match="ignore_slowest"):
        check_patience(2.0, 1.0, -1)
