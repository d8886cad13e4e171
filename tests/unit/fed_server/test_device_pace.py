"""Each device's own deadline in an attempt (fed_server/device_pace.py)."""
from __future__ import annotations

import pytest

from fed_server.device_pace import DevicePace


def test_the_usual_time_is_a_running_average_per_split_point():
    pace = DevicePace(patience=2.0, grace_s=1.0)
    pace.observe("a", 2, 4.0)
    pace.observe("a", 2, 2.0)
    pace.observe("a", 3, 10.0)
    pace.observe("a", 2, float("nan"))   # not a measurement
    assert pace.usual("a", 2) == 3.0
    assert pace.usual("a", 3) == 10.0
    assert pace.usual("a", 1) is None and pace.usual("b", 2) is None


def test_deadlines_count_from_each_wait_with_patience_and_grace():
    pace = DevicePace(patience=2.0, grace_s=1.0)
    pace.observe("slow", 2, 10.0)
    work = {"fast": 1.0, "slow": 1.0, "fresh": 1.0}.__getitem__
    due = pace.deadlines({"slow": (2, 100.0), "fresh": (2, 101.0)}, [(3.0, 1.0), (2.0, 1.0)], 4, work)
    assert due == {"slow": 100.0 + 2.0 * 10.0 + 1.0, "fresh": 101.0 + 2.0 * 3.0 + 1.0}
    # Fewer than half uploaded: only the round deadline applies.
    assert pace.deadlines({"slow": (2, 100.0), "fresh": (2, 101.0)}, [(3.0, 1.0)], 3, work) == {}


def test_an_attempt_s_time_counts_at_most_patience_times_the_slowest_other():
    pace = DevicePace(patience=2.0, grace_s=1.0)
    # peers of "slow": the slowest other, 3 s; what it claims about its work does not enter
    pace.observe_attempt({"a": (2, 3.0), "b": (2, 2.0), "slow": (2, 20.0)})
    assert pace.usual("slow", 2) == 2.0 * 3.0
    assert pace.usual("a", 2) == 3.0 and pace.usual("b", 2) == 2.0   # within the bound: as measured
    pace.observe_attempt({"solo": (1, 50.0)})
    assert pace.usual("solo", 1) == 50.0   # no peers: nothing to bound it by


def test_a_device_slow_on_purpose_cannot_stretch_its_deadline_round_after_round():
    # Each round it uploads just before its own deadline; its peers take 2 s.
    pace = DevicePace(patience=2.0, grace_s=1.0)
    deadlines = []
    for _ in range(12):
        due = pace.deadlines({"stall": (1, 0.0)}, [(2.0, 1.0)] * 9, 10, lambda d: 1.0)["stall"]
        deadlines.append(due)
        pace.observe_attempt({"stall": (1, due), **{f"h{i}": (1, 2.0) for i in range(9)}})
    assert max(deadlines) <= 2.0 * 2.0 * 2.0 + 1.0   # patience ** 2 x the peers' time, plus the grace


@pytest.mark.parametrize("claimed_work", [1.0, 3.0, 1e9])
def test_a_claim_of_slow_compute_cannot_stretch_a_deadline_past_patience_squared(claimed_work):
    # The device registered a tiny FLOP/s (work 1e9 x its peers') and uploads just before its own
    # deadline every round; its peers take 2 s. Its deadline stays within patience ** 2 x 2 s + 1 s,
    # and a smaller claim within the bound counts as it is.
    pace = DevicePace(patience=2.0, grace_s=1.0)
    deadlines = []
    for _ in range(12):
        due = pace.deadlines({"stall": (1, 0.0)}, [(2.0, 1.0)] * 9, 10,
                             lambda d: claimed_work if d == "stall" else 1.0)["stall"]
        deadlines.append(due)
        pace.observe_attempt({"stall": (1, due), **{f"h{i}": (1, 2.0) for i in range(9)}})
    assert deadlines[0] == 2.0 * 2.0 * min(claimed_work, 2.0) + 1.0
    assert max(deadlines) <= 2.0 * 2.0 * 2.0 + 1.0


def _colluding_deadlines(ignore_slowest: int, rounds: int = 12) -> list[float]:
    """Two devices that registered 1 FLOP/s and each upload just before its own deadline, "a"
    first and "b" once "a" is in, among eight honest devices of 2 s; their deadlines, round by round."""
    pace = DevicePace(patience=2.0, grace_s=1.0, ignore_slowest=ignore_slowest)
    work = {"a": 1e9, "b": 1e9}
    honest = [(2.0, 1.0)] * 8
    deadlines = []
    for _ in range(rounds):
        due_a = pace.deadlines({"a": (1, 0.0), "b": (1, 0.0)}, honest, 10, lambda d: work.get(d, 1.0))["a"]
        due_b = pace.deadlines({"b": (1, 0.0)}, [*honest, (due_a, 1e9)], 10, lambda d: work.get(d, 1.0))["b"]
        deadlines += [due_a, due_b]
        pace.observe_attempt({"a": (1, due_a), "b": (1, due_b), **{f"h{i}": (1, 2.0) for i in range(8)}})
    return deadlines


def test_two_devices_slow_on_purpose_together_stay_within_the_bound():
    # Each is waited for at most patience ** 2 x the slowest honest device's 2 s, plus the grace.
    assert max(_colluding_deadlines(ignore_slowest=1)) <= 2.0 * 2.0 * 2.0 + 1.0
    # Counting the slowest arrival, the second's deadline is patience x the first's arrival, and
    # their learnt times climb round after round.
    unbounded = _colluding_deadlines(ignore_slowest=0)
    assert unbounded[1] >= 2.0 * unbounded[0] and max(unbounded) > 100.0


def test_honest_slow_devices_that_are_half_of_the_attempt_keep_their_time():
    # Two boards of 20 s beside two servers of 1 s: the boards' learnt times are their own.
    pace = DevicePace(patience=2.0, grace_s=1.0, ignore_slowest=1)
    pace.observe_attempt({"board1": (1, 20.0), "board2": (1, 21.0), "s1": (1, 1.0), "s2": (1, 1.0)})
    assert pace.usual("board1", 1) == 20.0 and pace.usual("board2", 1) == 21.0
    # Among eight servers, one board's time is capped at patience x the servers' (the same bound
    # as a lone board's), the slowest other (the second board) left out.
    pace.observe_attempt({"board1": (2, 20.0), "board2": (2, 21.0), **{f"s{i}": (2, 1.0) for i in range(8)}})
    assert pace.usual("board1", 2) == 2.0 and pace.usual("board2", 2) == 2.0


def test_without_patience_no_device_has_a_deadline_of_its_own():
    pace = DevicePace(patience=None, grace_s=1.0)
    assert pace.deadlines({"a": (1, 0.0)}, [(1.0, 1.0), (1.0, 1.0)], 3, lambda d: 1.0) == {}


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="patience"):
        DevicePace(patience=0.5, grace_s=1.0)
    with pytest.raises(ValueError, match="grace_s"):
        DevicePace(patience=2.0, grace_s=-1.0)
    with pytest.raises(ValueError, match="ignore_slowest"):
        DevicePace(patience=2.0, grace_s=1.0, ignore_slowest=-1)


def test_the_usual_times_survive_a_checkpoint():
    pace = DevicePace(patience=2.0, grace_s=1.0)
    pace.observe("a", 2, 4.0)
    pace.observe("b", 0, 1.5)
    restored = DevicePace(patience=2.0, grace_s=1.0)
    restored.load_state_dict(pace.state_dict())
    assert restored.usual("a", 2) == 4.0 and restored.usual("b", 0) == 1.5
