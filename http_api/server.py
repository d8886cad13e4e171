"""Server-side HTTP plumbing shared by the Fed Server and the Main Server.

Transport-level refusals (body too large, not msgpack) are :class:`ApiError`s raised here; the
logic objects raise :mod:`shared.errors` domain errors, mapped to status codes by
:data:`STATUS_OF`.

Bodies are msgpack; every request body is size-limited, parsed and validated against its pydantic
schema *before* any handler touches state, so bad input gets a clear 4xx and changes nothing.
Errors are answered as JSON ``{"detail": ...}`` so that they read well in curl and logs.

The hot routes (a device's step: 401 KB each way for the cnn, the Main Server's busiest route) are
declared with :meth:`ServiceApp.msgpack_post` and served straight from the ASGI call, before
FastAPI's middleware, routing and dependency machinery, with the same parsing, checks, error
answers and body-bytes counting as a FastAPI route (benchmarks/README.md, "Why the code is as it is").
"""
from __future__ import annotations

import inspect
import logging
import math
import re
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from shared.auth import check_body_digest
from shared.errors import Conflict, DomainError, Failed, Invalid, NotAllowed, NotFound, TooSoon, Unauthenticated
from shared.http_metrics import call_counting_body_bytes
from shared.wire import Body, WireError, pack_body, unpackb

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger("http_api")


#: The scope key under which the server's protocol (:func:`http_api.serve.head_timeout_protocol`)
#: notes when a request's head began to arrive and when its body's last byte came in
#: (``[head_at, body_at]``, ``time.monotonic()``; ``body_at`` None while the body comes in).
ARRIVAL = "sfl.arrival"


def arrival_seconds(request: Request, read_since: float) -> float:
    """Seconds ``request`` took to arrive, from its head's first byte to its body's last, once its
    body has been read: what a client spent sending it, on a link slower than this server.

    Measured by the server's protocol where it runs (:data:`ARRIVAL`); under another server (a
    test's in-process app) from ``read_since``, when the handler began to read the body, to now.
    """
    arrival = request.scope.get(ARRIVAL)
    now = time.monotonic()
    if arrival is None:
        return max(0.0, now - read_since)
    head_at, body_at = arrival
    return max(0.0, (body_at if body_at is not None else now) - head_at)


