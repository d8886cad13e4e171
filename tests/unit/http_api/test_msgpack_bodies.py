"""Bodies holding tensors travel as their pieces (shared.wire.Body), both ways, and arrive whole.

The device's blocking client and the servers' async sender (``post_body``: uploads, round plans;
shared/http_client.py) send a request body piece by piece, and the servers' msgpack answers (http_api/server.py) go out the same way; both under the body's
Content-Length, never chunked. A real uvicorn server on a loopback port, built by
``create_service_app`` like the Fed and Main Servers, runs an echo route that answers what it
received: the framing headers and the raw body bytes.
"""
from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import torch
import uvicorn
from fastapi import Request
from prometheus_client import CollectorRegistry
from starlette.background import BackgroundTask

from http_api.server import create_service_app, msgpack_response
from shared.http_client import SyncClient, post_body
from shared.schemas import Message, StepRequest, WireTensor
from shared.wire import encode_tensor, pack_body


class Received(Message):
    """What the echo route saw of one request."""

    content_length: str | None
    transfer_encoding: str | None
    body: bytes


def _step_request() -> StepRequest:
    gen = torch.Generator().manual_seed(0)
    return StepRequest(device_id="dev-000", step=0, fx=WireTensor(**encode_tensor(torch.randn(64, 32, 14, 14, generator=gen))),
                       labels=WireTensor(**encode_tensor(torch.randint(0, 10, (64,), generator=gen))))


@pytest.fixture(scope="module")
def echo() -> Iterator[tuple[str, CollectorRegistry]]:
    registry = CollectorRegistry()
    app = create_service_app("echo", "echo", "echo", registry=registry)

    @app.post("/echo")
    async def _echo(request: Request):
        body = b"".join([chunk async for chunk in request.stream()])
        return msgpack_response(Received(content_length=request.headers.get("content-length"),
                                         transfer_encoding=request.headers.get("transfer-encoding"), body=body))

    # The socket listens before the server thread starts: a connection made at once waits in the
    # backlog until uvicorn accepts it, so nothing has to wait for the start-up.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", registry
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_the_client_sends_a_body_in_pieces_with_its_length(echo):
    url, _ = echo
    req = _step_request()
    assert len(pack_body(req.model_dump()).pieces) == 3  # the activation's bytes are a piece of their own
    client = SyncClient(url, retries=0)
    try:
        got = client.call("POST", "/echo", Received, req)
    finally:
        client.close()
    expected = msgpack.packb(req.model_dump(), use_bin_type=True)
    assert got.body == expected
    # Sized, not chunked: chunked framing would make h11 join every piece with its frame (a copy).
    assert got.content_length == str(len(expected)) and got.transfer_encoding is None
    assert client.bytes.up == len(expected)


def test_the_async_sender_posts_a_body_in_pieces_with_its_length_and_again_whole(echo):
    url, _ = echo
    req = _step_request()
    body = pack_body(req.model_dump())
    expected = msgpack.packb(req.model_dump(), use_bin_type=True)

    async def post_twice() -> list[Received]:
        async with httpx.AsyncClient() as client:   # the same body twice: what a retry sends
            return [Received.model_validate(msgpack.unpackb((await post_body(client, f"{url}/echo", body)).content))
                    for _ in range(2)]
    for got in asyncio.run(post_twice()):
        assert got.body == expected
        assert got.content_length == str(len(expected)) and got.transfer_encoding is None


def test_a_server_answers_a_body_in_pieces_with_its_length(echo):
    url, registry = echo
    sent = msgpack.packb(_step_request().model_dump(), use_bin_type=True)
    before = registry.get_sample_value("sfl_http_body_bytes_total", {"route": "/echo", "direction": "sent"}) or 0.0
    resp = httpx.post(f"{url}/echo", content=sent, headers={"content-type": "application/msgpack"})
    answer = Received(content_length=str(len(sent)), transfer_encoding=None, body=sent)
    expected = msgpack.packb(answer.model_dump(), use_bin_type=True)
    assert len(pack_body(answer.model_dump()).pieces) == 2  # the echoed body, last, is a piece of its own
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/msgpack"
    assert resp.headers["content-length"] == str(len(expected)) and "transfer-encoding" not in resp.headers
    assert resp.content == expected
    # Every piece passed the body-bytes middleware: the route's "sent" counter grew by the whole body.
    after = registry.get_sample_value("sfl_http_body_bytes_total", {"route": "/echo", "direction": "sent"})
    assert after - before == len(expected)


def test_an_answer_s_pieces_are_its_asgi_body_messages_uncopied():
    answer = Received(content_length=None, transfer_encoding=None, body=b"\x01" * (1 << 17))
    messages: list[dict] = []

    async def send(message: dict) -> None:
        messages.append(message)

    asyncio.run(msgpack_response(answer)({"type": "http"}, None, send))
    assert messages[0]["type"] == "http.response.start"
    bodies = messages[1:]
    assert [(m["type"], m["more_body"]) for m in bodies] == [("http.response.body", True), ("http.response.body", False)]
    assert bodies[1]["body"] is answer.body  # the long byte string itself, not a copy
    assert b"".join(m["body"] for m in bodies) == msgpack.packb(answer.model_dump(), use_bin_type=True)


def test_an_answer_runs_the_background_tasks_fastapi_attaches_after_its_body():
    response = msgpack_response(Received(content_length=None, transfer_encoding=None, body=b""))
    events: list[str] = []
    response.background = BackgroundTask(events.append, "background")

    async def send(message: dict) -> None:
        events.append(message["type"])

    asyncio.run(response({"type": "http"}, None, send))
    assert events == ["http.response.start", "http.response.body", "background"]
