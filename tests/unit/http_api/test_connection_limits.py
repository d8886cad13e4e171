"""``http_api.serve.head_timeout_protocol`` on a real uvicorn server on loopback: what a client is
late with is cut off; what the server is late with (a handler that has not asked for the body yet,
a loop busy computing) is not held against the client.

``GET /block`` sleeps on the event loop, as a handler computing on it would: bytes that arrive
meanwhile wait unread while the limits' timers fall due. ``POST /late`` waits ``wait_s`` before it
reads its body. Raw sockets; every wait is bounded.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import Request

from http_api.serve import head_timeout_protocol
from http_api.server import arrival_seconds, create_service_app, read_body

HEAD_TIMEOUT_S = 1.0
MIN_BODY_RATE = 20_000.0
BODY_GRACE_S = 1.0
BLOCK_S = 2.5          # longer than both the head timeout and the body grace
GIVE_UP_S = 20.0

Address = tuple[str, int]


@pytest.fixture(scope="module")
def url() -> Iterator[Address]:
    app = create_service_app("limits", "limits", "limits")

    @app.post("/late")
    async def late(request: Request, wait_s: float = 0.0) -> dict:
        await asyncio.sleep(wait_s)
        body = await read_body(request.stream(), request.headers.get("content-length"), 10 ** 7)
        return {"bytes": len(body)}

    @app.post("/timed")
    async def timed(request: Request, wait_s: float = 0.0) -> dict:
        await asyncio.sleep(wait_s)
        since = time.monotonic()
        body = await read_body(request.stream(), request.headers.get("content-length"), 10 ** 7)
        return {"bytes": len(body), "arrival_s": arrival_seconds(request, since)}

    @app.get("/block")
    async def block() -> dict:
        time.sleep(BLOCK_S)   # on the event loop: the server is busy, no socket is read meanwhile
        return {"blocked_s": BLOCK_S}

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    # log_config=None: uvicorn's loggers propagate, so a test sees what the server logs (caplog).
    config = uvicorn.Config(app, log_config=None, lifespan="off",
                            http=head_timeout_protocol(HEAD_TIMEOUT_S, MIN_BODY_RATE, BODY_GRACE_S))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()
    server.should_exit = True
    thread.join(10)
    sock.close()


def connect(address: Address) -> socket.socket:
    return socket.create_connection(address, timeout=GIVE_UP_S)


def response(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of one response (read until its Content-Length is complete)."""
    data = b""
    deadline = time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            if len(body) >= length:
                return int(head.split(b" ")[1]), json.loads(body[:length])
    raise AssertionError(f"no complete response: {data[:300]!r}")


