"""Tests for the client time table and sliding split choice (paper Section 3.1, Eq. 1)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fed_server.time_table import (
    CHANGE_RATIO, Bottleneck, ClientTimeTable, DeviceProfile, SplitCostView, critical_path, eq1_time,
)


def table_from(rows: dict[str, list[float]], k: int = 3, warm_up: str = "estimated",
               bottleneck_cap: bool = True, undominated: bool = True) -> ClientTimeTable:
    tt = ClientTimeTable(num_candidates=k, warm_up=warm_up, bottleneck_cap=bottleneck_cap, undominated=undominated)
    for dev, times in rows.items():
        for j, sec in enumerate(times):
            tt.record(dev, j, sec)
    return tt


def test_eq1_time_hand_numbers():
    profile = DeviceProfile(flops=1e10, rate=2e6)
    cost = SplitCostView(client_param_bytes=1_000_000, activation_bytes=1000, client_flops=1e6, server_flops=4e6)
    # 2|Wc|/R   = 2*1e6/2e6          = 1.0
    # 2pq/R     = 2*500*1000/2e6     = 0.5
    # Fc/Comp_c = 1e6*500/1e10       = 0.05
    # Fs/Comp_s = 4e6*500/5e10       = 0.04
    # T = 1.59
    assert eq1_time(profile, cost, samples=500, server_flops=5e10) == pytest.approx(1.59)
    # zero samples: only the two model transfers remain
    assert eq1_time(profile, cost, samples=0, server_flops=5e10) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        eq1_time(DeviceProfile(flops=0.0, rate=1.0), cost, 1, 5e10)
    with pytest.raises(ValueError):
        eq1_time(profile, cost, -1, 5e10)


def test_eq1_time_u_shaped_counts_the_head():
    profile = DeviceProfile(flops=1e10, rate=2e6)
    cost = SplitCostView(client_param_bytes=1_000_000, activation_bytes=1000, client_flops=1e6, server_flops=4e6,
                         head_param_bytes=500_000, head_activation_bytes=200, head_flops=2e6)
    # 2(|Wc| + |Wh|)/R = 2*1.5e6/2e6          = 1.5
    # 2p(q + q_h)/R    = 2*500*1200/2e6       = 0.6
    # (Fc + Fh)/Comp_c = 3e6*500/1e10         = 0.15
    # Fs/Comp_s        = 4e6*500/5e10         = 0.04 (the middle's FLOPs)
    assert eq1_time(profile, cost, samples=500, server_flops=5e10) == pytest.approx(2.29)
    assert cost.device_param_bytes == 1_500_000


@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_paper_s_warm_up_gives_round_minus_one_to_everyone(k):
    tt = table_from({"fast": [1.0] * k, "slow": [9.0] * k}, k=k, warm_up="every_split")  # ignored in warm-up
    devices = ["fast", "slow", "unknown"]
    for r in range(1, k + 1):
        assert tt.choose(r, devices) == {d: r - 1 for d in devices}
    with pytest.raises(ValueError):
        tt.choose(0, devices)
    with pytest.raises(ValueError, match="warm_up must be one of estimated, every_split"):
        ClientTimeTable(warm_up="all")


def test_median_rule_hand_built_table():
    # j:        0   1   2      (larger j = more layers on the device)
    # fast:     1   2   3
    # mid:      2   4   6
    # slow:     4   8  12
    # all 9 sorted: 1 2 2 3 4 4 6 8 12 -> median m = 4
    # fast: |3-4| = 1 smallest -> j=2; mid: |4-4| = 0 -> j=1; slow: |4-4| = 0 -> j=0
    tt = table_from({"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12]})
    expected = {"fast": 2, "mid": 1, "slow": 0}
    assert tt.choose(4, ["fast", "mid", "slow"]) == expected
    assert tt.choose(4, ["slow", "fast", "mid"]) == expected  # order-independent
    assert tt.choose(17, ["fast", "mid", "slow"]) == expected  # any post-warm-up round


def test_median_uses_only_the_rounds_devices():
    tt = table_from({"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12]}, bottleneck_cap=False)
    # fast + mid only: 1 2 2 3 4 6 -> m = (2+3)/2 = 2.5
    # fast: gaps 1.5, 0.5, 0.5 -> tie between j=1 and j=2 -> larger j = 2
    # mid:  gaps 0.5, 1.5, 3.5 -> j=0
    assert tt.choose(5, ["fast", "mid"]) == {"fast": 2, "mid": 0}


def test_the_bottleneck_cap_keeps_every_device_at_or_below_the_slowest_device_s_cheapest_time():
    rows = {"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12]}
    # The paper's own example is below its bottleneck already (slow's cheapest, 4 s): unchanged.
    assert table_from(rows).choose(4, ["fast", "mid", "slow"]) == {"fast": 2, "mid": 1, "slow": 0}
    # fast + mid: the paper's rule gives fast j=2 (3 s) while mid's cheapest is 2 s; the cap
    # (2 s x 1.1, the default noise) leaves fast j=0 and j=1, and of those j=1 is closest to 2.5.
    assert table_from(rows).choose(5, ["fast", "mid"]) == {"fast": 1, "mid": 0}


def test_a_slow_link_s_high_median_does_not_send_a_fast_device_past_the_bottleneck():
    # High's slow link raises the median to 4.27 s; the paper's rule then gives Mid its deepest
    # split (5.2 s), the round's longest time, where High's own cheapest is 4.27 s.
    rows = {"low": [3.9, 2.95, 10.4], "mid": [2.07, 1.6, 5.2], "high": [7.0, 4.27, 20.0]}
    paper = table_from(rows, bottleneck_cap=False, undominated=False).choose(4, list(rows))
    capped = table_from(rows, undominated=False).choose(4, list(rows))
    assert paper == {"low": 0, "mid": 2, "high": 1}
    assert capped == {"low": 0, "mid": 0, "high": 1}
    assert max(rows[d][j] for d, j in capped.items()) == 4.27 < max(rows[d][j] for d, j in paper.items())
    # Low's and Mid's split 1 are closest to the median only for being slower than their split 2
    # (the first cut's activations cost more than the block it spares them): never chosen.
    assert table_from(rows).choose(4, list(rows)) == {"low": 1, "mid": 1, "high": 1}


@pytest.mark.parametrize("cap", [False, True])
def test_a_split_that_a_deeper_one_matches_in_time_is_never_chosen_and_otherwise_the_paper_s_stands(cap):
    rng = np.random.default_rng(7)
    changed = 0
    for _ in range(300):
        rows = {f"d{i}": list(rng.uniform(0.5, 10.0, size=3).round(2)) for i in range(4)}
        paper = table_from(rows, bottleneck_cap=cap, undominated=False).choose(4, list(rows))
        tt = table_from(rows, bottleneck_cap=cap)
        chosen, noise = tt.choose(4, list(rows)), tt.noise()
        for device, j in chosen.items():
            times = rows[device]
            allowed = [k for k in range(3) if paper[device] == k or not cap or
                       times[k] <= max(min(r) for r in rows.values()) * (1 + noise)]
            assert not any(k > j and times[k] <= times[j] * (1 + noise) for k in allowed), (rows, device)
            p = paper[device]
            if not any(k > p and times[k] <= times[p] * (1 + noise) for k in allowed):
                assert j == p, (rows, device)
            changed += j != p
    assert changed > 0   # the rows drawn do hold dominated picks


def test_the_critical_path_adds_a_portion_that_moves_slower_than_the_bottleneck_s_on_both_sides():
    # b = 3 s with a 0.1 s portion each way: 2.8 s of steps. A device at 2 s whose portion takes
    # 0.5 s each way holds every member's first step for it and the round's end for its upload.
    bottleneck = Bottleneck(3.0, 0.1)
    assert bottleneck.path(2.0, 0.5) == pytest.approx(2 * 0.5 + 2.8)
    # A portion no slower than the bottleneck's hides in its transfers: the path is b.
    assert bottleneck.path(2.0, 0.05) == pytest.approx(3.0)
    # Steps longer than the bottleneck's make the device the bottleneck: its own time.
    assert bottleneck.path(3.5, 0.1) == pytest.approx(3.5)
    # No rate known: the cell alone; no cap: never more than the cell.
    assert bottleneck.path(2.0, None) == 2.0
    assert Bottleneck(math.inf).path(2.0, 0.5) == 2.0
    # A portion estimate longer than the cell's own transfers can be: at most half the cell each way.
    assert bottleneck.path(1.0, 5.0) == pytest.approx(2 * 0.5 + 2.8)
    # A group of three: the slowest portion on both sides of the slowest steps.
    assert critical_path([(3.0, 0.1), (2.0, 0.5), (2.5, 0.0)]) == pytest.approx(2 * 0.5 + 2.8)


def test_a_fast_device_is_not_given_a_split_whose_portion_holds_up_its_group():
    # Measured on shaped links (docs/s2fl.md, the bottleneck cap): Low's cheapest, 3.07 s at j=1, is
    # the bottleneck; High's j=2 reads 2.25 s, of which 0.9 s each way move its 6.6 MB portion, and
    # rounds with it there took about 4.2 s against 3.2 s with High at j=1.
    rows = {"low": [3.9, 3.07, 10.4], "mid": [1.94, 2.0, 5.2], "high": [2.0, 1.9, 2.25]}
    portions = {"low": [0.04, 0.09, 2.9], "mid": [0.02, 0.05, 1.5], "high": [0.005, 0.03, 0.9]}
    assert table_from(rows).choose(4, list(rows))["high"] == 2   # the cells alone
    chosen = table_from(rows).choose(4, list(rows), portion_s=lambda d, j: portions[d][j])
    assert chosen == {"low": 1, "mid": 1, "high": 1}
    # A device whose rate is not measured yet is capped by its cells, as before.
    unknown = table_from(rows).choose(4, list(rows), portion_s=lambda d, j: None if d == "high" else portions[d][j])
    assert unknown["high"] == 2


def test_where_no_candidate_fits_the_critical_path_the_device_gets_its_shortest():
    # Every candidate of "far" moves its portion for 1 s each way against the bottleneck's 0.1 s.
    rows = {"slow": [3.0, 3.5, 4.0], "far": [2.5, 2.6, 2.8]}
    portions = {"slow": [0.1, 0.2, 0.3], "far": [1.0, 1.2, 1.3]}
    assert table_from(rows).choose(4, list(rows), portion_s=lambda d, j: portions[d][j])["far"] == 0


def test_a_row_within_noise_gets_its_deepest_split_under_the_bottleneck():
    # host's row is flat (spread 0.15 s within 2 x 0.1 of 1.0 s); the bottleneck is its own
    # cheapest, 1.0 s, so j=2 (1.15 s, past 1.1 s) would lengthen the round: j=1.
    rows = {"host": [1.0, 1.1, 1.15], "other": [0.5, 0.6, 0.9]}
    assert table_from(rows, bottleneck_cap=False).choose(4, list(rows))["host"] == 2
    assert table_from(rows).choose(4, list(rows))["host"] == 1


def test_ties_go_to_larger_j():
    # K=2. A: 3, 5; B: 1, 7 -> sorted 1 3 5 7 -> m = 4.
    # A: |3-4| = |5-4| = 1 -> tie -> j=1; B: |1-4| = |7-4| = 3 -> tie -> j=1.
    tt = table_from({"A": [3, 5], "B": [1, 7]}, k=2, bottleneck_cap=False)
    assert tt.choose(3, ["A", "B"]) == {"A": 1, "B": 1}


def test_running_average():
    tt = ClientTimeTable(num_candidates=3, smoothing=0.5)
    assert tt.get("d", 1) is None
    tt.record("d", 1, 10.0)
    assert tt.get("d", 1) == 10.0  # first entry = measured
    tt.record("d", 1, 20.0)
    assert tt.get("d", 1) == 15.0  # 0.5*10 + 0.5*20
    tt.record("d", 1, 5.0)
    assert tt.get("d", 1) == 10.0  # 0.5*15 + 0.5*5
    assert tt.get("d", 0) is None

    tq = ClientTimeTable(num_candidates=3, smoothing=0.25)
    tq.record("d", 0, 8.0)
    tq.record("d", 0, 16.0)
    assert tq.get("d", 0) == pytest.approx(10.0)  # 0.75*8 + 0.25*16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -0.1])
def test_record_rejects_bad_times(bad):
    with pytest.raises(ValueError):
        ClientTimeTable().record("d", 0, bad)


def test_record_rejects_bad_candidate_and_bad_config():
    tt = ClientTimeTable(num_candidates=3)
    for j in (-1, 3):
        with pytest.raises(ValueError):
            tt.record("d", j, 1.0)
    with pytest.raises(ValueError):
        ClientTimeTable(num_candidates=0)
    with pytest.raises(ValueError):
        ClientTimeTable(smoothing=0.0)


def test_estimate_scaled_by_calibration_for_unmeasured_device():
    # The paper's rule as written: what is checked is how "new" is priced.
    tt = table_from({"fast": [1, 2, 3], "mid": [2, 4, 6]}, bottleneck_cap=False)
    est = {"fast": [0.5, 1, 1], "mid": [1, 2, 2], "new": [2, 4, 6]}

    def estimate(dev: str, j: int) -> float:
        return est[dev][j]

    # ratios measured/estimate: fast 2, 2, 3; mid 2, 2, 3 -> median 2
    assert tt.calibration(estimate) == pytest.approx(2.0)
    # "new" is priced at 2 * (2, 4, 6) = (4, 8, 12). All 9: 1 2 2 3 4 4 6 8 12 -> m = 4.
    # fast -> j=2 (3), mid -> j=1 (4), new -> j=0 (4)
    assert tt.choose(4, ["fast", "mid", "new"], estimate) == {"fast": 2, "mid": 1, "new": 0}
    # Without calibration "new" would look like "mid" (2, 4, 6): 1 2 2 2 3 4 4 6 6 -> m = 3;
    # mid and new: gaps 1, 1, 3 -> tie -> j=1. So the calibration changes the decision.
    exact = {"fast": [1, 2, 3], "mid": [2, 4, 6], "new": [2, 4, 6]}  # ratios all 1 -> calibration 1
    assert tt.calibration(lambda d, j: exact[d][j]) == pytest.approx(1.0)
    assert tt.choose(4, ["fast", "mid", "new"], lambda d, j: exact[d][j]) == {"fast": 2, "mid": 1, "new": 1}
    uncal = ClientTimeTable(num_candidates=3, bottleneck_cap=False)
    assert uncal.calibration(estimate) == 1.0  # empty table -> 1.0
    assert uncal.choose(4, ["new"], estimate) == {"new": 1}  # (2, 4, 6) -> m = 4 -> j=1


def test_measured_cell_beats_estimate():
    tt = table_from({"a": [10, 10, 10]})
    tt.record("b", 2, 10.0)  # b measured only at j=2
    # calibration: a ratios 10/1 each, b 10/1 -> 10; b's j=0,1 estimated 10*1 = 10; all cells 10
    # -> every gap 0 -> ties -> larger j = 2 for both.
    assert tt.choose(4, ["a", "b"], lambda d, j: 1.0) == {"a": 2, "b": 2}


def test_no_estimate_falls_back_to_other_devices_column_median():
    tt = table_from({"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12]})
    # "new" (no entries, no estimate) gets the column medians of the others: (2, 4, 6).
    # Round devices fast, slow, new: 1 2 3 4 8 12 2 4 6 -> sorted 1 2 2 3 4 4 6 8 12 -> m = 4
    # fast -> j=2, slow -> j=0, new -> j=1
    assert tt.choose(4, ["fast", "slow", "new"]) == {"fast": 2, "slow": 0, "new": 1}


def test_a_device_without_an_estimate_gets_the_column_median_beside_estimated_devices():
    # "real" registered no link rate (its estimate is NaN), "est" did: "real" is priced like a
    # device with no estimator, "est" by its calibrated estimate; NaN never enters the calibration.
    tt = table_from({"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12]})
    est = {"fast": [1, 2, 3], "mid": [2, 4, 6], "slow": [4, 8, 12], "est": [4, 8, 12]}

    def estimate(dev: str, j: int) -> float:
        return est[dev][j] if dev in est else math.nan

    assert tt.calibration(estimate) == pytest.approx(1.0)
    # fast 1 2 3, real (column medians) 2 4 6, est 4 8 12 -> m = 4: fast 2, real 1, est 0
    assert tt.choose(4, ["fast", "real", "est"], estimate) == {"fast": 2, "real": 1, "est": 0}


def test_nothing_known_keeps_cycling_candidates():
    tt = ClientTimeTable(num_candidates=3)
    assert tt.choose(4, ["x", "y"]) == {"x": 0, "y": 0}
    assert tt.choose(5, ["x", "y"]) == {"x": 1, "y": 1}
    assert tt.choose(6, ["x", "y"]) == {"x": 2, "y": 2}


def test_entries_copy_and_the_state_round_trip():
    tt = table_from({"fast": [1, 2, 3], "slow": [4, 8, 12]})
    e = tt.entries()
    assert e == {"fast": {0: 1.0, 1: 2.0, 2: 3.0}, "slow": {0: 4.0, 1: 8.0, 2: 12.0}}
    e["fast"][0] = 99.0
    assert tt.get("fast", 0) == 1.0  # a copy
    tt.record("fast", 0, 1.0, transfer_s=0.5)
    tt.censor("slow", 2, 30.0)
    # Through JSON (text keys, lists), as a checkpoint stores it: the same table again.
    state = json.loads(json.dumps(tt.state_dict()))
    back = ClientTimeTable(num_candidates=3, smoothing=0.5)
    back.load_state_dict(state)
    assert back.state_dict() == tt.state_dict()
    assert back.entries() == tt.entries() and back.censored("slow") == {2: 30.0}
    assert back.choose(4, ["fast", "slow"]) == tt.choose(4, ["fast", "slow"])
    with pytest.raises(ValueError, match="candidate index must be in 0..2, got 5"):
        back.load_state_dict({"cells": {"d": {"5": [1.0, 0.0, 0.0]}}})
    with pytest.raises(ValueError, match="invalid time"):
        back.load_state_dict({"cells": {"d": {"0": [-0.5, 0.0, 0.0]}}})
    with pytest.raises(ValueError, match="invalid levels"):
        back.load_state_dict({"levels": {"d": [0.0, 1.0]}})
    assert back.state_dict() == tt.state_dict()   # a refused state changes nothing


def test_eq1_refuses_a_zero_rate_and_names_the_valid_candidates():
    cost = SplitCostView(client_param_bytes=10, activation_bytes=1, client_flops=1.0, server_flops=1.0)
    with pytest.raises(ValueError, match="device flops, device rate and server flops must be > 0"):
        eq1_time(DeviceProfile(flops=1.0, rate=0.0), cost, 1, 1.0)
    with pytest.raises(ValueError, match="candidate index must be in 0..2, got 3"):
        ClientTimeTable(num_candidates=3).record("d", 3, 1.0)
    with pytest.raises(ValueError, match="candidate index must be in 0..3, got 4"):
        ClientTimeTable(num_candidates=4).get("d", 4)


def test_an_unmeasured_device_cycles_through_every_candidate_in_later_rounds():
    table = ClientTimeTable(num_candidates=3)
    # (round - 1) % K, from the first round after warm-up on: 3 % 3, 4 % 3, ..., 8 % 3.
    assert [table.choose(r, ["x"])["x"] for r in range(4, 10)] == [0, 1, 2, 0, 1, 2]


def test_near_ties_are_absolute_below_one_second_and_relative_above():
    # m = median(0.002, 0.0030000005, 0.0025, 0.0025) = 0.0025; device a's gaps 0.0005 and
    # 0.0005000005 differ by 5e-10, within the tolerance 1e-9 * max(1, m) = 1e-9: a tie -> j = 1.
    small = table_from({"a": [0.002, 0.0030000005], "b": [0.0025, 0.0025]}, k=2, bottleneck_cap=False)
    assert small.choose(3, ["a", "b"])["a"] == 1
    # Scaled up (m = 2500 s) the tolerance is relative, 1e-9 * 2500 = 2.5e-6: gaps that differ by
    # 5e-7 tie (j = 1), gaps that differ by 5e-6 do not (j = 0, the closer one).
    tied = table_from({"a": [2000.0, 3000.0000005], "b": [2500.0, 2500.0]}, k=2, bottleneck_cap=False)
    assert tied.choose(3, ["a", "b"])["a"] == 1
    apart = table_from({"a": [2000.0, 3000.000005], "b": [2500.0, 2500.0]}, k=2, bottleneck_cap=False)
    assert apart.choose(3, ["a", "b"])["a"] == 0


def test_calibration_keeps_a_fractional_ratio():
    tt = table_from({"a": [3.0], "b": [5.0], "c": [7.0]}, k=1)
    # measured / estimate: 3/2 = 1.5, 5/2 = 2.5, 7/2 = 3.5 -> median 2.5 (not a whole number)
    assert tt.calibration(lambda d, j: 2.0) == 2.5


def test_load_state_dict_replaces_the_whole_table():
    # A resumed run restores its checkpointed table: the restored cells, nothing of the old ones,
    # with the table's own candidate count and smoothing.
    tt = ClientTimeTable(num_candidates=2, smoothing=0.25)
    tt.record("old", 0, 9.0)
    tt.load_state_dict({"cells": {"a": {"1": [0.0, 0.0, 4.0]}}})
    assert tt.entries() == {"a": {1: 4.0}}
    tt.record("a", 1, 8.0)                     # 0.75 * 4 + 0.25 * 8
    assert tt.get("a", 1) == 5.0
    with pytest.raises(ValueError, match="candidate index must be in 0..1, got 2"):
        tt.load_state_dict({"cells": {"a": {"2": [1.0, 0.0, 0.0]}}})


def test_eq1_refuses_negative_speeds_and_the_table_takes_full_smoothing_and_small_times():
    cost = SplitCostView(client_param_bytes=10, activation_bytes=1, client_flops=1.0, server_flops=1.0)
    for profile in (DeviceProfile(flops=-1.0, rate=1.0), DeviceProfile(flops=1.0, rate=-1.0)):
        with pytest.raises(ValueError, match="must be > 0"):
            eq1_time(profile, cost, 1, 1.0)
    full = ClientTimeTable(num_candidates=1, smoothing=1.0)   # smoothing 1: the latest time alone
    full.record("d", 0, 4.0)
    full.record("d", 0, 2.0)
    assert full.get("d", 0) == 2.0
    full.record("d", 0, 0.5)
    assert full.get("d", 0) == 0.5


def test_calibration_skips_cells_without_a_positive_finite_estimate():
    tt = table_from({"a": [3.0], "b": [5.0], "c": [7.0], "d": [1.0]}, k=1)
    estimates = {"a": 2.0, "b": 2.0, "c": math.nan, "d": 0.0}
    # only a (1.5) and b (2.5) count: median 2.0
    assert tt.calibration(lambda d, j: estimates[d]) == 2.0


def test_an_estimate_of_zero_seconds_is_used_as_it_is():
    tt = table_from({"a": [4.0, 6.0]}, k=2)
    # "new" is estimated 0 s at j=0 (used: 0 * calibration) and 3 s at j=1; a has no estimate
    # (NaN), so the calibration is 1.0. Cells 4, 6, 0, 3 -> m = 3.5: new -> j=1 (0.5 vs 3.5).
    # With a's 4 in place of the 0, m = 4 and new would get j=0.
    estimates = {("new", 0): 0.0, ("new", 1): 3.0}
    choice = tt.choose(3, ["a", "new"], lambda d, j: estimates.get((d, j), math.nan))
    assert choice == {"a": 0, "new": 1}


def _high_low_mid() -> ClientTimeTable:
    """Three devices' warm-up cells on shaped links (seconds; docs/real-links.md): High in its
    parts (transfer, compute, the rest), Low and Mid as totals."""
    tt = table_from({"low": [4.68, 4.05, 11.43], "mid": [2.77, 2.23, 5.84]})
    for j, (seconds, transfer, compute) in enumerate([(0.92, 0.73, 0.10), (0.71, 0.44, 0.20), (2.12, 1.89, 0.20)]):
        tt.record("high", j, seconds, transfer_s=transfer, compute_s=compute)
    return tt


def test_a_link_that_changes_moves_every_cell_of_the_device_and_back():
    tt = ClientTimeTable()
    tt.record("d", 0, 1.0, transfer_s=0.6, compute_s=0.2)
    tt.record("d", 1, 0.8, transfer_s=0.4, compute_s=0.3)
    tt.record("d", 2, 2.0, transfer_s=1.8, compute_s=0.2)
    # Its link is ten times slower, measured at j=1 alone: its other cells' transfers follow.
    tt.record("d", 1, 4.4, transfer_s=4.0, compute_s=0.3)
    assert tt.levels("d") == pytest.approx((10.0, 1.0))
    assert [tt.get("d", j) for j in range(3)] == pytest.approx([6.4, 4.4, 18.2])
    # It recovers: back as they were.
    tt.record("d", 1, 0.8, transfer_s=0.4, compute_s=0.3)
    assert tt.levels("d") == pytest.approx((1.0, 1.0))
    assert [tt.get("d", j) for j in range(3)] == pytest.approx([1.0, 0.8, 2.0])


def test_noise_is_averaged_and_moves_no_level():
    tt = ClientTimeTable()
    tt.record("d", 1, 0.8, transfer_s=0.4, compute_s=0.3)
    tt.record("d", 2, 2.0, transfer_s=1.8, compute_s=0.2)
    tt.record("d", 1, 0.9, transfer_s=0.5, compute_s=0.3)     # transfer 1.25x: below CHANGE_RATIO
    assert tt.levels("d") == (1.0, 1.0)
    assert tt.get("d", 1) == pytest.approx(0.85)              # the paper's running average of the totals
    # A part of a few hundredths that triples moves the cell by less than CHANGE_SHARE: noise.
    small = ClientTimeTable()
    small.record("d", 0, 1.0, transfer_s=0.01, compute_s=0.5)
    small.record("d", 0, 1.02, transfer_s=0.03, compute_s=0.5)
    assert CHANGE_RATIO < 3 and small.levels("d") == (1.0, 1.0)


def test_a_board_whose_compute_slows_down_moves_its_compute_parts_only():
    tt = ClientTimeTable()
    tt.record("d", 1, 0.8, transfer_s=0.4, compute_s=0.3)
    tt.record("d", 2, 2.0, transfer_s=1.8, compute_s=0.2)
    tt.record("d", 2, 2.3, transfer_s=1.8, compute_s=0.5)     # compute 2.5x
    assert tt.levels("d") == pytest.approx((1.0, 2.5))
    assert tt.get("d", 1) == pytest.approx(0.4 + 0.75 + 0.1)


def test_a_cut_attempt_moves_the_device_to_its_cheapest_split_that_fits():
    tt = _high_low_mid()
    assert tt.choose(4, ["low", "mid", "high"])["high"] == 2
    # Its link drops tenfold: at split 3 it is cut after 6.2 s (no measurement). Its link level
    # rises until its split-3 cell reads 6.2 s: (6.2 - 0.20 - 0.03) / 1.89.
    assert tt.censor("high", 2, 6.2) == pytest.approx(5.97 / 1.89)
    assert tt.censored("high") == {2: 6.2}
    # Its cells now read 2.50, 1.66 and 6.2 s; the median rule would take 2.50 (j=0, closest to
    # m = 4.05), a lower bound as the others are; it gets its cheapest that reads under 6.2 s.
    assert tt.choose(5, ["low", "mid", "high"])["high"] == 1
    # Measured there at the new rate (4.4 s of transfer), the level is the link's own, tenfold, and
    # the censored entry is done with: split 2 is closest to the median now.
    tt.record("high", 1, 4.67, transfer_s=4.4, compute_s=0.2)
    assert tt.levels("high")[0] == pytest.approx(10.0, rel=1e-3) and tt.censored("high") == {}
    assert tt.choose(6, ["low", "mid", "high"])["high"] == 1
    assert tt.get("high", 2) == pytest.approx(18.9 + 0.23, rel=1e-3)


def test_a_device_cut_at_every_split_keeps_its_cheapest():
    tt = _high_low_mid()
    for j in (2, 1, 0):
        tt.censor("high", j, 6.2)
    # Nothing reads under the 6.2 s it was cut at: its cheapest (split 2 reads exactly 6.2 s).
    assert tt.censored("high") == {0: 6.2, 1: 6.2, 2: 6.2}
    assert tt.choose(5, ["low", "mid", "high"])["high"] == 1
    with pytest.raises(ValueError, match="seconds waited must be finite"):
        tt.censor("high", 0, math.nan)


def test_a_cut_in_a_cell_without_transfer_time_raises_the_compute_level():
    tt = ClientTimeTable()
    tt.record("c", 0, 5.0, transfer_s=0.0, compute_s=4.0)
    assert tt.censor("c", 0, 9.0) == 1.0
    assert tt.levels("c") == pytest.approx((1.0, 2.0)) and tt.get("c", 0) == pytest.approx(9.0)
    # A cut shorter than the cell teaches nothing but the bound itself.
    assert tt.censor("c", 0, 3.0) == 1.0 and tt.levels("c") == pytest.approx((1.0, 2.0))


def test_a_fast_device_far_below_the_median_gets_its_deepest_split_not_its_noise():
    # A native host among two boards under emulation: its cells are transfer and latency, 1.1 to
    # 1.7 s at every split, against a median of 20 s. The paper's rule would give it its largest
    # cell (j=0, noise); it is off the critical path wherever it is cut: its deepest.
    tt = table_from({"host": [1.7, 1.1, 1.4], "board1": [21, 19, 30], "board2": [23, 20, 35]})
    assert tt.choose(4, ["host", "board1", "board2"]) == {"host": 2, "board1": 1, "board2": 1}


def test_a_row_within_noise_of_itself_gets_its_deepest_split_and_the_noise_is_measured():
    tt = table_from({"a": [4.0, 4.3, 3.9], "b": [2, 3, 5], "c": [6, 7, 9]}, undominated=False)
    # m = 4.3. a's spread (0.4 s) is within 2 x the default noise (0.1) of its smallest time.
    assert tt.noise() == 0.1
    assert tt.choose(4, ["a", "b", "c"])["a"] == 2
    # Re-measurements that move their cells by 3 %: the table's noise is 0.03, a's spread is
    # more than that explains, and the paper's rule stands (j=1, gap 0).
    for j, seconds in enumerate([10.0, 20.0, 30.0]):
        tt.record("n", j, seconds)
        tt.record("n", j, seconds * 1.03)
    assert tt.noise() == pytest.approx(0.03)
    assert tt.choose(4, ["a", "b", "c"])["a"] == 1


def _terms(device: str, j: int) -> tuple[float, float, float]:
    """Eq. 1's terms at the three candidates: bytes on the link, client and server FLOPs."""
    return ([10.0, 4.0, 20.0][j], [1.0, 2.0, 3.0][j], [3.0, 2.0, 1.0][j])


