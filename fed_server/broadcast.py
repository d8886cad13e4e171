"""A broadcast on the event loop: every waiter wakes at each post, and an answer held for a change
(long-poll) is computed again when one is posted.

The Fed Server holds two kinds of answers this way: a device's task (``wait`` until work is
posted for it) and the run's status (until a new round record is written, the run finishes or its
driver fails). Both wake on an event, never on a timer. When the server stops, :meth:`Broadcast.close`
answers every held request as it stands, so that the shutdown does not wait for a hold to end.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Broadcast:
    """Wakes everything waiting on it at once, each time it is posted. Use on one event loop."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._closed = False

    def post(self) -> None:
        """Wake every current waiter; later waiters wait for the next post."""
        posted, self._event = self._event, asyncio.Event()
        posted.set()

    def close(self) -> None:
        """The server is stopping: every held answer, and every later one, is given as it stands."""
        self._closed = True
        self.post()

    async def hold(self, answer: Callable[[], T], ready: Callable[[T], bool], wait_s: float) -> T:
        """``answer()`` once it is ``ready``, computed again after every post, or as it stands when
        ``wait_s`` seconds have passed, or at once once closed. Taking the current event and computing the answer happen
        without an ``await`` between them, so a post that lands while the answer is computed or
        handed back is never missed."""
        until = time.monotonic() + wait_s
        while True:
            posted = self._event
            value = answer()
            remaining = until - time.monotonic()
            if ready(value) or remaining <= 0 or self._closed:
                return value
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(posted.wait(), remaining)
