"""Bodies holding tensors travel as their pieces (shared.wire.Body), both ways, and arrive whole.

The device's blocking client and the servers' async sender (``post_body``: uploads, round plans;
shared/http_client.py) send a request body piece by piece, and the servers' msgpack answers (http_api/server.py) go out the same way; both under the body's
Content-Length, never chunked. A real uvicorn server on a loopback port, built by
``create_service_app`` like the Fed and Main Servers, runs an echo route that answers what it
received: the framing headers and the raw body bytes.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import msgpack
import pytest
import torch
import uvicorn
from fastapi import Request
from prometheus_client import CollectorRegistry
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from http_api.server import create_service_app, msgpack_response
from shared.http_client import Cancellation, Cancelled, SyncClient, post_body
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

    with _served(app) as url:
        yield url, registry


@contextlib.contextmanager
def _served(app) -> Iterator[str]:
    """``app`` on a real uvicorn server on a loopback port, for the block; its URL."""
    # The socket listens before the server thread starts: a connection made at once waits in the
    # backlog until uvicorn accepts it, so nothing has to wait for the start-up.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
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


@pytest.fixture(scope="module")
def slow() -> Iterator[tuple[str, list[int], threading.Event]]:
    """A server whose ``/slow`` answer is 40 pieces of 64 KiB, 50 ms apart (2 s in all; with
    ``stall_s``, that long after the second): the pieces it sent, and an event set when its answer
    stopped (finished or cut off)."""
    app = create_service_app("slow", "slow", "slow", registry=CollectorRegistry())
    sent: list[int] = []
    stopped = threading.Event()

    @app.get("/slow")
    async def _slow(stall_s: float = 0.0):
        async def pieces():
            try:
                for i in range(40):
                    sent.append(i)
                    yield b"\0" * 65536
                    await asyncio.sleep(stall_s if i == 1 else 0.05)   # stall_s: nothing for that long after two
            finally:
                stopped.set()
        return StreamingResponse(pieces(), media_type="application/msgpack")

    with _served(app) as url:
        yield url, sent, stopped


def test_a_call_given_up_while_its_answer_arrives_closes_the_connection_and_counts_what_came(slow):
    url, sent, stopped = slow
    sent.clear()
    stopped.clear()
    cancel = Cancellation()
    threading.Timer(0.3, cancel.set).start()   # a few pieces in

    client = SyncClient(url, retries=0)
    try:
        with pytest.raises(Cancelled, match="given up after"):
            client.call("GET", "/slow", Received, cancel=cancel)
        assert client.bytes.down < 40 * 65536
    finally:
        client.close()
    # The server saw the connection close and stopped sending: it never sent the answer's end.
    assert stopped.wait(10)
    assert len(sent) < 40


def test_a_call_that_is_never_cancelled_reads_its_answer_whole(echo):
    url, _ = echo
    req = _step_request()
    client = SyncClient(url, retries=0)
    try:
        got = client.call("POST", "/echo", Received, req, cancel=Cancellation())
    finally:
        client.close()
    assert got.body == msgpack.packb(req.model_dump(), use_bin_type=True)
    assert client.bytes.down == len(msgpack.packb(got.model_dump(), use_bin_type=True))


def test_a_compressed_answer_read_piece_by_piece_is_decoded_once(echo):
    # A proxy in front of a server may compress its answers: the pieces are read as they came, and
    # decoded as httpx decodes an answer it reads whole.
    import gzip

    answer = Received(content_length=None, transfer_encoding=None, body=b"x" * 100_000)
    packed = msgpack.packb(answer.model_dump(), use_bin_type=True)
    transport = httpx.MockTransport(lambda request: httpx.Response(   # a stream, as from a socket
        200, headers={"content-encoding": "gzip", "content-type": "application/msgpack"},
        stream=httpx.ByteStream(gzip.compress(packed))))
    client = SyncClient("http://proxy", retries=0)
    client._http = httpx.Client(base_url="http://proxy", transport=transport)
    try:
        assert client.call("GET", "/answer", Received, cancel=Cancellation()) == answer
    finally:
        client.close()



def test_a_call_given_up_while_its_answer_has_stalled_returns_at_once(slow):
    # A link that dropped mid-answer can deliver nothing for many seconds: the read waits on the
    # socket, and setting the cancellation shuts the connection under it.
    url, sent, stopped = slow
    sent.clear()
    stopped.clear()
    cancel = Cancellation()
    client = SyncClient(url, retries=0)
    try:
        threading.Timer(0.3, cancel.set).start()
        started = time.monotonic()
        with pytest.raises(Cancelled, match="given up after"):
            client.call("GET", "/slow?stall_s=60", Received, cancel=cancel)
        assert time.monotonic() - started < 30
    finally:
        client.close()