def test_the_estimated_warm_up_measures_one_split_and_tries_only_those_the_rule_picks():
    tt = ClientTimeTable(warm_up="estimated")
    devices = ["slow", "mid", "fast"]
    assert tt.choose(1, devices, terms=_terms) == {d: 0 for d in devices}
    for device, (seconds, transfer, compute) in {"slow": (12.0, 8.0, 3.0), "mid": (4.0, 2.0, 1.5),
                                                 "fast": (1.2, 0.8, 0.3)}.items():
        tt.record(device, 0, seconds, transfer_s=transfer, compute_s=compute)
    # slow's untried cells, scaled term by term from its j=0 (Eq. 1 with its measured rate,
    # compute speed and server speed): 8*4/10 + 3*2/1 + 1*2/3 and 8*20/10 + 3*3/1 + 1*1/3.
    assert tt.row("slow", None, 1.0, _terms) == pytest.approx({0: 12.0, 1: 9.8667, 2: 25.3333}, rel=1e-4)
    # m = 4.133: slow (25 s at split 3) never tries split 3; fast tries its deepest.
    assert tt.choose(2, devices, terms=_terms) == {"slow": 1, "mid": 1, "fast": 2}
    paper = ClientTimeTable(warm_up="every_split")
    assert paper.choose(2, devices, terms=_terms) == {d: 1 for d in devices}


