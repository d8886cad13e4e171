"""Who may call what: enrolment, per-device tokens, and the two servers' mutual authentication.

- A device enrols (``POST /v1/devices/register``) by presenting, in ``X-Enrolment-Secret``,
  either its **enrolment credential** or the deployment's shared **enrolment secret**; the Fed
  Server answers with a fresh per-device token. Every enrolment draws a new random *token nonce*
  for the device, which revokes the token issued before (so an agent that restarted, and lost its
  token, enrols again and the dead process's token stops working).
- An enrolment credential is ``sfl-enrol-1:<scope>:<HMAC-SHA256(enrolment key, "enrol:<scope>")>``,
  issued by the operator (``python -m fed_server credentials issue``). The scope names the device
  ids it may register (``dev-a,dev-b``: any shard or slot) and shard ranges in the agent's naming
  (``dev/0-9``: ``dev-000`` .. ``dev-009``, each only on its own shard). The Fed Server keeps the
  enrolment key and no list of credentials: it verifies the MAC and reads the scope. The device
  registry records which credential holds each device, so one credential cannot take over a
  device held under another (fed_server/devices.py).
- The shared enrolment secret may register any device id; ``shared_max_devices`` caps how many.
- The token is ``HMAC-SHA256(service secret, "device:<run id>:<device id>:<nonce>")``: bound to
  the device, to the run and to that enrolment. The Fed Server keeps each device's current nonce;
  the Main Server has no registry of its own and learns it from the round plan (each
  ``Participant.token_nonce``), so it checks tokens without asking the Fed Server, and a revoked
  token is refused there from the next plan on. Every device call carries
  ``Authorization: Bearer <token>``.
- The Fed Server and the Main Server share the service secret and sign every call to each other
  (``shared.http_client.ServiceSigner``): an HMAC of the service secret over the receiving service, the method,
  the path and query, a timestamp, a random nonce and the body's SHA-256. The receiver
  (:meth:`Auth.check_service`) refuses a signature that is wrong, a timestamp more than
  :data:`SERVICE_REQUEST_WINDOW_S` from its own clock, a nonce it has already taken within that
  window (:class:`ReplayGuard`), and a body whose digest is not the signed one. A request
  captured on the wire is therefore refused when sent again, and cannot be turned into another
  (the secret itself never travels).

Secrets and keys come from files or environment variables, never from code. With no service
secret the servers run open (the local testbed's default is to generate secrets; see
docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path


from shared.errors import NotAllowed, Unauthenticated
from shared.ranges import consecutive_runs
from shared.schemas import _ID_PATTERN as DEVICE_ID_PATTERN


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
        try:
            text = Path(file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"secret file {file}: {exc.strerror}") from None
        if not text:
            raise ValueError(f"secret file {file} is empty")
        return text.encode()
    value = os.environ.get(env_var)
    return value.encode() if value else None


def bearer_token(headers) -> str | None:
    """The token of an ``Authorization: Bearer`` header; None without one."""
    value = headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def device_bearer_token(headers) -> str:
    """A device's token from its ``Authorization: Bearer`` header; Unauthenticated without one."""
    token = bearer_token(headers)
    if token is None:
        raise Unauthenticated("missing device token: send Authorization: Bearer <token from registration>")
    return token


#: How an enrolment credential begins: what tells it from the shared enrolment secret.
CREDENTIAL_PREFIX = "sfl-enrol-1:"
_RANGE = re.compile(r"(.+)/([0-9]{1,9})(?:-([0-9]{1,9}))?")
_SHARD_ID = re.compile(r"(.+)-([0-9]+)")


@dataclass(frozen=True)
class ShardRange:
    """Devices ``<prefix>-<shard as 3 digits>`` of shards ``first..last``, each only on its own
    shard: the ids a device agent gives the devices of ``--shards`` (device_agent/agent.py)."""

    prefix: str
    first: int
    last: int

    def shard_of(self, device_id: str) -> int | None:
        """The shard ``device_id`` is bound to in this range; None when the range does not name it."""
        match = _SHARD_ID.fullmatch(device_id)
        if match is None or match.group(1) != self.prefix:
            return None
        shard = int(match.group(2))
        return shard if self.first <= shard <= self.last and device_id == f"{self.prefix}-{shard:03d}" else None

    def __str__(self) -> str:
        return f"{self.prefix}/{self.first}" + (f"-{self.last}" if self.last != self.first else "")

    def describe(self) -> str:
        if self.first == self.last:
            return f"{self.prefix}-{self.first:03d} (shard {self.first})"
        return f"{self.prefix}-{self.first:03d}..{self.prefix}-{self.last:03d} (shards {self.first}-{self.last})"