def post_head(length: int, wait_s: float = 0.0, *extra: str, path: str = "/late") -> bytes:
    lines = [f"POST {path}?wait_s={wait_s} HTTP/1.1", "Host: x", f"Content-Length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def block_the_server(address: Address) -> socket.socket:
    """Ask for ``GET /block``; the server's loop is busy for ``BLOCK_S`` from about now."""
    sock = connect(address)
    sock.sendall(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    return sock


def test_a_body_trickled_below_the_minimum_rate_is_answered_408_and_closed(url, caplog):
    caplog.set_level(logging.INFO)
    sock = connect(url)
    try:
        sock.sendall(post_head(10_000))
        started = time.monotonic()
        sock.settimeout(0.1)
        answer = b""
        while time.monotonic() - started < GIVE_UP_S and not answer:
            try:
                sock.sendall(b"x")   # 10 bytes a second
                answer = sock.recv(65536)
            except socket.timeout:
                continue
        took = time.monotonic() - started
        sock.settimeout(GIVE_UP_S)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 Request Timeout"), answer
        assert json.loads(body) == {"detail": "request body too slow: under 20000 bytes/s"}
        assert sock.recv(65536) == b""   # and the connection is closed
    finally:
        sock.close()
    assert BODY_GRACE_S * 0.8 <= took <= BODY_GRACE_S + 5.0, took
    time.sleep(0.2)   # the handler that waited for the body has seen the disconnect by now
    said = [r.getMessage() for r in caplog.records if r.name == "http_api"]
    assert len(said) == 1 and "the body of POST /late came at" in said[0], said
    assert "below the minimum of 20000 bytes/s" in said[0], said
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text   # no traceback of the handler


def test_a_body_on_pace_past_the_grace_is_read_whole(url):
    sock = connect(url)
    try:
        sock.sendall(post_head(120_000))
        for _ in range(20):   # 6 KB every 0.1 s: about 60 KB/s over 2 s, checked again and again
            sock.sendall(b"x" * 6_000)
            time.sleep(0.1)
        assert response(sock) == (200, {"bytes": 120_000})
    finally:
        sock.close()


def test_a_body_the_handler_has_not_asked_for_yet_is_not_judged_slow(url):
    # 300 KB at once: uvicorn stops reading after 64 KiB until the handler reads, 4 s later.
    sock = connect(url)
    try:
        sock.sendall(post_head(300_000, wait_s=4.0) + b"x" * 300_000)
        assert response(sock) == (200, {"bytes": 300_000})
    finally:
        sock.close()


def test_a_client_waiting_for_100_continue_is_not_judged_slow(url):
    sock = connect(url)
    try:
        sock.sendall(post_head(5_000, 2.5, "Expect: 100-continue"))
        assert sock.recv(65536).startswith(b"HTTP/1.1 100 Continue")   # once the handler reads, 2.5 s on
        sock.sendall(b"x" * 5_000)
        assert response(sock) == (200, {"bytes": 5_000})
    finally:
        sock.close()


def test_the_head_timeout_counts_from_the_heads_first_byte(url):
    sock = connect(url)
    try:
        time.sleep(HEAD_TIMEOUT_S * 0.7)   # connected, nothing sent yet
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(0, len(head), 12):   # over 0.6 of the timeout: done 1.3 timeouts after connecting
            sock.sendall(head[i:i + 12])
            time.sleep(HEAD_TIMEOUT_S * 0.2)
        assert response(sock)[0] == 200
    finally:
        sock.close()


def test_a_head_that_arrived_while_the_server_was_busy_is_served(url):
    sock = connect(url)   # accepted now: its head timer falls due while the server is busy
    try:
        time.sleep(0.2)
        blocker = block_the_server(url)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")   # arrives, waits unread
        assert response(sock)[0] == 200
        assert response(blocker) == (200, {"blocked_s": BLOCK_S})
    finally:
        sock.close()


def test_a_body_that_arrived_while_the_server_was_busy_is_not_judged_slow(url):
    sock = connect(url)
    try:
        sock.sendall(post_head(5_000))   # read at once: the body's clock starts
        time.sleep(0.2)
        blocker = block_the_server(url)
        sock.sendall(b"x" * 5_000)   # arrives, waits unread past the grace
        assert response(sock) == (200, {"bytes": 5_000})
        assert response(blocker)[0] == 200
    finally:
        sock.close()


def test_a_request_is_timed_from_its_heads_first_byte_to_its_bodys_last(url):
    # What the client spent sending it (a device's upload over a slow link): 5 pieces 0.2 s apart.
    sock = connect(url)
    try:
        sock.sendall(post_head(50_000, path="/timed"))
        for _ in range(5):
            time.sleep(0.2)
            sock.sendall(b"x" * 10_000)
        status, answer = response(sock)
    finally:
        sock.close()
    assert status == 200 and answer["bytes"] == 50_000
    assert 0.95 <= answer["arrival_s"] <= 1.5, answer


def test_a_handler_that_reads_late_does_not_lengthen_what_the_client_spent(url):
    # The whole request arrives at once; the handler reads it 1 s later: the client spent ~0 s.
    sock = connect(url)
    try:
        sock.sendall(post_head(20_000, 1.0, path="/timed") + b"x" * 20_000)
        status, answer = response(sock)
    finally:
        sock.close()
    assert status == 200 and answer["bytes"] == 20_000
    assert answer["arrival_s"] < 0.3, answer
