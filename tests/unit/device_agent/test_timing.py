"""The device's round clock: what a transfer costs on an emulated link and on a real one."""
from __future__ import annotations

import threading
import time

import pytest

from device_agent.task_expired import TaskExpired
from device_agent.timing import RoundClock
from shared.http_client import Cancellation
from shared.profiles import parse_kind


def test_an_emulated_link_sleeps_and_charges_the_kinds_delay_beside_what_was_measured():
    clock = RoundClock(parse_kind("low"), time_scale=10.0)   # 1e6 B/s compressed 10x: 1e7 B/s
    started = time.monotonic()
    clock.transfer(2_000_000, measured_s=0.05)
    assert time.monotonic() - started >= 0.2
    assert clock.transfer_s == pytest.approx(0.05 + 0.2)


def test_an_emulated_transfer_stops_when_the_attempt_is_closed_without_the_device():
    taken_out = Cancellation()
    clock = RoundClock(parse_kind("low"), time_scale=1.0, taken_out=taken_out)   # 1e6 B/s
    clock.transfer(100_000)   # 0.1 s, not interrupted
    assert clock.transfer_s == pytest.approx(0.1)
    threading.Timer(0.2, taken_out.set).start()
    started = time.monotonic()
    with pytest.raises(TaskExpired, match="closed the task's attempt during an emulated transfer of 60,000,000 bytes"):
        clock.transfer(60_000_000)   # 60 s, given up when the event is set
    assert time.monotonic() - started < 30
    assert clock.transfer_s == pytest.approx(0.1)   # what was given up is not charged


def test_an_emulated_compute_stretch_stops_when_the_attempt_is_closed_without_the_device():
    taken_out = Cancellation()
    clock = RoundClock(parse_kind("low"), taken_out=taken_out)   # Low's compute stretch is over 1
    threading.Timer(0.2, taken_out.set).start()
    started = time.monotonic()
    with pytest.raises(TaskExpired, match="closed the task's attempt during an emulated compute stretch"):
        clock.computed(60.0 / (clock.stretch_factor() - 1.0), 0.0)   # a stretch of 60 s
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("kind", ["low", None])
def test_a_real_link_charges_only_what_was_measured(kind):
    # --links real (a shaped link as slow as the kind) or a real device: nothing is slept.
    clock = RoundClock(parse_kind(kind) if kind else None, time_scale=10.0, emulate_links=False)
    started = time.monotonic()
    clock.transfer(2_000_000, measured_s=0.3)
    clock.transfer(1_000, measured_s=-1.0)   # a clock that stepped back counts as nothing
    assert time.monotonic() - started < 0.1
    assert clock.transfer_s == pytest.approx(0.3)


def test_a_real_link_still_stretches_an_emulated_kinds_compute():
    clock = RoundClock(parse_kind("low"), emulate_links=False)   # Low: 10x the server's compute time
    started = time.monotonic()
    clock.computed(wall_s=0.02, cpu_s=0.02)
    assert time.monotonic() - started >= 0.18
    assert clock.compute_s == pytest.approx(0.2)
