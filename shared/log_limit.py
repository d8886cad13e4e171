"""Repeated log lines, written once per window with a count.

Some log lines are one per request: a device registering again, a refused upload. A device that
repeats the request in a loop would then decide how much the server's log writes (megabytes a
minute). :class:`RepeatLimiter` lets the first of identical lines through and holds back the
repeats that follow within ``window_s``; the next one after the window goes out with how many were
held back (``(and 212 more like it in the last 60 s)``). Lines differ by what they say, so one
device's loop is folded while every other device's lines go out as before.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

#: How long identical lines are folded into one.
WINDOW_S = 60.0
#: Distinct lines remembered; the oldest is forgotten first (its repeats then go out again).
REMEMBERED = 4096


class RepeatLimiter(logging.Filter):
    """A filter for a handler: identical messages (same logger, level and text) pass once per
    ``window_s``, the first after the window carrying the count of those held back."""

    def __init__(self, window_s: float = WINDOW_S, remembered: int = REMEMBERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.remembered = remembered
        self._clock = clock
        # line -> (when it last went out, repeats held back since)
        self._seen: OrderedDict[tuple[str, int, str], tuple[float, int]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = self._clock()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.window_s:
            self._seen[key] = (seen[0], seen[1] + 1)
            return False
        if seen is not None and seen[1]:
            record.msg = f"{record.getMessage()} (and {seen[1]} more like it in the last {now - seen[0]:.0f} s)"
            record.args = None
        self._seen[key] = (now, 0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.remembered:
            self._seen.popitem(last=False)
        return True


def limit_repeats(logger: logging.Logger | None = None, window_s: float = WINDOW_S) -> None:
    """Fold repeated lines in every handler of ``logger`` (the root logger by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RepeatLimiter) for f in handler.filters):
            handler.addFilter(RepeatLimiter(window_s))
