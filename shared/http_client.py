"""Client-side HTTP plumbing: msgpack calls with byte accounting and bounded retries.

Used by device agents (sync, one client per virtual device) and by the Fed Server when it talks
to the Main Server (async). Bytes are counted on the bodies actually sent and received, which is
what the run's communication figures report.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from shared.auth import DIGEST_HEADER, EMPTY_SHA256, Auth, body_sha256
from shared.retry import Backoff, retry
from shared.tls import tls_context
from shared.wire import Body, WireError, pack_body, unpackb

M = TypeVar("M", bound=BaseModel)
HEADERS = {"content-type": "application/msgpack", "accept": "application/msgpack"}


class ServiceSigner(httpx.Auth):
    """Signs each request of an HTTP client to the other server (:meth:`shared.auth.Auth.sign_service_request`),
    every try afresh. The body's digest comes from the ``x-sfl-content-sha256`` header the sender
    set from the body's pieces (:func:`post_body`), so a body sent as pieces is
    never joined to be hashed; a request without it signs an empty body."""

    def __init__(self, auth: Auth, audience: str) -> None:
        self.auth = auth
        self.audience = audience

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        digest = request.headers.get(DIGEST_HEADER, EMPTY_SHA256)
        request.headers.update(self.auth.sign_service_request(
            self.audience, request.method, request.url.raw_path.decode("ascii"), digest))
        yield request


def service_signer(auth: Auth, audience: str) -> ServiceSigner | None:
    """What signs an HTTP client's calls to ``audience``; None on an open server."""
    return ServiceSigner(auth, audience) if auth.enabled else None


