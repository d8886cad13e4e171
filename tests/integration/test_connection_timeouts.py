"""Slow and idle connections against the real servers: a request head that does not complete in
``--head-timeout-s`` from its first byte (slowloris, or nothing sent at all) is closed, a request
body slower than ``--min-body-rate`` after ``--body-grace-s`` is answered 408 and closed, and a
kept-alive connection idle for ``--keep-alive-s`` after a response is closed; a client within the
limits is served.
A request still running ``--shutdown-grace-s`` after SIGTERM is cancelled, so that it cannot hold
the server's exit.

Raw sockets on loopback; every loop is bounded by a deadline.
"""
from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import pytest

from integration_support import make_plan, server_pair, small_config
from shared.wire import packb

HEAD_TIMEOUT_S = 1.5
KEEP_ALIVE_S = 1.0
MIN_BODY_RATE = 2000
BODY_GRACE_S = 1.0
TIMEOUT_ARGS = ["--head-timeout-s", str(HEAD_TIMEOUT_S), "--keep-alive-s", str(KEEP_ALIVE_S),
                "--min-body-rate", str(MIN_BODY_RATE), "--body-grace-s", str(BODY_GRACE_S)]
#: A route of each server that reads a msgpack body: the Fed Server's registration (a FastAPI
#: route) and the Main Server's step (a lean route, served before FastAPI).
BODY_ROUTES = {"fed": "/v1/devices/register", "main": "/v1/rounds/1/step"}
GIVE_UP_S = 20.0   # far beyond both limits: a server that never closes fails the test, not hangs it


