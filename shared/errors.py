"""Domain errors: what the logic objects raise when a request cannot be honoured.

The logic (coordinator, Main Server round state, device registry, auth checks, algorithms) knows
nothing of HTTP. It raises one of these; the services' HTTP layer (``http_api/server.py``,
installed by each ``app.py``) maps the class to a status code. A new kind of refusal is a new
subclass here plus one line in that map.
"""
from __future__ import annotations


class DomainError(Exception):
    """A request the logic refuses; ``detail`` is the reason shown to the caller."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class Invalid(DomainError):
    """The request is well-formed but its content does not fit (shapes, ranges, values)."""


class NotFound(DomainError):
    """The request names something that does not exist (an unknown device, a non-participant)."""


class NotAllowed(DomainError):
    """The caller is known but may not do this (a device that was not selected)."""


class Unauthenticated(DomainError):
    """Missing or wrong credentials."""


class Conflict(DomainError):
    """The request does not fit the current state (stale round, duplicate, out of order)."""


class TooSoon(DomainError):
    """The caller asks again sooner than the server allows (a device registering again in a loop);
    it may retry after ``retry_after_s`` seconds."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class Failed(DomainError):
    """The server could not carry out a valid request (server-side training raised)."""
