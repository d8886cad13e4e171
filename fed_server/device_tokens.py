"""The device tokens this Fed Server issued, by token: who is calling, known before a body is read.

A device token is an HMAC of the run, the device id and its enrolment's nonce (shared/auth.py):
it does not name its device, and an upload's device id is in its body, up to 512 MiB. Kept by
token, the device is known from the header alone, so a request carrying no token, a token this
server never issued or one revoked by a later enrolment is refused before its body is read.
Each device's current token and the one it replaced are kept (the replaced one to say "revoked"
rather than "unknown"); older ones are forgotten, so the table does not grow with re-enrolments.
"""
from __future__ import annotations


class DeviceTokens:
    """Token -> (device id, whether it is the device's current token)."""

    def __init__(self) -> None:
        self._by_token: dict[str, tuple[str, bool]] = {}
        self._latest: dict[str, list[str]] = {}   # device -> [replaced token?, current token]

    def issued(self, device_id: str, token: str) -> None:
        """``token`` is now ``device_id``'s; its previous one is revoked, older ones forgotten."""
        history = self._latest.setdefault(device_id, [])
        for old in history[:-1]:
            self._by_token.pop(old, None)
        if history:
            self._by_token[history[-1]] = (device_id, False)
        self._latest[device_id] = [*history[-1:], token]
        self._by_token[token] = (device_id, True)

    def forget(self, device_id: str) -> None:
        """``device_id`` is no longer registered: none of its tokens is known any more."""
        for token in self._latest.pop(device_id, []):
            self._by_token.pop(token, None)

    def holder(self, token: str) -> tuple[str, bool] | None:
        """(device id, current) of a token this server issued and still knows; None otherwise."""
        return self._by_token.get(token)
