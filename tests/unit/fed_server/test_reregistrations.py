"""How often a registered device may register again (fed_server/reregistrations.py)."""
from __future__ import annotations

import pytest

from fed_server.reregistrations import REFUSAL_HOLD_S, Reregistrations, hold_for
from shared.errors import TooSoon


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_device_may_register_again_once_the_interval_has_passed():
    clock = Clock()
    limit = Reregistrations(10.0, clock)
    limit.check("d0")                      # never registered: no limit
    limit.registered("d0")
    clock.now += 4.0
    with pytest.raises(TooSoon, match=r"retry in 6\.0 s") as refused:
        limit.check("d0")
    assert refused.value.retry_after_s == pytest.approx(6.0)
    limit.check("d1")                      # another device is not limited by d0
    clock.now += 6.0
    limit.check("d0")


def test_a_refusal_does_not_move_the_time_a_device_may_register_again():
    clock = Clock()
    limit = Reregistrations(10.0, clock)
    limit.registered("d0")
    for _ in range(5):                     # a loop of refused attempts
        clock.now += 1.0
        with pytest.raises(TooSoon):
            limit.check("d0")
    clock.now += 5.0
    limit.check("d0")


def test_an_interval_of_zero_limits_nothing_and_a_negative_one_is_refused():
    limit = Reregistrations(0.0, Clock())
    limit.registered("d0")
    limit.check("d0")
    with pytest.raises(ValueError, match="interval_s"):
        Reregistrations(-1.0)


def test_a_forgotten_device_registers_at_once():
    limit = Reregistrations(10.0, Clock())
    limit.registered("d0")
    limit.forget("d0")
    limit.check("d0")


def test_a_refused_answer_is_held_for_the_hold_or_the_least_retry_after_and_the_retry_afters_count_from_it():
    late = TooSoon("too soon", retry_after_s=6.0)
    assert hold_for([late]) == REFUSAL_HOLD_S
    assert late.retry_after_s == pytest.approx(6.0 - REFUSAL_HOLD_S)
    nearly = [TooSoon("too soon", retry_after_s=0.25), TooSoon("too soon", retry_after_s=3.0)]
    assert hold_for(nearly) == pytest.approx(0.25)           # one of them may register in 0.25 s
    assert [r.retry_after_s for r in nearly] == pytest.approx([0.0, 2.75])
    assert hold_for([]) == 0.0