def shard_ranges(prefix: str, shards: list[int]) -> tuple[ShardRange, ...]:
    """The devices of ``shards`` (named with ``prefix``) as the fewest ranges of consecutive shards."""
    return tuple(ShardRange(prefix, first, last) for first, last in consecutive_runs(sorted(shards)))


@dataclass(frozen=True)
class CredentialScope:
    """The devices one enrolment credential may register: named ids (on any shard or slot) and
    shard ranges (each id on its own shard), and the credential's serial number. Written
    ``dev-a,dev-b,dev/0-9``, and ``dev-a@2`` from serial 2 on: a credential issued again
    after a revocation differs from the revoked one, so the revocation list can name the old one."""

    ids: tuple[str, ...] = ()
    ranges: tuple[ShardRange, ...] = ()
    serial: int = 1

    @classmethod
    def parse(cls, text: str) -> "CredentialScope":
        """The scope written ``text``; ValueError when it is not one."""
        ids: list[str] = []
        ranges: list[ShardRange] = []
        text, at, number = text.partition("@")
        serial = 1
        if at:
            if not re.fullmatch(r"[1-9][0-9]{0,8}", number) or number == "1":
                raise ValueError(f"bad serial number {number!r}: @2, @3, ... (serial 1 is written without one)")
            serial = int(number)
        for entry in text.split(","):
            match = _RANGE.fullmatch(entry)
            if match is not None and re.fullmatch(DEVICE_ID_PATTERN, match.group(1)):
                first = int(match.group(2))
                last = int(match.group(3) if match.group(3) is not None else first)
                if last < first:
                    raise ValueError(f"bad shard range {entry!r}: the first shard is above the last")
                ranges.append(ShardRange(match.group(1), first, last))
            elif re.fullmatch(DEVICE_ID_PATTERN, entry):
                ids.append(entry)
            else:
                raise ValueError(f"bad scope entry {entry!r}: a device id or <prefix>/<shard>[-<shard>]")
        return cls(tuple(ids), tuple(ranges), serial)

    def __str__(self) -> str:
        return ",".join([*self.ids, *(str(r) for r in self.ranges)]) + (f"@{self.serial}" if self.serial > 1 else "")

    def describe(self) -> str:
        """The devices covered, for messages: ``devices dev-a, dev-000..dev-009 (shards 0-9)``."""
        return "devices " + ", ".join([*self.ids, *(r.describe() for r in self.ranges)])

    def check(self, device_id: str, shard: int | None) -> None:
        """Refuse (NotAllowed) a registration of ``device_id`` on ``shard`` this scope does not cover."""
        if device_id in self.ids:
            return
        bound = [s for s in (r.shard_of(device_id) for r in self.ranges) if s is not None]
        if not bound:
            raise NotAllowed(f"this enrolment credential covers {self.describe()}: it cannot register "
                             f"device {device_id!r}")
        if shard not in bound:
            raise NotAllowed(f"this enrolment credential covers device {device_id!r} on shard {bound[0]} only, "
                             f"not {'without a shard' if shard is None else f'on shard {shard}'}")


def issue_credential(key: bytes, scope: CredentialScope) -> str:
    """The enrolment credential for ``scope`` under the deployment's enrolment ``key``. The same
    key and scope always give the same credential, so the Fed Server needs only the key."""
    return f"{CREDENTIAL_PREFIX}{scope}:{_credential_mac(key, str(scope))}"


def _credential_mac(key: bytes, scope: str) -> str:
    return hmac.new(key, f"enrol:{scope}".encode(), hashlib.sha256).hexdigest()


