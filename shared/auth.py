"""Who may call what: enrolment, per-device tokens, and the two servers' mutual authentication.

- A device enrols (``POST /v1/devices/register``) by presenting the deployment's enrolment
  secret in ``X-Enrolment-Secret``; the Fed Server answers with a fresh per-device token. Every
  enrolment draws a new random *token nonce* for the device, which revokes the token issued
  before (so an agent that restarted, and lost its token, enrols again and the dead process's
  token stops working).
- The token is ``HMAC-SHA256(service secret, "device:<run id>:<device id>:<nonce>")``: bound to
  the device, to the run and to that enrolment. The Fed Server keeps each device's current nonce;
  the Main Server has no registry of its own and learns it from the round plan (each
  ``Participant.token_nonce``), so it checks tokens without asking the Fed Server, and a revoked
  token is refused there from the next plan on. Every device call carries
  ``Authorization: Bearer <token>``.
- The Fed Server and the Main Server share the service secret and call each other with
  ``HMAC(service secret, "service")`` (the secret itself never travels).

Secrets come from files or environment variables, never from code. With no service secret the
servers run open (the local testbed's default is to generate secrets; see docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from shared.errors import NotAllowed, Unauthenticated


def warn_if_open(auth: "Auth", service: str, exposure: str) -> bool:
    """At a server's start: log a WARNING when it runs without a service secret, saying what
    anyone who can reach it may then do (``exposure``) and how to set the secret. One function for
    both servers, so they say it the same way. Returns whether it warned."""
    if auth.enabled:
        return False
    logging.getLogger(service).warning(
        "no service secret: requests are not authenticated, so anyone who can reach this server can %s. "
        "Set --service-secret-file FILE or SFL_SERVICE_SECRET (the same secret on the Fed Server and the "
        "Main Server; docs/security.md)", exposure)
    return True


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

    def device_token(self, run_id: str, device_id: str, nonce: str) -> str:
        """The bearer token of ``device_id``'s enrolment ``nonce`` in run ``run_id``."""
        assert self.service_secret is not None
        message = f"device:{run_id}:{device_id}:{nonce}".encode()
        return hmac.new(self.service_secret, message, hashlib.sha256).hexdigest()

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

    def check_device(self, headers, run_id: str, device_id: str, nonce: str | None) -> None:
        """The caller must hold ``device_id``'s current token in this run (not another device's,
        another run's, or one revoked by a later enrolment). ``nonce`` is the device's current
        enrolment nonce; ``None`` (no current enrolment known here) refuses every token."""
        if not self.enabled:
            return
        token = _bearer(headers)
        if token is None:
            raise Unauthenticated("missing device token: send Authorization: Bearer <token from registration>")
        if nonce is None or not hmac.compare_digest(token, self.device_token(run_id, device_id, nonce)):
            raise NotAllowed(f"the token is not the current token of device {device_id!r} in run {run_id!r}")

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
