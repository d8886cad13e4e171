"""Unit tests for shared.profiles: the nine device kinds of the paper's Table 1."""
from __future__ import annotations

import itertools

import pytest

from shared.profiles import (
    AUTO_TRANSFER_RATIO, FLOPS, RATES, SERVER_FLOPS, EmulatedKind, auto_time_scale, kind_for, parse_kind,
    parse_time_scale,
)

LEVELS = ["low", "mid", "high"]


@pytest.mark.parametrize("flops,rate", list(itertools.product(LEVELS, LEVELS)))
def test_parse_all_nine_kinds(flops, rate):
    kind = parse_kind(f"{flops}-{rate}")
    assert kind == EmulatedKind(f"{flops}-{rate}", FLOPS[flops], RATES[rate])


def test_nominal_values_are_table_1():
    assert parse_kind("low-low") == EmulatedKind("low-low", 5e9, 1e6)
    assert parse_kind("mid-mid") == EmulatedKind("mid-mid", 1e10, 2e6)
    assert parse_kind("high-high") == EmulatedKind("high-high", 2e10, 5e6)
    assert parse_kind("high-low").flops == 2e10 and parse_kind("high-low").rate == 1e6


@pytest.mark.parametrize("level", LEVELS)
def test_shorthand_means_same_level_twice(level):
    assert parse_kind(level) == parse_kind(f"{level}-{level}")
    assert parse_kind(level).name == f"{level}-{level}"


@pytest.mark.parametrize("text", [" HIGH ", "Mid-Low", "LOW-high\n"])
def test_case_and_whitespace_insensitive(text):
    assert parse_kind(text) == parse_kind(text.strip().lower())


@pytest.mark.parametrize(
    "text", ["", "-", "fast", "low-", "-low", "low-mid-high", "low_mid", "medium", "high-fast", "low--low"]
)
def test_parse_errors(text):
    with pytest.raises(ValueError, match="unknown device kind"):
        parse_kind(text)


def test_kind_for_round_robin():
    kinds = ["low", "mid-high", "high-low"]
    got = [kind_for(i, kinds).name for i in range(7)]
    assert got == ["low-low", "mid-high", "high-low", "low-low", "mid-high", "high-low", "low-low"]
    assert all(kind_for(i, ["mid"]).name == "mid-mid" for i in range(5))


def test_kind_for_propagates_parse_errors():
    with pytest.raises(ValueError):
        kind_for(1, ["high", "bogus"])
    assert kind_for(0, ["high", "bogus"]).name == "high-high"


@pytest.mark.parametrize("flops,stretch", [("low", 10.0), ("mid", 5.0), ("high", 2.5)])
def test_compute_stretch(flops, stretch):
    # stretch = server FLOPS (5e10, the machine plays the Main Server) / kind FLOPS
    for rate in LEVELS:
        kind = parse_kind(f"{flops}-{rate}")
        assert kind.compute_stretch == pytest.approx(stretch)
        assert kind.compute_stretch == SERVER_FLOPS / FLOPS[flops]


def test_compute_stretch_ratios_follow_table_1():
    """Whatever the reference speed, Low is 4x and Mid 2x slower than High, and all are >= 1."""
    high = parse_kind("high").compute_stretch
    assert parse_kind("low").compute_stretch == pytest.approx(4 * high)
    assert parse_kind("mid").compute_stretch == pytest.approx(2 * high)
    assert high >= 1.0


@pytest.mark.parametrize("rate,bps", [("low", 1e6), ("mid", 2e6), ("high", 5e6)])
def test_transfer_delay(rate, bps):
    kind = parse_kind(f"high-{rate}")
    assert kind.transfer_delay(0, 1.0) == 0.0
    assert kind.transfer_delay(1_000_000, 1.0) == pytest.approx(1e6 / bps)
    assert kind.transfer_delay(1_000_000, 10.0) == pytest.approx(1e6 / bps / 10)


def test_auto_time_scale_keeps_transfer_to_compute_ratio_on_any_host():
    # Emulated compute is the paper's time divided by host_flops / 5e10; transfer by time_scale.
    for host_flops in (5e9, 4e10, 1.25e11):
        scale = auto_time_scale(host_flops)
        assert scale == pytest.approx(AUTO_TRANSFER_RATIO * host_flops / SERVER_FLOPS)
        assert scale / (host_flops / SERVER_FLOPS) == pytest.approx(AUTO_TRANSFER_RATIO)
    assert auto_time_scale(3e11) == pytest.approx(3 * auto_time_scale(1e11))  # a 3x faster host: 3x shorter transfers


@pytest.mark.parametrize("host_flops", [0.0, -1.0, float("nan")])
def test_auto_time_scale_needs_a_measured_speed(host_flops):
    with pytest.raises(ValueError, match="FLOP/s must be > 0"):
        auto_time_scale(host_flops)


@pytest.mark.parametrize("text,value", [("auto", "auto"), (" AUTO ", "auto"), ("20", 20.0), ("0.5", 0.5), ("1e3", 1000.0)])
def test_parse_time_scale(text, value):
    assert parse_time_scale(text) == value


@pytest.mark.parametrize("text", ["", "fast", "0", "-1", "inf", "nan", "20x"])
def test_parse_time_scale_refuses(text):
    with pytest.raises(ValueError, match="time scale must be auto or a number > 0"):
        parse_time_scale(text)