def test_a_cut_at_a_split_never_measured_raises_the_level_from_the_scaled_cell():
    tt = ClientTimeTable()
    tt.record("slow", 0, 12.0, transfer_s=8.0, compute_s=3.0)
    # Scaled split 2: transfer 3.2, compute 6, rest 0.667; cut after 20 s.
    assert tt.censor("slow", 1, 20.0, _terms) == pytest.approx((20.0 - 6.0 - 2.0 / 3.0) / 3.2)
    assert tt.row("slow", None, 1.0, _terms)[1] == pytest.approx(20.0)


def test_an_untried_split_s_compute_scales_as_other_devices_measured_it_not_by_eq1_s_flops():
    # Eq. 1's FLOPs say split 2 needs twice split 1's client compute; a device measured at both
    # needed 1.2 times (what every step costs whatever its size): "slow" is priced with that.
    tt = ClientTimeTable()
    tt.record("slow", 0, 12.0, transfer_s=8.0, compute_s=3.0)
    assert tt.row("slow", terms=_terms)[1] == pytest.approx(8.0 * 4 / 10 + 3.0 * 2 + 1.0 * 2 / 3)
    tt.record("probe", 0, 3.0, transfer_s=1.0, compute_s=1.0)
    tt.record("probe", 1, 2.7, transfer_s=0.4, compute_s=1.2)
    tt.record("probe", 0, 3.0, transfer_s=1.0, compute_s=1.0)   # its latest is j=0 again: no matter
    # compute 1.2 / 1.0; the rest (the Main Server's) 1.1 / 1.0; transfer still by Eq. 1's bytes.
    assert tt.row("slow", terms=_terms)[1] == pytest.approx(8.0 * 4 / 10 + 3.0 * 1.2 + 1.0 * 1.1)