class ApiError(Exception):
    """A transport-level error answer (size, encoding): HTTP status and a reason for the caller."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


#: The HTTP status of each domain error (most specific class first is not needed: no overlap).
STATUS_OF: dict[type[DomainError], int] = {
    Invalid: 422, NotFound: 404, NotAllowed: 403, Unauthenticated: 401, Conflict: 409, TooSoon: 429, Failed: 500,
}

MSGPACK = "application/msgpack"


async def read_message(request: Request, model: type[M], max_bytes: int, signed_digest: str | None = None,
                       max_entries: int | None = None) -> M:
    """Read, size-check, unpack and validate a msgpack request body; with ``signed_digest`` (a
    signed server-to-server request's, :meth:`shared.auth.Auth.check_service`), refuse a body that
    is not the signed one before unpacking it; with ``max_entries``, one of more map entries and
    array elements (400, :func:`shared.wire.unpackb`)."""
    body = await read_body(request.stream(), request.headers.get("content-length"), max_bytes)
    check_body_digest(signed_digest, body)
    return parse_message(body, model, max_entries)


def request_target(request: Request) -> str:
    """The path and query of ``request`` as they came on the wire: what a server-to-server
    request's signature covers (:meth:`shared.auth.Auth.sign_service_request`)."""
    scope = request.scope
    path = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string", b"")
    return (path + (b"?" + query if query else b"")).decode("ascii", "replace")


#: The most of a declared Content-Length :func:`read_body` allocates before the bytes arrive.
PREALLOCATED_MAX_BYTES = 1 << 20


async def read_body(chunks: AsyncIterable[bytes], declared: str | None, max_bytes: int) -> bytearray:
    """A request body from its chunks, in one buffer: 413 past ``max_bytes`` (a declared
    Content-Length before anything is read; a chunked body as soon as it grows past it), 400 if
    empty.

    With a Content-Length the buffer is allocated at that size, up to
    :data:`PREALLOCATED_MAX_BYTES`, and each chunk is copied into it as it arrives, so a body is
    copied once here and never held twice (joining a list of chunks held them and the joined copy at
    once); past that size, and for a chunked body, the buffer grows with what arrives. Allocating a
    declared 512 MiB up front would let a client that sends one byte, before any token is checked,
    hold that much of the server's memory per connection.
    """
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > max_bytes:
        raise ApiError(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    body = bytearray(min(size or 0, PREALLOCATED_MAX_BYTES))
    filled = 0
    async for chunk in chunks:
        end = filled + len(chunk)
        if end > max_bytes:
            raise ApiError(413, f"body exceeds the limit of {max_bytes} bytes")
        if size and end > size:   # the HTTP parser stops a body at its Content-Length; a server that did not would land here
            raise ApiError(400, f"body longer than its Content-Length of {size} bytes")
        if end <= len(body):
            body[filled:end] = chunk
        else:
            body[filled:] = chunk   # past what was allocated: the buffer grows to ``end``
        filled = end
    if filled == 0:
        raise ApiError(400, "empty body: a msgpack message is required")
    if size and filled < size:   # only if the server ended the body early: a client that stops sending disconnects
        raise ApiError(400, f"body of {filled} bytes is shorter than its Content-Length of {size}")
    return body


def parse_message(body: bytes | bytearray, model: type[M], max_entries: int | None = None) -> M:
    """Unpack a msgpack body (400 if it is not msgpack, or holds more than ``max_entries`` map
    entries and array elements) and validate it against ``model`` (422)."""
    try:
        obj = unpackb(body, max_entries=max_entries)
    except WireError as exc:
        raise ApiError(400, str(exc)) from None
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise ApiError(422, f"invalid {model.__name__}: {_short(exc)}") from None


def msgpack_body_schema(model: type[BaseModel]) -> dict:
    """``openapi_extra`` for a route that reads its body with :func:`read_message`.

    Such routes take the raw :class:`Request`, so FastAPI's OpenAPI description would show no
    request body; this declares a required ``application/msgpack`` body with ``model``'s JSON
    schema (the ``$defs`` inlined, so the operation is self-contained and needs no components).
    ``bytes`` fields appear as ``{"type": "string", "format": "binary"}``.
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    return {"requestBody": {"required": True, "content": {MSGPACK: {"schema": _inline_refs(schema, defs, ())}}}}


def _inline_refs(node, defs: dict, seen: tuple[str, ...]):
    """``node`` with every ``{"$ref": "#/$defs/X"}`` replaced by ``X`` (a cycle becomes ``{}``: any value)."""
    if isinstance(node, list):
        return [_inline_refs(item, defs, seen) for item in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        name = ref[len("#/$defs/"):]
        siblings = {k: _inline_refs(v, defs, seen) for k, v in node.items() if k != "$ref"}
        if name in seen:
            return siblings
        return {**_inline_refs(defs[name], defs, seen + (name,)), **siblings}
    return {k: _inline_refs(v, defs, seen) for k, v in node.items()}


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


class MsgpackResponse(Response):
    """A msgpack answer sent as its body's pieces (:class:`shared.wire.Body`), never joined.

    Starlette's ``Response`` takes one ``bytes`` (or ``memoryview``), which for a body holding
    tensors would copy every tensor's bytes once more into a buffer of the body's size. This one
    sends each piece as its own ASGI body message under the body's Content-Length, so the server
    writes the tensor snapshots to the socket as they are. ``body`` is the :class:`Body`:
    ``len(response.body)`` is the number of body bytes, as for any ``Response``.
    """

    media_type = MSGPACK
    body: Body  # type: ignore[assignment]  # a Body, not bytes: sent piece by piece below

    def __init__(self, body: Body, status_code: int = 200) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        self.init_headers()  # Content-Length from len(body), Content-Type from media_type

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pieces = self.body.pieces
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})
        if self.background is not None:  # FastAPI attaches a route's background tasks here
            await self.background()


def msgpack_response(message: BaseModel, status: int = 200) -> MsgpackResponse:
    """A msgpack response body from a schema instance."""
    return MsgpackResponse(pack_body(message.model_dump()), status_code=status)


#: A lean route's handler: its path parameters (integers) as keyword arguments, then the request's
#: ``headers`` and its validated ``message``; it answers a message sent as msgpack.
LeanHandler = Callable[..., Awaitable[BaseModel]]
#: Called with the path's integers and ``headers=`` before a lean route reads its body: what it
#: raises answers the request at once (an unauthenticated body is never read); what it returns is
#: the handler's ``caller=``.
BeforeBody = Callable[..., object]


class LeanRoute:
    """A POST route with a msgpack body served straight from :class:`ServiceApp`'s ASGI call.

    It does what FastAPI's route of the same handler does (:meth:`ServiceApp.msgpack_post`):
    :func:`read_body` and :func:`parse_message`, the handler, the answer as msgpack, errors as
    :func:`error_response`, body bytes counted under the route's template. It takes only paths
    whose parameters are plain decimal integers (up to 18 digits, so that ``int`` is exact and
    cheap); any other path goes to the FastAPI route, whose validation answers it.
    """

    def __init__(self, path: str, model: type[BaseModel], max_bytes: int, handler: LeanHandler,
                 before_body: BeforeBody | None = None) -> None:
        self.path = path
        self.model = model
        self.max_bytes = max_bytes
        self.handler = handler
        self.before_body = before_body
        self.params = re.findall(r"\{(\w+)\}", path)
        self.pattern = re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[0-9]{1,18})", re.escape(path)))

    def match(self, path: str) -> dict[str, int] | None:
        """The path parameters if this route takes ``path``, else None."""
        found = self.pattern.fullmatch(path)
        return None if found is None else {name: int(value) for name, value in found.groupdict().items()}

    async def __call__(self, scope, receive, send) -> None:
        try:
            headers = Headers(scope=scope)
            params = scope["path_params"]
            extra = {} if self.before_body is None else {"caller": self.before_body(**params, headers=headers)}
            body = await read_body(_request_chunks(receive), headers.get("content-length"), self.max_bytes)
            message = parse_message(body, self.model)
            del body   # the message holds what it needs; the buffer is not kept through the handler's wait
            answer = await self.handler(**params, headers=headers, message=message, **extra)
        except ClientDisconnect:
            return   # nobody to answer
        except Exception as exc:
            response: Response | None = error_response(exc)
            if response is None:   # as Starlette's ServerErrorMiddleware answers a FastAPI route's crash
                log.exception("%s %s failed", scope["method"], scope["path"])
                response = PlainTextResponse("Internal Server Error", status_code=500)
            await response(scope, receive, send)
            return
        await msgpack_response(answer)(scope, receive, send)


async def _request_chunks(receive) -> AsyncIterator[bytes]:
    """The body chunks of an ASGI HTTP request; ClientDisconnect if the client goes away (as
    Starlette's ``Request.stream``)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        yield message.get("body", b"")
        if not message.get("more_body", False):
            return


class ServiceApp(FastAPI):
    """The FastAPI app of a server, which serves its lean routes before its middleware stack.

    FastAPI's path for a request (Starlette's error and exception middleware, FastAPI's telemetry
    hooks, the body-bytes middleware, the router's scan of every route, the dependency solving
    and the endpoint's wrapping) cost the Main Server nearly as much CPU per step request as
    parsing, checking and answering the step itself (measured:
    benchmarks/why-the-code-is-as-it-is.md, "The Main Server's join and step served before
    FastAPI's stack").
    """

    def __init__(self, *args, body_bytes: Counter, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.body_bytes = body_bytes
        self.lean_routes: list[LeanRoute] = []
        #: Called on the event loop when the server starts to stop (SIGTERM, Ctrl-C), before it
        #: waits for the requests still running (:func:`http_api.serve.serve`): what holds an
        #: answer for a change (long-poll, a watch stream) lets it go, so that the stop is not held
        #: for ``--shutdown-grace-s`` and the answer is not cut off.
        self.on_stopping: list[Callable[[], None]] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            for route in self.lean_routes:
                params = route.match(scope["path"])
                if params is not None:
                    scope["path_params"] = params
                    await call_counting_body_bytes(route, self.body_bytes, scope, receive, send, route.path)
                    return
        await super().__call__(scope, receive, send)

    def msgpack_post(self, path: str, model: type[M], max_bytes: int,
                     before_body: BeforeBody | None = None) -> Callable[[LeanHandler], LeanHandler]:
        """Declare ``handler`` the POST route ``path`` with a msgpack ``model`` body of at most
        ``max_bytes``, answered with the message it returns, as msgpack.

        ``handler(**path_params, headers=..., message=...)``: every ``{name}`` of ``path`` is an
        integer. With ``before_body``, it is called first (``before_body(**path_params,
        headers=...)``) and the handler gets its result as ``caller=``. The route is served lean (:class:`LeanRoute`) and is also a FastAPI route of the
        same handler, which describes it in the OpenAPI document, answers other methods with 405,
        and serves the paths the lean route does not take (a parameter that is not a plain
        decimal: FastAPI validates it, 422 for one that is not an integer).
        """
        def declare(handler: LeanHandler) -> LeanHandler:
            route = LeanRoute(path, model, max_bytes, handler, before_body)
            self.lean_routes.append(route)

            async def endpoint(request: Request, **params: int) -> Response:
                extra = {} if before_body is None else {"caller": before_body(**params, headers=request.headers)}
                message = await read_message(request, model, max_bytes)
                return msgpack_response(await handler(**params, headers=request.headers, message=message, **extra))

            # What FastAPI reads: the path's integers and the request (a function takes any attribute).
            endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=int) for name in route.params]
                + [inspect.Parameter("request", inspect.Parameter.KEYWORD_ONLY, annotation=Request)])
            endpoint.__name__, endpoint.__doc__ = handler.__name__, handler.__doc__
            self.add_api_route(path, endpoint, methods=["POST"], response_class=Response,
                               openapi_extra=msgpack_body_schema(model))
            return handler
        return declare


def create_service_app(service: str, title: str, description: str, lifespan=None, registry=None,
                       refusal: str | None = None) -> ServiceApp:
    """A FastAPI app with what every server has: error handlers, ``/livez``, ``/healthz``, ``/metrics``.

    ``/livez`` answers 200 while the process serves requests (a liveness probe); ``/healthz`` too,
    unless the server refuses to work (``refusal``: why), when it answers 503 with the reason (a
    readiness probe: nothing is routed to it, and nothing restarts it).

    ``registry`` is the service's own ``prometheus_client.CollectorRegistry`` (a fresh one with the
    process collectors if None). ``/metrics`` (and ``/metrics/``) answer its text exposition
    directly, without a redirect; every request's body bytes are counted per route template
    (``sfl_http_body_bytes_total``, see ``shared/http_metrics.py``).
    """
    from shared.http_metrics import BodyBytesMiddleware, body_bytes_counter, exposition, new_registry

    registry = registry if registry is not None else new_registry()
    counter = body_bytes_counter(registry)
    app = ServiceApp(title=title, version="1", description=description, lifespan=lifespan, body_bytes=counter)
    install_error_handlers(app)
    app.state.registry = registry
    app.add_middleware(BodyBytesMiddleware, counter=counter)

    async def metrics() -> Response:
        """Prometheus scrape of this service's registry."""
        body, content_type = exposition(registry)
        return Response(content=body, media_type=content_type)

    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response, include_in_schema=True)
    app.add_api_route("/metrics/", metrics, methods=["GET"], response_class=Response, include_in_schema=False)

    @app.get("/livez")
    async def livez() -> dict:
        """Liveness: 200 while the process serves requests."""
        return {"status": "ok", "service": service}

    @app.get("/healthz", responses={503: {"description": "the server refuses to work, and says why"}})
    async def healthz() -> Response:
        """Readiness: 200 when the server does its work, 503 with the reason when it refuses to."""
        if refusal is not None:
            return JSONResponse({"status": "refused", "service": service, "detail": refusal}, status_code=503)
        return JSONResponse({"status": "ok", "service": service})

    return app


