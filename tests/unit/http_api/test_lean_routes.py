"""Lean routes (``ServiceApp.msgpack_post``) answer exactly what the FastAPI route of the same
handler answers, without going through FastAPI's middleware stack.

The same app is called twice for every request: as it is (``ServiceApp.__call__`` serves the lean
route) and through FastAPI's own ``__call__`` (the middleware stack, the router and the FastAPI
route of the same handler). Status, headers that matter and body must be identical, for good
requests and for every kind of refusal.
"""
from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.datastructures import Headers

from http_api.server import create_service_app
from shared.errors import Conflict
from shared.schemas import Message, StepRequest, WireTensor
from shared.wire import encode_tensor, packb
import torch

LIMIT = 64 << 10
PATH = "/t/{round_id}/step"


class Seen(Message):
    """What the handler saw of one request."""

    round_id: int
    device_id: str
    step: int
    authorization: str | None
    fx: WireTensor


def make_app() -> tuple[FastAPI, CollectorRegistry, list[str]]:
    """A service app with one lean route; ``stack`` records each request that went through the
    middleware stack."""
    registry = CollectorRegistry()
    app = create_service_app("lean", "lean", "lean", registry=registry)
    stack: list[str] = []

    @app.middleware("http")
    async def _record(request, call_next):
        stack.append(request.url.path)
        return await call_next(request)

    @app.msgpack_post(PATH, StepRequest, LIMIT)
    async def step(round_id: int, headers: Headers, message: StepRequest) -> Seen:
        """Echo what the route received."""
        if message.device_id == "stale":
            raise Conflict(f"round {round_id} is stale")
        if message.device_id == "crash":
            raise RuntimeError("a bug")
        return Seen(round_id=round_id, device_id=message.device_id, step=message.step,
                    authorization=headers.get("authorization"), fx=message.fx)

    return app, registry, stack


def body(device_id: str = "dev-0", rows: int = 4, **changes) -> bytes:
    fields = StepRequest(device_id=device_id, step=3, fx=WireTensor(**encode_tensor(torch.arange(rows * 8.0).view(rows, 8))),
                         labels=WireTensor(**encode_tensor(torch.zeros(rows, dtype=torch.int64)))).model_dump()
    fields.update(changes)
    return packb(fields)


def both(app: FastAPI, method: str, path: str, **kwargs) -> tuple[httpx.Response, httpx.Response]:
    """The answer of the app as served (lean routes first), then through FastAPI's stack alone.
    A callable ``content`` makes each call's body (a stream is read once)."""
    async def fastapi_only(scope, receive, send):
        await FastAPI.__call__(app, scope, receive, send)

    async def call(asgi) -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi, raise_app_exceptions=False)
        content = kwargs.get("content")
        fresh = {**kwargs, "content": content()} if callable(content) else kwargs
        async with httpx.AsyncClient(transport=transport, base_url="http://lean") as client:
            return await client.request(method, path, **fresh)

    return asyncio.run(call(app)), asyncio.run(call(fastapi_only))


def same(lean: httpx.Response, full: httpx.Response) -> None:
    assert lean.status_code == full.status_code, (lean.text, full.text)
    assert lean.content == full.content
    for name in ("content-type", "content-length"):
        assert lean.headers.get(name) == full.headers.get(name), name


def test_a_good_request_is_answered_the_same_without_the_middleware_stack():
    app, _, stack = make_app()
    lean, full = both(app, "POST", "/t/7/step", content=body(), headers={"authorization": "Bearer abc"})
    same(lean, full)
    assert lean.status_code == 200 and lean.headers["content-type"] == "application/msgpack"
    seen = Seen.model_validate(msgpack.unpackb(lean.content))
    assert (seen.round_id, seen.device_id, seen.step, seen.authorization) == (7, "dev-0", 3, "Bearer abc")
    assert seen.fx.data == encode_tensor(torch.arange(32.0).view(4, 8))["data"]
    assert stack == ["/t/7/step"]  # only the FastAPI call went through the middleware stack


@pytest.mark.parametrize("case, content, status, words", [
    ("empty", b"", 400, "empty body"),
    ("not msgpack", b"\xc1\xc1", 400, "msgpack"),
    ("schema", body(step=-1), 422, "step"),
    ("unknown field", packb({**msgpack.unpackb(body()), "extra": 1}), 422, "extra"),
    ("tensor bytes", body(fx={"dtype": "float32", "shape": [4, 8], "data": b"\x00" * 5}), 422, "fx"),
    ("too large", body(rows=LIMIT // 16), 413, "limit"),
    ("domain error", body("stale"), 409, "stale"),
    ("crash", body("crash"), 500, "Internal Server Error"),
])
def test_refusals_are_answered_the_same(case, content, status, words):
    app, _, _ = make_app()
    lean, full = both(app, "POST", "/t/7/step", content=content)
    same(lean, full)
    assert lean.status_code == status and words in lean.text, (case, lean.text)


def test_a_chunked_body_past_the_limit_is_refused_the_same():
    app, _, _ = make_app()
    data = body(rows=LIMIT // 16)

    async def chunks():  # no Content-Length (chunked): the limit applies as the body streams in
        for i in range(0, len(data), 16 << 10):
            yield data[i:i + (16 << 10)]

    lean, full = both(app, "POST", "/t/7/step", content=chunks)
    same(lean, full)
    assert lean.status_code == 413 and "limit" in lean.text


def test_a_chunked_body_within_the_limit_is_read_whole():
    app, _, _ = make_app()
    data = body()

    async def chunks():
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    lean, full = both(app, "POST", "/t/7/step", content=chunks)
    same(lean, full)
    assert "content-length" not in lean.request.headers
    assert lean.status_code == 200 and Seen.model_validate(msgpack.unpackb(lean.content)).device_id == "dev-0"


@pytest.mark.parametrize("method, path, status", [
    ("POST", "/t/abc/step", 422),            # not an integer: FastAPI's validation answers
    ("POST", "/t/" + "9" * 19 + "/step", 200),  # more digits than the lean route takes: FastAPI serves it
    ("GET", "/t/7/step", 405),
    ("POST", "/t/7/step/more", 404),
])
def test_paths_the_lean_route_does_not_take_go_to_fastapi(method, path, status):
    app, _, stack = make_app()
    content = body() if method == "POST" else None
    lean, full = both(app, method, path, content=content)
    same(lean, full)
    assert lean.status_code == status, lean.text
    assert stack == [path, path]  # both calls went through the middleware stack


def test_lean_body_bytes_are_counted_under_the_route_template():
    app, registry, _ = make_app()
    sent = body()

    def counted(direction: str) -> float:
        return registry.get_sample_value("sfl_http_body_bytes_total", {"route": PATH, "direction": direction}) or 0.0

    lean, _ = both(app, "POST", "/t/7/step", content=sent)
    refused, _ = both(app, "POST", "/t/7/step", content=body("stale"))
    # each request twice (lean, then through the middleware): the same counts both ways
    assert counted("received") == 2 * (len(sent) + len(body("stale")))
    assert counted("sent") == 2 * (len(lean.content) + len(refused.content))
