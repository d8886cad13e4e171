"""The error every service layer raises for a 4xx/5xx answer (no web framework needed to import it)."""
from __future__ import annotations


class ApiError(Exception):
    """An error answer: HTTP status and a reason for the caller."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
