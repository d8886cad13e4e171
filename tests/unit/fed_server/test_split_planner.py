"""The split planner: which block count each selected device gets, per split mode."""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest

from fed_server.devices import DeviceRegistry
from fed_server.split_planner import SplitPlanner
from fed_server.time_table import ClientTimeTable
from shared.models import ModelProfile, build_model, profile_model
from shared.schemas import DeviceProfileMsg, RegisterRequest

DEVICES = ["d0", "d1", "d2"]


@functools.cache
def _cnn() -> tuple[list[int], int, ModelProfile]:
    """The cnn's split points, block count and profile (built once: profiling takes seconds)."""
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    return list(model.split_points), len(model.blocks), profile_model(model, "cnn")


def _planner(mode: str, rate: float | None = 1e6, smoothing: float = 1.0, warm_up: str = "estimated",
             pinned: dict[str, int] | None = None, head_start: int | None = None) -> SplitPlanner:
    split_points, num_blocks, profile = _cnn()
    devices = DeviceRegistry(len(DEVICES))
    for i, (d, flops) in enumerate(zip(DEVICES, (1e8, 1e9, 1e10))):
        devices.register(RegisterRequest(device_id=d, shard=i, num_samples=100, profile=DeviceProfileMsg(flops=flops, rate=rate)))
    table = ClientTimeTable(len(split_points), smoothing, warm_up)
    return SplitPlanner(mode, split_points, num_blocks, profile, table, devices, local_epochs=1, server_flops=1e11,
                        pinned=pinned, head_start=head_start)


def test_zero_mode_puts_the_whole_model_on_every_device():
    p = _planner("zero")
    assert p.choose(5, DEVICES) == {d: (None, p.num_blocks) for d in DEVICES}


def test_fixed_mode_gives_everyone_the_largest_client_portion():
    p = _planner("fixed")
    last = len(p.split_points) - 1
    assert p.choose(1, DEVICES) == {d: (last, p.split_points[last]) for d in DEVICES}


def test_sliding_mode_warms_up_through_every_candidate_then_follows_the_time_table():
    p = _planner("sliding", warm_up="every_split")
    k = len(p.split_points)
    for round_index in range(1, k + 1):   # warm-up: round r uses candidate r - 1 for everyone
        assert p.choose(round_index, DEVICES) == {d: (round_index - 1, p.split_points[round_index - 1]) for d in DEVICES}
    # Measured: the slow device d0 is fastest at the smallest portion, the fast d2 at the largest.
    for j in range(k):
        p.table.record("d0", j, 1.0 + 10.0 * j)
        p.table.record("d1", j, 5.0 + 0.0 * j)
        p.table.record("d2", j, 30.0 - 10.0 * j)
    chosen = p.choose(k + 1, DEVICES)
    assert all(blocks == p.split_points[j] for j, blocks in chosen.values())
    assert chosen["d0"][0] < chosen["d2"][0]


def test_estimates_grow_with_a_slower_device():
    p = _planner("sliding")
    assert p.estimate("d0", 0) > p.estimate("d2", 0) > 0
    with pytest.raises(KeyError):
        p.estimate("unknown", 0)


def test_a_device_with_no_registered_rate_has_no_estimate_until_a_round_measures_its_link():
    p = _planner("sliding", rate=None)
    assert math.isnan(p.estimate("d0", 0))
    cost = p.profile.cost(p.split_points[1])
    moved = 2 * cost.client_param_bytes + 2 * 100 * cost.activation_bytes   # Eq. 1's bytes at j=1, 100 samples
    p.observe("d0", 1, 5.0, transfer_s=4.0, compute_s=0.5)
    assert p.devices.measured_rate("d0") == pytest.approx(moved / 4.0)
    # With that rate, Eq. 1 gives back the measured transfer time at j=1 (plus the compute terms).
    compute = cost.client_flops * 100 / 1e8 + cost.server_flops * 100 / 1e11
    assert p.estimate("d0", 1) == pytest.approx(4.0 + compute)


def test_a_measured_rate_replaces_the_registered_one_and_nothing_else_changes_it():
    p = _planner("sliding")
    before = p.estimate("d1", 2)
    p.observe("d1", 2, 1.0, transfer_s=0.0, compute_s=0.5)     # no transfer time: nothing to measure
    p.observe("gone", 2, 1.0, transfer_s=1.0, compute_s=0.0)   # not registered (any more): no rate
    assert p.estimate("d1", 2) == before
    p.observe("d1", 2, 1001.0, transfer_s=1000.0, compute_s=0.5)   # a far slower link than the 1e6 B/s it registered
    assert p.devices.link_rate("d1") < 1e6 and p.estimate("d1", 2) > before