def create_refusal_app(service: str, reason: str) -> ServiceApp:
    """What a server that cannot start serves (``--wait-on-refusal``, :func:`http_api.serve.refuse_to_start`):
    ``/livez`` 200, so its supervisor does not restart it into the same refusal, and ``/healthz``
    and every ``/v1`` route 503 with ``reason``, so whoever asks (a device, the operator, a
    readiness probe) reads it."""
    app = create_service_app(service, f"{service} (not started)", description=reason, refusal=reason)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST"], include_in_schema=False)
    async def refused(path: str) -> JSONResponse:
        return JSONResponse({"detail": f"the server has not started: {reason}"}, status_code=503)
    return app


def error_response(exc: Exception) -> JSONResponse | None:
    """The JSON answer of a transport error (:class:`ApiError`), a domain error or a stray wire
    error; None for any other exception (a crash: 500)."""
    if isinstance(exc, ApiError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)
    if isinstance(exc, TooSoon):
        return JSONResponse({"detail": exc.detail}, status_code=status_of(exc),
                            headers={"Retry-After": str(retry_after_header(exc.retry_after_s))})
    if isinstance(exc, DomainError):
        return JSONResponse({"detail": exc.detail}, status_code=status_of(exc))
    if isinstance(exc, WireError):
        return JSONResponse({"detail": str(exc)}, status_code=422)
    return None


def install_error_handlers(app: FastAPI) -> None:
    """Map :class:`ApiError`, domain errors and stray wire errors to JSON answers (:func:`error_response`),
    and a client gone mid-body to no answer at all."""

    async def _known_error(_: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc)
        assert response is not None, exc  # registered below only for the classes it answers
        return response

    for cls in (ApiError, DomainError, WireError):
        app.add_exception_handler(cls, _known_error)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, exc: ClientDisconnect) -> Response:
        # The client went away while its body was read, or was cut off for sending it too slowly
        # (http_api/serve.py): nobody reads an answer, and it is no crash to log, as a lean route
        # sees it too (LeanRoute.__call__).
        return Response(status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _path_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)


def retry_after_header(seconds: float) -> int:
    """``Retry-After`` in whole seconds (RFC 9110), rounded up so that a client that waits it is
    not early."""
    return max(1, math.ceil(seconds))


def status_of(exc: DomainError) -> int:
    """The HTTP status for a domain error (its class or nearest mapped base class)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 500