@pytest.mark.parametrize("j", [-0.5, 0.5, 1.5, 2.5])
def test_a_fractional_candidate_index_is_refused(j):
    tt = ClientTimeTable(num_candidates=3)
    with pytest.raises(ValueError, match=f"candidate index must be in 0..2, got {j}"):
        tt.record("d", j, 1.0)
    with pytest.raises(ValueError, match="candidate index"):
        tt.get("d", j)
    assert tt.entries() == {}
    tt.record("d", 1.0, 2.0)   # a whole number, as JSON may bring it
    assert tt.get("d", 1) == 2.0


@pytest.mark.parametrize("bad", [math.inf, -1.0, math.nan])
def test_an_estimate_that_is_not_a_finite_non_negative_time_is_not_used(bad):
    # "new" is estimated ``bad`` at j=0 and 3 s at j=1; "a" has no estimate (calibration 1.0).
    # The bad cell is priced like an unmeasured device without an estimate: the column median of
    # the others (a's 4). Cells 4, 6, 4, 3 -> m = 4: a -> j=0, new -> j=0. Taken as it is, an
    # infinite estimate would move the median to 5 (a -> j=1, new -> j=1), a negative one to 3.5
    # (new -> j=1).
    tt = table_from({"a": [4.0, 6.0]}, k=2, undominated=False)
    estimates = {("new", 0): bad, ("new", 1): 3.0}
    assert tt.choose(3, ["a", "new"], lambda d, j: estimates.get((d, j), math.nan)) == {"a": 0, "new": 0}


