"""How often a registered device may register again.

Registering again is how an agent that restarted, or whose Fed Server restarted, gets a new token;
it happens once per restart. A device that registers again in a loop gains nothing (its penalties
and measurements are kept by device id), but each registration draws a token, writes a log line
and wakes the round driver. So a known device that registers again sooner than
``deadlines.reregistration_s`` after its last registration is refused with 429 and a
``Retry-After`` saying when it may (:class:`shared.errors.TooSoon`), which the agent honours; a
refusal changes nothing.

A client that ignores the ``Retry-After`` and asks again at once would still cost the Fed Server a
request's parsing and answer each time, thousands a second. So the Fed Server holds each such
answer for :data:`REFUSAL_HOLD_S` (at most the ``Retry-After`` itself) before sending it: a client
that waits for its answers, as every HTTP client does on one connection, sends at most one
registration a second per connection. A held answer is an idle coroutine, no thread and no CPU; what
bounds the held answers is how many connections a client can open (the operating system's limit on
open files).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from shared.errors import TooSoon

#: The longest the Fed Server holds a 429 answer to a registration before sending it.
REFUSAL_HOLD_S = 1.0


class Reregistrations:
    """The last registration of each device id, and the rule that refuses one too soon after it."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        """``interval_s``: the least time between two registrations of one device (0: no limit)."""
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}

    def check(self, device_id: str) -> None:
        """:class:`TooSoon` when ``device_id`` registered less than the interval ago."""
        last = self._last.get(device_id)
        if last is None or self.interval_s == 0:
            return
        wait = last + self.interval_s - self._clock()
        if wait > 0:
            raise TooSoon(f"device {device_id!r} registered {self.interval_s - wait:.1f} s ago: a device may register "
                          f"again once every {self.interval_s:g} s (deadlines.reregistration_s); retry in "
                          f"{wait:.1f} s", retry_after_s=wait)

    def registered(self, device_id: str) -> None:
        """``device_id`` registered just now."""
        self._last[device_id] = self._clock()

    def forget(self, device_id: str) -> None:
        """``device_id``'s registration was taken away (its credential revoked): whoever the
        operator issues its next credential to registers it at once."""
        self._last.pop(device_id, None)


def hold_for(refusals: Iterable[TooSoon]) -> float:
    """How long to hold an answer made only of ``refusals``: :data:`REFUSAL_HOLD_S`, or less where
    a refused device may register sooner; each refusal's ``retry_after_s`` is shortened by it, so
    the ``Retry-After`` sent counts from the answer, not from the refusal. Nothing to hold: 0."""
    refusals = list(refusals)
    hold = min([REFUSAL_HOLD_S, *(r.retry_after_s for r in refusals)]) if refusals else 0.0
    for refusal in refusals:
        refusal.retry_after_s -= hold
    return max(hold, 0.0)