def credential_id(text: str) -> str:
    """What names a credential in a revocation list: its scope and serial (``dev/7``,
    ``cam-a,cam-b@2``), from the scope itself or from a whole credential; ValueError otherwise.
    It carries nothing secret."""
    text = text.strip()
    if text.startswith(CREDENTIAL_PREFIX):
        text = text[len(CREDENTIAL_PREFIX):].rpartition(":")[0]
    return str(CredentialScope.parse(text))


def load_revoked_credentials(path: str | None) -> frozenset[str]:
    """The credential ids the file at ``path`` revokes (:func:`credential_id` per line; blank
    lines and lines starting with ``#`` skipped); none without a file. ValueError naming the file
    and line for anything else, or for a file that cannot be read."""
    if path is None:
        return frozenset()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"revoked credentials file {path}: {exc.strerror}") from exc
    revoked = set()
    for number, line in enumerate(lines, 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                revoked.add(credential_id(line))
            except ValueError as exc:
                raise ValueError(f"revoked credentials file {path}, line {number}: {exc}") from exc
    return frozenset(revoked)


class RevocationList:
    """The revoked enrolment credentials' ids (:func:`credential_id`), read from the operator's
    file (``--revoked-credentials-file``) at start and again by :meth:`reload` (the Fed Server on
    SIGHUP), so a revocation applies without a restart. The file is the list: a line taken out of
    it lifts that revocation at the next reload."""

    def __init__(self, path: str | None = None, ids: Iterable[str] = ()) -> None:
        self.path = path
        self._ids = frozenset(ids) | load_revoked_credentials(path)

    def __contains__(self, credential: object) -> bool:
        return credential in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)

    def reload(self) -> frozenset[str]:
        """Read the file again; the ids it revokes that the list did not. ValueError (naming the
        file and line), keeping the list as it was, for a file that cannot be read or parsed."""
        ids = load_revoked_credentials(self.path)
        new, self._ids = ids - self._ids, ids
        return new


def credential_holder(credential: str) -> str:
    """Who holds the devices a credential registered, in the device registry (:class:`Enrolment`),
    by the credential's id: a revocation finds them by it."""
    return f"credential {credential}"


#: Who holds the devices registered with the shared enrolment secret (fed_server/devices.py).
SHARED_SECRET_HOLDER = "the shared enrolment secret"


@dataclass(frozen=True)
class Enrolment:
    """What a registration presented, once it is verified: who holds the devices it registers
    (the device registry keeps it, and refuses a device held by another holder), what it may
    register (``scope``; None: any device id) and how many (``max_devices``; None: no cap)."""

    holder: str
    scope: CredentialScope | None = None
    max_devices: int | None = None

    def check_scope(self, device_id: str, shard: int | None) -> None:
        """Refuse (NotAllowed) a device this enrolment may not register."""
        if self.scope is not None:
            self.scope.check(device_id, shard)


#: The scheme of a signed server-to-server request's ``Authorization`` header.
SERVICE_SCHEME = "SFL-HMAC-SHA256"
TIMESTAMP_HEADER = "x-sfl-timestamp"
NONCE_HEADER = "x-sfl-nonce"
DIGEST_HEADER = "x-sfl-content-sha256"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: How far a signed request's timestamp may be from the receiver's clock, either way (seconds): the
#: servers' clocks must agree this well (NTP does). A nonce is remembered this long after its
#: timestamp, so a request is refused when replayed within the window and for its age after it.
SERVICE_REQUEST_WINDOW_S = 60.0
#: Service names a signed request is addressed to: a request to one cannot be replayed to the other.
FED_SERVER = "fed_server"
MAIN_SERVER = "main_server"


