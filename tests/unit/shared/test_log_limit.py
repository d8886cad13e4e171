"""Repeated log lines folded with a count (shared/log_limit.py)."""
from __future__ import annotations

import logging

from shared.log_limit import RepeatLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _record(msg: str, *args: object, name: str = "fed_server", level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_identical_lines_pass_once_per_window_and_the_next_carries_the_count():
    clock = Clock()
    limiter = RepeatLimiter(window_s=60.0, clock=clock)
    assert limiter.filter(_record("device %s enrolled again", "dev-001"))
    passed = []
    for _ in range(500):
        clock.now += 0.01
        passed.append(limiter.filter(_record("device %s enrolled again", "dev-001")))
    assert not any(passed)
    assert limiter.filter(_record("device %s enrolled again", "dev-002"))   # another device's line goes out
    clock.now = 61.0
    again = _record("device %s enrolled again", "dev-001")
    assert limiter.filter(again)
    assert again.getMessage() == "device dev-001 enrolled again (and 500 more like it in the last 61 s)"
    clock.now += 1.0
    assert not limiter.filter(_record("device %s enrolled again", "dev-001"))


def test_the_same_text_at_another_level_or_from_another_logger_is_another_line():
    limiter = RepeatLimiter(clock=Clock())
    assert limiter.filter(_record("x"))
    assert limiter.filter(_record("x", level=logging.ERROR))
    assert limiter.filter(_record("x", name="main_server"))
    assert not limiter.filter(_record("x"))


def test_it_remembers_a_bounded_number_of_lines():
    limiter = RepeatLimiter(remembered=3, clock=Clock())
    for text in ("a", "b", "c", "d"):
        assert limiter.filter(_record(text))
    assert limiter.filter(_record("a"))          # forgotten: goes out again
    assert not limiter.filter(_record("d"))