def test_a_portion_s_download_time_is_its_bytes_over_the_link_rate_or_the_slowest_known_one():
    p = _planner("sliding")
    wc = [p.profile.cost(k).client_param_bytes for k in p.split_points]
    assert p.download_seconds({"d1": 2, "d0": None, "gone": 2}) == {
        "d1": pytest.approx(wc[2] / 1e6), "d0": None, "gone": pytest.approx(wc[2] / 1e6)}
    unknown = _planner("sliding", rate=None)
    assert unknown.download_seconds({"d0": 1, "d1": 2}) == {"d0": None, "d1": None}
    unknown.devices.devices["d2"].profile = dataclasses.replace(unknown.devices.devices["d2"].profile, rate=4e6)
    unknown.devices.devices["d1"].profile = dataclasses.replace(unknown.devices.devices["d1"].profile, rate=2e6)
    # d0's link is not known: as slow as the slowest known among the chosen (d1's, not d2's)
    assert unknown.download_seconds({"d0": 1, "d1": 2, "d2": 2}) == {
        "d0": pytest.approx(wc[1] / 2e6), "d1": pytest.approx(wc[2] / 2e6), "d2": pytest.approx(wc[2] / 4e6)}


def test_eq1_counts_every_local_epoch_and_any_positive_transfer_time_measures_the_link():
    p = _planner("sliding")
    p.local_epochs = 2                          # 100 samples, twice: p = 200 in Eq. 1
    cost = p.profile.cost(p.split_points[0])
    expected = (2 * cost.client_param_bytes + 2 * 200 * cost.activation_bytes) / 1e6 \
        + cost.client_flops * 200 / 1e8 + cost.server_flops * 200 / 1e11
    assert p.estimate("d0", 0) == pytest.approx(expected)
    with pytest.raises(ValueError, match="must be >= 0"):
        p.observe("d0", 0, 1.0, transfer_s=-1.0, compute_s=0.0)    # not a time: refused, nothing changes
    assert p.table.get("d0", 0) is None
    p.observe("d0", 0, 1.0, transfer_s=5e-324, compute_s=0.0)     # a rate that overflows to infinity: no rate
    assert p.devices.link_rate("d0") == 1e6 and p.devices.measured_rate("d0") is None
    p.observe("d0", 0, 1.0, transfer_s=0.5, compute_s=0.0)    # half a second is a measurement like any other
    moved = 2 * cost.client_param_bytes + 2 * 200 * cost.activation_bytes
    assert p.devices.link_rate("d0") == pytest.approx(moved / 0.5)


def test_a_claimed_slow_link_cannot_stretch_a_download_time_once_rates_are_measured():
    # d0 claims 1 B/s; d1 and d2 were measured at 2e6 and 4e6 B/s.
    p = _planner("sliding", rate=None)
    p.devices.devices["d0"].profile = dataclasses.replace(p.devices.devices["d0"].profile, rate=1.0)
    p.devices.measure_rate("d1", 2e6)
    p.devices.measure_rate("d2", 4e6)
    wc = p.profile.cost(p.split_points[1]).client_param_bytes
    assert p.download_seconds({"d0": 1, "d1": 1, "d2": 1}) == {
        "d0": pytest.approx(wc / 2e6), "d1": pytest.approx(wc / 2e6), "d2": pytest.approx(wc / 4e6)}
    # A claim of a faster link than the slowest measured one counts: it only shortens its wait.
    p.devices.devices["d0"].profile = dataclasses.replace(p.devices.devices["d0"].profile, rate=8e6)
    assert p.download_seconds({"d0": 1, "d1": 1})["d0"] == pytest.approx(wc / 8e6)


def test_a_portion_s_seconds_for_the_bottleneck_cap_come_from_the_measured_rate_only():
    # d0 claims 1 MB/s and is not measured: the cap leaves it to its cells (None).
    p = _planner("sliding")
    assert p.portion_seconds("d0", 2) is None
    p.devices.measure_rate("d0", 4e6)
    assert p.portion_seconds("d0", 2) == pytest.approx(p.profile.cost(p.split_points[2]).client_param_bytes / 4e6)
    assert p.portion_seconds("d0", 2) > p.portion_seconds("d0", 0)


def test_a_measured_rate_survives_registering_again_with_another_claim():
    p = _planner("sliding")
    p.observe("d1", 2, 1001.0, transfer_s=1000.0, compute_s=0.5)
    measured = p.devices.measured_rate("d1")
    p.devices.register(RegisterRequest(device_id="d1", shard=1, num_samples=100,
                                       profile=DeviceProfileMsg(flops=1e9, rate=1.0)))
    assert p.devices.measured_rate("d1") == measured and p.devices.link_rate("d1") == measured


@pytest.mark.parametrize("mode", ["zero", "fixed"])
def test_the_mode_is_compared_by_value(mode):
    # A mode read from a config file is a new string object, not the interned literal.
    read = "".join(list(mode))
    assert read is not mode
    assert _planner(read).choose(1, DEVICES) == _planner(mode).choose(1, DEVICES)   # not the warm-up's j = 0