@dataclass(frozen=True)
class Auth:
    """The checks one server applies. ``service_secret=None`` turns authentication off."""

    service_secret: bytes | None = None
    #: The shared enrolment secret (any device id), None when devices need credentials.
    enrolment_secret: bytes | None = None
    #: The key enrolment credentials are issued with; None when only the shared secret enrols.
    enrolment_key: bytes | None = None
    #: At most this many devices registered with the shared enrolment secret (None: no cap).
    shared_max_devices: int | None = None
    #: Revoked enrolment credentials: refused as if forged.
    revoked_credentials: RevocationList = field(default_factory=RevocationList)
    #: The nonces of the server-to-server requests taken recently (:meth:`check_service`).
    replay_guard: "ReplayGuard" = field(default_factory=lambda: ReplayGuard())

    @property
    def enabled(self) -> bool:
        return self.service_secret is not None

    def device_token(self, run_id: str, device_id: str, nonce: str) -> str:
        """The bearer token of ``device_id``'s enrolment ``nonce`` in run ``run_id``."""
        assert self.service_secret is not None
        message = f"device:{run_id}:{device_id}:{nonce}".encode()
        return hmac.new(self.service_secret, message, hashlib.sha256).hexdigest()

    def sign_service_request(self, audience: str, method: str, target: str, body_sha256: str = EMPTY_SHA256,
                             now: float | None = None) -> dict[str, str]:
        """Headers that authenticate one server-to-server request to ``audience`` (the service
        that receives it): ``method`` and ``target`` (path and query, as sent) with a fresh
        timestamp and nonce, over a body whose SHA-256 is ``body_sha256`` (hex)."""
        assert self.service_secret is not None
        timestamp = f"{time.time() if now is None else now:.3f}"
        nonce = secrets.token_hex(16)
        mac = _service_mac(self.service_secret, audience, method, target, timestamp, nonce, body_sha256)
        return {"authorization": f"{SERVICE_SCHEME} {mac}", TIMESTAMP_HEADER: timestamp, NONCE_HEADER: nonce,
                DIGEST_HEADER: body_sha256}

    def check_service(self, audience: str, method: str, target: str, headers) -> str | None:
        """Only the other server may call server-to-server endpoints, and each of its requests only
        once: the signature of :meth:`sign_service_request` for this service (``audience``), this
        ``method`` and ``target``, a timestamp within :data:`SERVICE_REQUEST_WINDOW_S` of this
        server's clock, a nonce not taken before (Unauthenticated otherwise). Returns the signed
        body digest, which the body read afterwards must match (:func:`check_body_digest`); None
        on an open server."""
        if not self.enabled:
            return None
        assert self.service_secret is not None
        scheme, _, mac = headers.get("authorization", "").partition(" ")
        timestamp, nonce = headers.get(TIMESTAMP_HEADER, ""), headers.get(NONCE_HEADER, "")
        digest = headers.get(DIGEST_HEADER, EMPTY_SHA256)
        if scheme != SERVICE_SCHEME or not mac or not timestamp or not nonce:
            raise Unauthenticated(f"server-to-server call without a signature: {SERVICE_SCHEME} with "
                                  f"{TIMESTAMP_HEADER} and {NONCE_HEADER} expected")
        expected = _service_mac(self.service_secret, audience, method, target, timestamp, nonce, digest)
        if not hmac.compare_digest(mac.strip(), expected):
            raise Unauthenticated("server-to-server call with a wrong signature (another service secret, or a "
                                  "request altered on the way)")
        try:
            signed_at = float(timestamp)
        except ValueError:
            raise Unauthenticated(f"server-to-server call with a bad {TIMESTAMP_HEADER}") from None
        self.replay_guard.take(nonce, signed_at)
        return digest

    def check_enrolment(self, headers) -> Enrolment | None:
        """Who enrols: the holder of the enrolment credential or of the shared enrolment secret
        in ``X-Enrolment-Secret`` (Unauthenticated for anything else). None on an open server."""
        if not self.enabled:
            return None
        given = headers.get("x-enrolment-secret", "")
        if self.enrolment_key is not None and given.startswith(CREDENTIAL_PREFIX):
            scope, _, mac = given[len(CREDENTIAL_PREFIX):].rpartition(":")
            if hmac.compare_digest(mac.encode(), _credential_mac(self.enrolment_key, scope).encode()):
                parsed = CredentialScope.parse(scope)
                credential = str(parsed)
                if credential in self.revoked_credentials:
                    raise Unauthenticated(f"enrolment refused: the enrolment credential {credential} is revoked; the "
                                          f"operator issues a new one (credentials issue --serial {parsed.serial + 1})")
                return Enrolment(credential_holder(credential), parsed)
        if self.enrolment_secret is not None and hmac.compare_digest(given.encode(), self.enrolment_secret):
            return Enrolment(SHARED_SECRET_HOLDER, max_devices=self.shared_max_devices)
        raise Unauthenticated("enrolment refused: X-Enrolment-Secret must carry this device's enrolment credential "
                              "or the deployment's enrolment secret")

    def check_device(self, headers, run_id: str, device_id: str, nonce: str | None) -> None:
        """The caller must hold ``device_id``'s current token in this run (not another device's,
        another run's, or one revoked by a later enrolment). ``nonce`` is the device's current
        enrolment nonce; ``None`` (no current enrolment known here) refuses every token."""
        if not self.enabled:
            return
        token = device_bearer_token(headers)
        if nonce is None or not hmac.compare_digest(token, self.device_token(run_id, device_id, nonce)):
            raise NotAllowed(f"the token is not the current token of device {device_id!r} in run {run_id!r}")