def test_calibration_skips_infinite_and_negative_estimates():
    tt = table_from({"a": [3.0], "b": [5.0], "c": [7.0], "d": [1.0]}, k=1)
    estimates = {"a": 2.0, "b": 2.0, "c": math.inf, "d": -1.0}
    # only a (1.5) and b (2.5) count: median 2.0 (c would add 0.0, d -1.0)
    assert tt.calibration(lambda d, j: estimates[d]) == 2.0


# --- edges the mutation tests found unguarded ----------------------------------------------------

def test_a_device_profile_and_a_cost_view_are_frozen():
    profile = DeviceProfile(flops=1e9, rate=1e6)
    with pytest.raises(AttributeError):
        profile.flops = 1.0   # type: ignore[misc]
    view = SplitCostView(client_param_bytes=1, activation_bytes=1, client_flops=1.0, server_flops=1.0)
    with pytest.raises(AttributeError):
        view.server_flops = 0.0   # type: ignore[misc]


def test_a_round_of_zero_seconds_in_zero_parts_is_recorded():
    tt = ClientTimeTable(num_candidates=1)
    tt.record("a", 0, 0.0, 0.0, 0.0)
    assert tt.get("a", 0) == 0.0


def test_a_part_shrunk_past_a_floats_range_is_noise_not_a_change_of_level():
    tt = ClientTimeTable(num_candidates=1)
    tt.record("a", 0, 1e300, 1e300, 0.0)
    tt.record("a", 0, 1e300, 5e-324, 0.0)   # 5e-324 / 1e300 is 0.0 as a float
    assert tt.levels("a") == (1.0, 1.0)