def test_fixed_mode_takes_the_last_candidate_of_any_count():
    p = _planner("fixed")
    for count in (2, 1):   # the cnn has three candidates; the last index is count - 1 for any count
        p.split_points = p.split_points[:count]
        assert p.choose(1, ["d0"]) == {"d0": (count - 1, p.split_points[count - 1])}


def test_the_measured_rate_follows_a_changed_link_and_averages_noise():
    p = _planner("sliding", smoothing=0.5)
    moved = p.terms("d1", 2)[0]
    p.observe("d1", 2, 3.0, transfer_s=2.0, compute_s=0.5)
    assert p.devices.measured_rate("d1") == pytest.approx(moved / 2.0)
    p.observe("d1", 2, 3.4, transfer_s=2.4, compute_s=0.5)   # 1.2x: noise, averaged into the cell's 2.2 s
    assert p.devices.measured_rate("d1") == pytest.approx(moved / 2.2)
    p.observe("d1", 2, 23.0, transfer_s=22.0, compute_s=0.5)  # ten times slower: the rate follows at once
    assert p.devices.measured_rate("d1") == pytest.approx(moved / 22.0)


def test_a_cut_attempt_lowers_the_measured_rate_with_the_link_level():
    p = _planner("sliding")
    moved = p.terms("d1", 2)[0]
    p.observe("d1", 2, 3.0, transfer_s=2.0, compute_s=0.5)
    p.censor("d1", 2, 12.0)           # cut after 12 s: its link level rises (12 - 0.5 - 0.5) / 2 = 5.5 times
    assert p.table.get("d1", 2) == pytest.approx(12.0)
    assert p.devices.measured_rate("d1") == pytest.approx(moved / 2.0 / 5.5)
    p.censor("d1", 2, 4.0)            # a shorter cut teaches nothing more
    assert p.devices.measured_rate("d1") == pytest.approx(moved / 2.0 / 5.5)


def test_eq1_terms_scale_an_untried_candidate_from_the_measured_one():
    p = _planner("sliding")
    cost = p.profile.cost(p.split_points[1])
    assert p.terms("d0", 1) == pytest.approx((2 * cost.client_param_bytes + 2 * 100 * cost.activation_bytes,
                                              cost.client_flops * 100, cost.server_flops * 100))
    assert all(math.isnan(t) for t in p.terms("gone", 1))
    p.observe("d0", 0, 6.0, transfer_s=3.0, compute_s=2.0)
    (b0, c0, s0), (b2, c2, s2) = p.terms("d0", 0), p.terms("d0", 2)
    assert p.table.row("d0", terms=p.terms)[2] == pytest.approx(3.0 * b2 / b0 + 2.0 * c2 / c0 + 1.0 * s2 / s0)


@pytest.mark.parametrize("mode", ["sliding", "fixed"])
def test_a_pinned_device_keeps_its_split_point_whatever_the_mode_chooses(mode):
    p = _planner(mode, pinned={"d0": 2})
    for round_index in (1, 2, 5):
        chosen = p.choose(round_index, DEVICES)
        assert chosen["d0"] == (p.split_points.index(2), 2)
    assert p.choose(1, ["d1"]) == _planner(mode).choose(1, ["d1"])


# --- edges the mutation tests found unguarded ----------------------------------------------------

def test_a_u_shaped_cut_prices_the_middle_on_the_server_and_the_head_on_the_device():
    split_points, num_blocks, profile = _cnn()
    head_start = split_points[-1]
    p = _planner("sliding", head_start=head_start)
    cut, head = profile.cost(split_points[0]), profile.cost(head_start)
    view = p._view(0)
    assert view.server_flops == cut.server_flops - head.server_flops
    assert (view.head_flops, view.head_param_bytes, view.head_activation_bytes) == (
        head.server_flops, head.server_param_bytes, head.activation_bytes)


def test_a_round_without_transfer_time_leaves_the_measured_rate_alone():
    p = _planner("sliding")
    p.observe("d0", 0, 2.0, 0.0, 1.0)
    assert p.devices.measured_rate("d0") is None


def test_a_censored_attempt_lowers_the_measured_rate_by_the_factor_its_link_level_rose():
    p = _planner("sliding")
    p.observe("d0", 0, 2.0, 1.0, 0.5)
    rate = p.devices.measured_rate("d0")
    assert rate is not None
    factor = p.table.censor("d1", 0, 1.0)   # d1 was never measured: no level to raise, no rate
    assert factor == 1.0 and p.devices.measured_rate("d1") is None
    p.censor("d1", 0, 30.0)
    assert p.devices.measured_rate("d1") is None
    p.table.record("d2", 0, 2.0, 1.0, 0.5)   # measured, but no rate of its own yet
    p.censor("d2", 0, 2.8)
    assert p.devices.measured_rate("d2") is None
    p.censor("d0", 0, 2.8)   # the cell read 2 s, 1 of them transfer: the link is 1.8x slower
    assert p.devices.measured_rate("d0") == pytest.approx(rate / 1.8, rel=1e-12)