def _service_mac(secret: bytes, audience: str, method: str, target: str, timestamp: str, nonce: str,
                 body_sha256: str) -> str:
    message = "\n".join((SERVICE_SCHEME, audience, method.upper(), target, timestamp, nonce, body_sha256))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def body_sha256(pieces: Iterable[bytes | bytearray | memoryview]) -> str:
    """The SHA-256 (hex) of a body given as its pieces, without joining them."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def check_body_digest(signed: str | None, body: bytes | bytearray) -> None:
    """Refuse (Unauthenticated) a body that is not the one a server-to-server request signed
    (``signed``: :meth:`Auth.check_service`'s answer; None on an open server)."""
    if signed is not None and not hmac.compare_digest(body_sha256([body]), signed):
        raise Unauthenticated("server-to-server call whose body is not the one it signed")


class ReplayGuard:
    """The nonces of the signed requests taken in the last :data:`SERVICE_REQUEST_WINDOW_S`: a
    nonce seen again, or a timestamp outside the window, is refused. Memory follows the request
    rate: a nonce is forgotten once its timestamp has left the window, when it could no longer
    be taken anyway."""

    def __init__(self, window_s: float = SERVICE_REQUEST_WINDOW_S, clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self.clock = clock
        self._seen: set[str] = set()
        self._expiry: deque[tuple[float, str]] = deque()
        self._lock = threading.Lock()

    def take(self, nonce: str, timestamp: float) -> None:
        """Accept ``nonce`` once, for a request signed at ``timestamp``; Unauthenticated otherwise."""
        now = self.clock()
        if not abs(now - timestamp) <= self.window_s:
            raise Unauthenticated(f"server-to-server call signed {now - timestamp:+.0f} s from this server's clock, "
                                  f"outside the {self.window_s:.0f} s allowed: a replayed request, or the servers' "
                                  f"clocks disagree (synchronise them, e.g. with NTP)")
        with self._lock:
            while self._expiry and self._expiry[0][0] < now:
                self._seen.discard(self._expiry.popleft()[1])
            if nonce in self._seen:
                raise Unauthenticated("server-to-server call replayed: its nonce was taken already")
            self._seen.add(nonce)
            # Kept until its timestamp leaves the window; later requests are refused by their timestamp.
            self._expiry.append((max(timestamp, now) + self.window_s, nonce))

    def __len__(self) -> int:
        return len(self._seen)


def auth_from_settings(service_secret_file: str | None, enrolment_secret_file: str | None,
                       enrolment_key_file: str | None = None, shared_max_devices: int | None = None,
                       revoked_credentials_file: str | None = None) -> Auth:
    """The servers' Auth from ``--service-secret-file`` / ``SFL_SERVICE_SECRET``,
    ``--enrolment-secret-file`` / ``SFL_ENROLMENT_SECRET``, ``--enrolment-key-file`` /
    ``SFL_ENROLMENT_KEY`` and ``--revoked-credentials-file``."""
    return Auth(load_secret(service_secret_file, "SFL_SERVICE_SECRET"),
                load_secret(enrolment_secret_file, "SFL_ENROLMENT_SECRET"),
                load_secret(enrolment_key_file, "SFL_ENROLMENT_KEY"), shared_max_devices,
                RevocationList(revoked_credentials_file))