def test_a_change_of_both_parts_by_the_same_ratio_is_not_a_noise_sample():
    # Two re-measurements within noise, then both parts tripled: a change, so the table has still
    # seen only two noise samples and keeps its default noise.
    tt = ClientTimeTable(num_candidates=1, smoothing=1.0)
    tt.record("a", 0, 10.0, 4.0, 4.0)
    tt.record("a", 0, 10.2, 4.0, 4.0)
    tt.record("a", 0, 10.2, 4.0, 4.0)
    tt.record("a", 0, 26.2, 12.0, 12.0)
    assert tt.noise() == pytest.approx(0.1)


def test_a_part_the_terms_give_no_cost_at_the_measured_cut_is_not_scaled():
    # Eq. 1's client FLOPs are 0 at candidate 0: its compute part keeps its time at candidate 1
    # instead of being divided by zero; the transfer scales by the bytes (x2).
    tt = ClientTimeTable(num_candidates=2)
    tt.record("a", 0, 10.0, 4.0, 3.0)
    terms = lambda device, j: (100.0, 0.0, 10.0) if j == 0 else (200.0, 50.0, 10.0)   # noqa: E731
    assert tt.row("a", terms=terms)[1] == pytest.approx(8.0 + 3.0 + 3.0)


def test_an_estimate_is_multiplied_by_the_calibration():
    tt = ClientTimeTable(num_candidates=1)
    assert tt.row("new", estimate=lambda device, j: 3.0, calibration=2.0) == {0: 6.0}


def test_a_censored_candidate_reads_its_wait_where_nothing_else_prices_it():
    tt = ClientTimeTable(num_candidates=2)
    tt.record("a", 0, 5.0)
    tt.censor("a", 1, 30.0)
    assert tt.row("a") == {0: 5.0, 1: 30.0}


def test_the_warm_up_is_read_by_value_not_by_identity():
    # A warm-up name read from a file is an equal string, not the module's own object.
    # Both devices are measured at candidate 0 only: out of the warm-up the rule would keep them there.
    warm_up = "".join(["every", "_split"])
    tt = ClientTimeTable(num_candidates=3, warm_up=warm_up)
    tt.record("a", 0, 5.0)
    tt.record("b", 0, 6.0)
    assert tt.choose(2, ["a", "b"]) == {"a": 1, "b": 1}