@pytest.fixture(scope="module")
def services():
    config = small_config(algorithm="s2fl", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200})
    with server_pair(config, "timeouts", fed_args=TIMEOUT_ARGS, main_args=TIMEOUT_ARGS) as pair:
        # The step route checks its round before it reads a body (a step for no open round is 409
        # from the head): round 1 is opened at the Main Server alone (the Fed Server, without
        # devices, never starts one).
        opened = httpx.post(f"{pair.main_url}/v1/rounds", content=packb(make_plan(1)),
                            headers={"content-type": "application/msgpack"}, timeout=30)
        assert opened.status_code == 200, opened.text
        yield {"fed": pair.fed_url, "main": pair.main_url, "processes": {"fed": pair.fed, "main": pair.main}}


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=GIVE_UP_S)
    sock.settimeout(0.05)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (EOF or reset); False while it is open."""
    try:
        return sock.recv(4096) == b""
    except (socket.timeout, BlockingIOError):
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def _trickle_until_closed(sock: socket.socket, data: bytes, every_s: float) -> float:
    """Send ``data`` one byte per ``every_s`` (repeating it) until the server closes the
    connection; the seconds that took. Fails after ``GIVE_UP_S``."""
    started = time.monotonic()
    i = 0
    while time.monotonic() - started < GIVE_UP_S:
        try:
            sock.sendall(data[i % len(data):i % len(data) + 1])
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        i += 1
        deadline = time.monotonic() + every_s
        while time.monotonic() < deadline:
            if _closed_by_peer(sock):
                return time.monotonic() - started
    raise AssertionError(f"the server kept a connection sending a partial head open for {GIVE_UP_S}s")


def _wait_closed(sock: socket.socket) -> float:
    started = time.monotonic()
    while time.monotonic() - started < GIVE_UP_S:
        if _closed_by_peer(sock):
            return time.monotonic() - started
    raise AssertionError(f"the server kept an idle connection open for {GIVE_UP_S}s")


def _read_response(sock: socket.socket) -> bytes:
    """One small response (``/healthz``): read until its body is complete."""
    data = b""
    deadline = time.monotonic() + GIVE_UP_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except (socket.timeout, BlockingIOError):
            continue
        if not chunk:
            break
        data += chunk
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(body) >= length:
                return data
    raise AssertionError(f"no complete response: {data[:300]!r}")


@pytest.mark.parametrize("server", ["fed", "main"])
def test_a_head_sent_slowly_is_cut_off_and_others_are_still_served(services, server):
    url = services[server]
    sock = _connect(url)
    try:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        # One header byte every 0.2 s: each byte would reset a per-read timeout, never completes the head.
        took = _trickle_until_closed(sock, b"X-Slow: aaaaaaaaaaaaaaaa\r\n", every_s=0.2)
    finally:
        sock.close()
    assert HEAD_TIMEOUT_S * 0.8 <= took <= HEAD_TIMEOUT_S + 5.0, took
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200


@pytest.mark.parametrize("server", ["fed", "main"])
def test_a_connection_that_sends_nothing_is_closed(services, server):
    sock = _connect(services[server])
    try:
        took = _wait_closed(sock)
    finally:
        sock.close()
    assert HEAD_TIMEOUT_S * 0.8 <= took <= HEAD_TIMEOUT_S + 5.0, took


@pytest.mark.parametrize("server", ["fed", "main"])
def test_a_slow_head_within_the_limit_is_served_then_the_idle_connection_is_closed(services, server):
    sock = _connect(services[server])
    try:
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(0, len(head), 12):   # in pieces over ~0.6 s: slow, but within the limit
            sock.sendall(head[i:i + 12])
            time.sleep(0.15)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        # The connection is kept alive: a second request on it is served too ...
        sock.sendall(head)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
        # ... and, idle afterwards, it is closed after the keep-alive timeout.
        took = _wait_closed(sock)
    finally:
        sock.close()
    assert KEEP_ALIVE_S * 0.8 <= took <= KEEP_ALIVE_S + 5.0, took



@pytest.mark.parametrize("server", ["fed", "main"])
def test_a_head_begun_late_on_an_open_connection_has_its_full_time(services, server):
    sock = _connect(services[server])
    try:
        time.sleep(HEAD_TIMEOUT_S * 0.7)   # connected, nothing sent yet
        head = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        for i in range(0, len(head), 12):   # complete 1.3 timeouts after connecting, 0.6 after its first byte
            sock.sendall(head[i:i + 12])
            time.sleep(HEAD_TIMEOUT_S * 0.2)
        assert _read_response(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


def _post_head(server: str, length: int) -> bytes:
    return (f"POST {BODY_ROUTES[server]} HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("server", ["fed", "main"])
def test_a_body_trickled_below_the_minimum_rate_is_answered_408_and_closed(services, server):
    sock = _connect(services[server])
    try:
        sock.sendall(_post_head(server, 5_000))
        started = time.monotonic()
        answer = b""
        while not answer and time.monotonic() - started < GIVE_UP_S:
            try:
                sock.sendall(b"\x00")   # 20 bytes a second: a hundredth of the minimum
            except (BrokenPipeError, ConnectionResetError):
                break
            deadline = time.monotonic() + 0.05
            while not answer and time.monotonic() < deadline:
                try:
                    answer = sock.recv(65536)
                except (socket.timeout, BlockingIOError):
                    pass
        took = time.monotonic() - started
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
        assert b"request body too slow: under 2000 bytes/s" in answer
        assert _wait_closed(sock) < 5.0
    finally:
        sock.close()
    assert BODY_GRACE_S * 0.8 <= took <= BODY_GRACE_S + 5.0, took
    assert httpx.get(f"{services[server]}/healthz", timeout=10).status_code == 200
    log = (services["processes"][server]).log_tail(200)
    assert f"the body of POST {BODY_ROUTES[server]} came at" in log and "Exception in ASGI application" not in log


@pytest.mark.parametrize("server", ["fed", "main"])
def test_an_upload_above_the_minimum_rate_reaches_its_handler(services, server):
    # 12 KB in 1 KB pieces over 2.4 s (5 KB/s), past the grace: the handler reads it whole and
    # answers it (400: zeros are not a msgpack message), where a slow one got 408.
    sock = _connect(services[server])
    try:
        sock.sendall(_post_head(server, 12_000))
        for _ in range(12):
            sock.sendall(b"\x00" * 1_000)
            time.sleep(0.2)
        answer = _read_response(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 400"), answer[:300]


def test_sigterm_answers_a_held_status_request_at_once_instead_of_waiting_out_the_shutdown_grace():
    # A status request held for up to 30 s (long-poll) would hold uvicorn's shutdown as long, or
    # until --shutdown-grace-s cancels it (cut off, no answer). A stopping server lets such
    # requests go first: the request is answered, and nothing is left to cancel. The grace here is
    # longer than the test waits, so a request left held would fail both checks.
    config = small_config(algorithm="fedavg", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200})
    with server_pair(config, "grace", fed_args=["--shutdown-grace-s", "60"]) as pair:
        held: dict = {}

        def ask() -> None:
            try:
                held["answer"] = httpx.get(f"{pair.fed_url}/v1/status", params={"wait_s": 30}, timeout=60).status_code
            except httpx.HTTPError as exc:
                held["answer"] = type(exc).__name__

        asker = threading.Thread(target=ask)
        asker.start()
        time.sleep(1.0)   # the request is being held: no device registers, so no record comes
        assert "answer" not in held
        pair.fed.process.send_signal(signal.SIGTERM)
        pair.fed.process.wait(timeout=GIVE_UP_S)
        asker.join(timeout=GIVE_UP_S)
        log = pair.fed.log_path.read_text()
    assert held["answer"] == 200, held
    assert "running task(s)" not in log, log[-2000:]   # uvicorn: "Cancel N running task(s), timeout graceful shutdown exceeded"
