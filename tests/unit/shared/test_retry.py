"""The shared retry-with-backoff helper: schedule, what it retries, what it lets through."""
from __future__ import annotations

import asyncio

import pytest

import shared.retry as retry_module
from shared.retry import Backoff, retry, retry_async


class Flaky:
    """Fails with ``exc`` the first ``failures`` calls, then returns how many calls it took."""

    def __init__(self, failures: int, exc: type[BaseException] = ConnectionError) -> None:
        self.failures = failures
        self.exc = exc
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.exc(f"failure {self.calls}")
        return self.calls


def test_delays_grow_by_the_factor_up_to_the_cap():
    assert list(Backoff(attempts=5, first_delay_s=0.5).delays()) == [0.5, 1.0, 2.0, 4.0]
    assert list(Backoff(attempts=4, first_delay_s=1, factor=3, max_delay_s=5).delays()) == [1, 3, 5]
    assert list(Backoff(attempts=1, first_delay_s=1).delays()) == []
    with pytest.raises(ValueError):
        Backoff(attempts=0, first_delay_s=1)


def test_retry_recovers_and_sleeps_the_schedule_between_attempts():
    slept: list[float] = []
    call = Flaky(failures=2)
    assert retry(call, Backoff(attempts=4, first_delay_s=0.2), (ConnectionError,), "test", sleep=slept.append) == 3
    assert slept == [0.2, 0.4]


def test_retry_raises_the_last_failure_after_every_attempt():
    slept: list[float] = []
    call = Flaky(failures=10)
    with pytest.raises(ConnectionError, match="failure 3"):
        retry(call, Backoff(attempts=3, first_delay_s=0.1), (ConnectionError,), "test", sleep=slept.append)
    assert call.calls == 3 and slept == [0.1, 0.2]


def test_retry_lets_other_exceptions_through_at_once():
    call = Flaky(failures=1, exc=KeyError)
    with pytest.raises(KeyError):
        retry(call, Backoff(attempts=5, first_delay_s=0.1), (ConnectionError,), "test", sleep=lambda s: None)
    assert call.calls == 1


def test_retry_async_follows_the_same_schedule(monkeypatch):
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(retry_module.asyncio, "sleep", fake_sleep)
    flaky = Flaky(failures=2)

    async def call() -> int:
        return flaky()

    backoff = Backoff(attempts=3, first_delay_s=0.5)
    assert asyncio.run(retry_async(call, backoff, (ConnectionError,), "test")) == 3
    assert slept == [0.5, 1.0]
    failing = Flaky(failures=5)

    async def never() -> int:
        return failing()

    with pytest.raises(ConnectionError, match="failure 3"):
        asyncio.run(retry_async(never, backoff, (ConnectionError,), "test"))
