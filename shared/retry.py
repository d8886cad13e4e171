"""Retry with exponential backoff: the one policy every outbound call of the project uses.

Callers: the device agents' HTTP client (connection failures), the Fed Server sending a round
plan, the Main Server uploading a group's server portion. The servers retry on their event loop
(``retry_async``), since a sleeping worker thread would hold up the Main Server's group training
(which runs in the default thread pool); the agents retry in their device threads (``retry``).
Both follow the same :class:`Backoff` schedule.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger("shared.retry")


@dataclass(frozen=True)
class Backoff:
    """``attempts`` tries in all; the first retry waits ``first_delay_s``, each next one
    ``factor`` times longer, capped at ``max_delay_s``."""

    attempts: int
    first_delay_s: float
    factor: float = 2.0
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_delay_s < 0 or self.factor < 1:
            raise ValueError(f"bad backoff {self}: needs attempts >= 1, first_delay_s >= 0, factor >= 1")

    def delays(self) -> Iterator[float]:
        """The waits between consecutive attempts (``attempts - 1`` of them)."""
        delay = self.first_delay_s
        for _ in range(self.attempts - 1):
            yield min(delay, self.max_delay_s)
            delay *= self.factor


def _note(what: str, exc: BaseException, attempt: int, backoff: Backoff, delay: float) -> None:
    log.warning("%s failed (%s), attempt %d of %d; retrying in %.1fs", what, exc, attempt, backoff.attempts, delay)


def retry(call: Callable[[], T], backoff: Backoff, retry_on: tuple[type[BaseException], ...], what: str,
          sleep: Callable[[float], object] = time.sleep) -> T:
    """``call()`` until it returns, retrying on ``retry_on`` per ``backoff``; the last attempt's
    failure (or any other exception) reaches the caller."""
    for attempt, delay in enumerate(backoff.delays(), start=1):
        try:
            return call()
        except retry_on as exc:
            _note(what, exc, attempt, backoff, delay)
            sleep(delay)
    return call()


async def retry_async(call: Callable[[], Awaitable[T]], backoff: Backoff, retry_on: tuple[type[BaseException], ...],
                      what: str) -> T:
    """:func:`retry` for coroutines: waits with ``asyncio.sleep`` so the event loop keeps serving."""
    for attempt, delay in enumerate(backoff.delays(), start=1):
        try:
            return await call()
        except retry_on as exc:
            _note(what, exc, attempt, backoff, delay)
            await asyncio.sleep(delay)
    return await call()