class ServiceError(RuntimeError):
    """A service answered with an error status (or an unreadable body)."""

    def __init__(self, status: int, detail: str, url: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(f"{url}: HTTP {status}: {detail}" if url else f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        #: The answer's ``Retry-After`` in seconds (a 429), None without one.
        self.retry_after_s = retry_after_s


@dataclass
class ByteCounter:
    """Body bytes sent and received through one client."""

    up: int = 0
    down: int = 0


def decode_response(resp: httpx.Response, model: type[M]) -> M:
    """Turn a msgpack response into ``model``, or raise :class:`ServiceError` with the server's reason."""
    if resp.status_code >= 400:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text[:500]
        raise ServiceError(resp.status_code, str(detail), str(resp.request.url), retry_after(resp.headers))
    try:
        return model.model_validate(unpackb(resp.content))
    except (WireError, ValidationError) as exc:
        raise ServiceError(resp.status_code, f"unreadable {model.__name__} answer: {exc}", str(resp.request.url)) from None


def retry_after(headers: Mapping[str, str]) -> float | None:
    """An answer's ``Retry-After`` in seconds when it gives a number of them (the servers here
    never send a date); None otherwise."""
    try:
        seconds = float(headers.get("retry-after", ""))
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


def service_client(signer: httpx.Auth | None, ca_file: str | None, timeout: float) -> httpx.AsyncClient:
    """An async client for server-to-server calls: msgpack headers, each request signed by
    ``signer`` (:func:`service_signer`; None: the servers run open), TLS trust."""
    return httpx.AsyncClient(timeout=timeout, headers=HEADERS, auth=signer, verify=tls_context(ca_file or True))


async def post_body(client: httpx.AsyncClient, url: str, body: Body) -> httpx.Response:
    """POST a packed body (:func:`shared.wire.pack_body`) as its pieces, never joined.

    Joining (``shared.wire.packb``) copies every tensor's bytes once more into a body-sized buffer,
    which a 6.5 MB server portion or plan pays in fresh memory: its pages faulted in on the
    sender's event loop (benchmarks/README.md, "Why the code is as it is"). An async client takes
    pieces as an async iterable, a new one for each call, so a retry sends the body whole again; the
    Content-Length keeps httpx from framing it chunked (which would copy each piece into its frame).
    A client that signs its requests (:func:`service_client`) signs the body's digest, taken from
    its pieces here.
    """
    async def pieces() -> AsyncIterator[bytes]:
        for piece in body.pieces:
            yield piece
    headers = {"content-length": str(len(body))}
    if isinstance(client.auth, ServiceSigner):
        headers[DIGEST_HEADER] = body_sha256(body.pieces)
    return await client.post(url, content=pieces(), headers=headers)


class Cancelled(RuntimeError):
    """The caller gave a call up while its answer was arriving (:meth:`SyncClient.call`'s ``cancel``)."""


class Cancellation:
    """A flag another thread sets to give up the calls that watch it (:meth:`SyncClient.call`'s
    ``cancel``). Setting it shuts the connection of each call reading an answer at that moment: a
    read that waits on a stalled link (a link that dropped mid-answer can send nothing for many
    seconds) returns at once, instead of whenever the next bytes come."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._aborts: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        """Give up every watching call (each at its next read, or at once where its connection is shut)."""
        with self._lock:
            self._event.set()
            aborts = list(self._aborts)
        for abort in aborts:
            abort()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout: float) -> bool:
        """Whether it was set within ``timeout`` seconds (an interruptible sleep)."""
        return self._event.wait(timeout)

    @contextlib.contextmanager
    def watching(self, abort: Callable[[], None]) -> Iterator[None]:
        """Call ``abort`` if the flag is set while the block runs (or is set already)."""
        with self._lock:
            self._aborts.append(abort)
            already = self._event.is_set()
        try:
            if already:
                abort()
            yield
        finally:
            with self._lock:
                self._aborts.remove(abort)


def _shut(resp: httpx.Response) -> Callable[[], None]:
    """What shuts ``resp``'s connection from another thread, waking a read blocked on it."""
    stream = resp.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None

    def shut() -> None:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    return shut


class SyncClient:
    """Blocking msgpack client for one base URL, counting body bytes."""

    def __init__(self, base_url: str, timeout: float = 60.0, retries: int = 3, verify: bool | str = True,
                 request_delay_s: float = 0.0) -> None:
        """``request_delay_s``: a delay before every request is sent, as if each took that much
        longer on the wire (an emulated round-trip time, where the kernel cannot add one)."""
        self.base_url = base_url.rstrip("/")
        self.bytes = ByteCounter()
        self.request_delay_s = request_delay_s
        self.backoff = Backoff(attempts=retries + 1, first_delay_s=0.2)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=HEADERS, verify=tls_context(verify))

    def call(self, method: str, path: str, model: type[M], body: BaseModel | None = None,
             params: dict | None = None, timeout: float | None = None, headers: dict | None = None,
             retries: int | None = None, cancel: Cancellation | None = None) -> M:
        """Send ``body`` (msgpack) and decode the answer; retries only on connection failures, as
        often as the client's ``retries`` or, for this call, ``retries`` (0: a caller that waits
        for the server on its own schedule, and logs it its own way). With ``cancel``, the answer
        is read as it arrives, and once ``cancel`` is set the connection is shut and
        :class:`Cancelled` raised: a large answer over a slow or stalled link is not waited for,
        nor read to its end, for nothing."""
        # The body goes out as its pieces, the tensors' bytes straight from their snapshots (see
        # shared.wire.Body); its length must be given, or httpx would send it chunked (a copy).
        content = pack_body(body.model_dump()) if body is not None else None
        if content is not None:
            headers = {**(headers or {}), "content-length": str(len(content))}
        request_timeout = timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT
        if self.request_delay_s > 0:
            time.sleep(self.request_delay_s)
        request = self._http.build_request(method, path, content=content, params=params, headers=headers,
                                           timeout=request_timeout)
        resp = retry(lambda: self._receive(request, cancel),
                     self.backoff if retries is None else replace(self.backoff, attempts=retries + 1),
                     (httpx.ConnectError, httpx.RemoteProtocolError), f"{method} {self.base_url}{path}")
        self.bytes.up += len(content or b"")
        self.bytes.down += len(resp.content)
        return decode_response(resp, model)

    def _receive(self, request: httpx.Request, cancel: Cancellation | None) -> httpx.Response:
        """Send ``request`` and read its answer whole; with ``cancel``, piece by piece as it
        arrives, given up once ``cancel`` is set (:meth:`call`)."""
        if cancel is None:
            return self._http.send(request)
        resp = self._http.send(request, stream=True)
        # As they came over the wire (a compressed answer is decoded below, from its headers), and
        # joined once at the end, as httpx joins an answer it reads whole: no larger peak.
        pieces: list[bytes] = []
        try:
            with cancel.watching(_shut(resp)):
                for piece in resp.iter_raw():
                    if cancel.is_set():
                        break
                    pieces.append(piece)
        except httpx.TransportError:
            if not cancel.is_set():
                raise
        finally:
            resp.close()   # an answer not read to its end closes its connection
        if cancel.is_set():
            received = sum(map(len, pieces))
            self.bytes.down += received
            raise Cancelled(f"{request.method} {request.url}: given up after {received:,} bytes of the answer")
        return httpx.Response(resp.status_code, headers=resp.headers, content=b"".join(pieces), request=request)

    def set_token(self, token: str | None) -> None:
        """Send ``Authorization: Bearer <token>`` with every call from now on."""
        if token:
            self._http.headers["authorization"] = f"Bearer {token}"

    def close(self) -> None:
        self._http.close()
