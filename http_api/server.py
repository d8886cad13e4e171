"""Server-side HTTP plumbing shared by the Fed Server and the Main Server.

Transport-level refusals (body too large, not msgpack) are :class:`ApiError`s raised here; the
logic objects raise :mod:`shared.errors` domain errors, mapped to status codes by
:data:`STATUS_OF`.

Bodies are msgpack; every request body is size-limited, parsed and validated against its pydantic
schema *before* any handler touches state, so bad input gets a clear 4xx and changes nothing.
Errors are answered as JSON ``{"detail": ...}`` so that they read well in curl and logs.
"""
from __future__ import annotations

from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from shared.errors import Conflict, DomainError, Failed, Invalid, NotAllowed, NotFound, Unauthenticated
from shared.wire import Body, WireError, pack_body, unpackb

M = TypeVar("M", bound=BaseModel)


class ApiError(Exception):
    """A transport-level error answer (size, encoding): HTTP status and a reason for the caller."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


#: The HTTP status of each domain error (most specific class first is not needed: no overlap).
STATUS_OF: dict[type[DomainError], int] = {
    Invalid: 422, NotFound: 404, NotAllowed: 403, Unauthenticated: 401, Conflict: 409, Failed: 500,
}

MSGPACK = "application/msgpack"


async def read_message(request: Request, model: type[M], max_bytes: int) -> M:
    """Read, size-check, unpack and validate a msgpack request body."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"body of {declared} bytes exceeds the limit of {max_bytes} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    if size == 0:
        raise ApiError(400, "empty body: a msgpack message is required")
    try:
        obj = unpackb(b"".join(chunks))
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

    def __init__(self, body: Body, status_code: int = 200) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body  # type: ignore[assignment]  # a Body, not bytes: sent piece by piece below
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


def create_service_app(service: str, title: str, description: str, lifespan=None, registry=None) -> FastAPI:
    """A FastAPI app with what every server has: error handlers, ``/healthz``, ``/metrics``.

    ``registry`` is the service's own ``prometheus_client.CollectorRegistry`` (a fresh one with the
    process collectors if None). ``/metrics`` (and ``/metrics/``) answer its text exposition
    directly, without a redirect; every request's body bytes are counted per route template
    (``sfl_http_body_bytes_total``, see ``shared/http_metrics.py``).
    """
    from shared.http_metrics import BodyBytesMiddleware, body_bytes_counter, exposition, new_registry

    registry = registry if registry is not None else new_registry()
    app = FastAPI(title=title, version="1", description=description, lifespan=lifespan)
    install_error_handlers(app)
    app.state.registry = registry
    app.add_middleware(BodyBytesMiddleware, counter=body_bytes_counter(registry))

    async def metrics() -> Response:
        """Prometheus scrape of this service's registry."""
        body, content_type = exposition(registry)
        return Response(content=body, media_type=content_type)

    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response, include_in_schema=True)
    app.add_api_route("/metrics/", metrics, methods=["GET"], response_class=Response, include_in_schema=False)

    @app.get("/healthz")
    async def healthz() -> dict:
        """Liveness: 200 while the process serves requests."""
        return {"status": "ok", "service": service}

    return app


def install_error_handlers(app: FastAPI) -> None:
    """Map :class:`ApiError`, domain errors and stray wire errors to JSON answers."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=status_of(exc))

    @app.exception_handler(RequestValidationError)
    async def _path_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        parts = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
        return JSONResponse({"detail": "; ".join(parts) or "invalid request"}, status_code=422)

    @app.exception_handler(WireError)
    async def _wire_error(_: Request, exc: WireError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)


def status_of(exc: DomainError) -> int:
    """The HTTP status for a domain error (its class or nearest mapped base class)."""
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return 500
