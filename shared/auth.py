"""Who may call what: enrolment, per-device tokens, and the two servers' mutual authentication.

- A device enrols (``POST /v1/devices/register``) by presenting the deployment's enrolment
  secret in ``X-Enrolment-Secret``; the Fed Server answers with its per-device token.
- The token is ``HMAC-SHA256(service secret, "device:" + device_id)``: bound to the device id, so
  one device's token is worthless for another, and the Main Server can check it without asking
  the Fed Server. Every device call carries it as ``Authorization: Bearer <token>``.
- The Fed Server and the Main Server share the service secret and call each other with
  ``HMAC(service secret, "service")`` (the secret itself never travels).

Secrets come from files or environment variables, never from code. With no service secret the
servers run open (the local testbed's default is to generate secrets; see docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from shared.errors import NotAllowed, Unauthenticated


def load_secret(file: str | None, env_var: str) -> bytes | None:
    """A secret from a file (its whole content, stripped) or an environment variable; None if neither."""
    if file:
        text = Path(file).read_text().strip()
        if not text:
            raise ValueError(f"secret file {file} is empty")
        return text.encode()
    value = os.environ.get(env_var)
    return value.encode() if value else None


def _bearer(headers) -> str | None:
    value = headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


@dataclass(frozen=True)
class Auth:
    """The checks one server applies. ``service_secret=None`` turns authentication off."""

    service_secret: bytes | None = None
    enrolment_secret: bytes | None = None

    @property
    def enabled(self) -> bool:
        return self.service_secret is not None

    def device_token(self, device_id: str) -> str:
        assert self.service_secret is not None
        return hmac.new(self.service_secret, f"device:{device_id}".encode(), hashlib.sha256).hexdigest()

    def service_token(self) -> str:
        assert self.service_secret is not None
        return hmac.new(self.service_secret, b"service", hashlib.sha256).hexdigest()

    def service_headers(self) -> dict[str, str]:
        """Headers for a server-to-server call."""
        return {"authorization": f"Bearer {self.service_token()}"} if self.enabled else {}

    def check_enrolment(self, headers) -> None:
        """A registering device must present the enrolment secret."""
        if not self.enabled:
            return
        given = headers.get("x-enrolment-secret", "")
        if self.enrolment_secret is None or not hmac.compare_digest(given.encode(), self.enrolment_secret):
            raise Unauthenticated("enrolment refused: a valid X-Enrolment-Secret header is required")

    def check_device(self, headers, device_id: str) -> None:
        """The caller must hold ``device_id``'s token (not just any device's)."""
        if not self.enabled:
            return
        token = _bearer(headers)
        if token is None:
            raise Unauthenticated("missing device token: send Authorization: Bearer <token from registration>")
        if not hmac.compare_digest(token, self.device_token(device_id)):
            raise NotAllowed(f"the token does not belong to device {device_id!r}")

    def check_service(self, headers) -> None:
        """Only the other server may call server-to-server endpoints."""
        if not self.enabled:
            return
        token = _bearer(headers)
        if token is None or not hmac.compare_digest(token, self.service_token()):
            raise Unauthenticated("server-to-server call without a valid service token")


def auth_from_settings(service_secret_file: str | None, enrolment_secret_file: str | None) -> Auth:
    """The servers' Auth from ``--service-secret-file`` / ``SFL_SERVICE_SECRET`` and
    ``--enrolment-secret-file`` / ``SFL_ENROLMENT_SECRET``."""
    return Auth(load_secret(service_secret_file, "SFL_SERVICE_SECRET"),
                load_secret(enrolment_secret_file, "SFL_ENROLMENT_SECRET"))
