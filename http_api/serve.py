"""Running a server app: uvicorn in this process, with the limits on slow and idle connections.

Server-only (uvicorn comes with the ``server`` extra); the flags it reads are defined in
``shared/service.py`` (``add_server_args``), which the device agent shares.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import NoReturn

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from http_api.server import ARRIVAL, create_refusal_app
from shared.service import DEFAULT_BODY_GRACE_S, DEFAULT_MIN_BODY_RATE, freeze_startup_objects

log = logging.getLogger("http_api")


def head_timeout_protocol(head_timeout_s: float, min_body_rate: float = DEFAULT_MIN_BODY_RATE,
                          body_grace_s: float = DEFAULT_BODY_GRACE_S) -> type:
    """uvicorn's HTTP protocol (httptools, else h11) with limits on slow clients: it closes a
    connection whose request head is not complete ``head_timeout_s`` after the head's first byte
    (or, when nothing is sent, after the connection opened), and answers 408 and closes one whose
    request body, ``body_grace_s`` after the head, has come in slower than ``min_body_rate`` bytes a
    second on average since the head.

    uvicorn itself only times out a keep-alive connection that is idle *after* a response; a client
    that opens a connection and sends nothing, trickles a header a byte at a time (slowloris), or
    trickles a body, holds it forever. The head timer runs while the server waits for a request
    head and stops when the head is complete: the body and the handler's time (a step waiting at
    its group's barrier) are not limited by it. (The function is long because it defines the
    protocol subclass for each parser in one closure over the limits.) Both parsers create a new ``cycle`` when a head is
    complete, which is how completion is seen without hooking either parser, and set the cycle's
    ``more_body`` to False when its body is complete.

    Only what the client is late with counts against it: the head's time starts with its first
    byte, not when the connection opened (a client may connect, then be busy before it sends), and
    the body's clock starts over while the server does not take the body (the handler has not
    asked for it yet: reading paused with 64 KiB waiting, or a 100-continue not yet sent). Bytes
    that arrive while the server is busy are read before a timer that fell due meanwhile runs
    (asyncio and uvloop both poll sockets first), so they count. A body that arrives with its head
    (a step on loopback) arms no timer at all.

    Each request's scope also carries when its head's first byte and its body's last byte came
    in (:data:`http_api.server.ARRIVAL`): how long the request took on the wire, which the Fed
    Server puts in a device's round time for its upload (:func:`http_api.server.arrival_seconds`).
    """
    # uvicorn picks AutoHTTPProtocol at import (httptools or h11), a variable to a type checker.
    class LimitedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_started = False
        _body_timer: asyncio.TimerHandle | None = None
        _body_since = 0.0
        _body_bytes = 0
        _head_at = 0.0

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()   # a connection that never sends a byte is closed too

        def data_received(self, data: bytes) -> None:
            if not self._head_started and (self.cycle is None or self.cycle.response_complete):
                self._head_started = True
                self._head_at = time.monotonic()
                self._arm_head_timer()   # the head's first byte: its time counts from here
            before = self.cycle
            more_before = before is not None and before.more_body
            super().data_received(data)
            cycle = self.cycle
            if cycle is not before:   # a head is complete
                self._head_started = False
                self._cancel_head_timer()
                self._cancel_body_timer()
                cycle.scope[ARRIVAL] = [self._head_at, None if cycle.more_body else time.monotonic()]
                if cycle.more_body and not self.transport.is_closing():
                    self._restart_body_clock()
                return
            if more_before and not cycle.more_body:
                cycle.scope[ARRIVAL][1] = time.monotonic()   # the body's last byte
            if self._body_timer is not None:
                if cycle.more_body:
                    self._body_bytes += len(data)
                else:
                    self._cancel_body_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            self._cancel_body_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(head_timeout_s, self._head_timed_out)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            log.info("closing a connection from %s whose request head was not complete within %.1fs",
                     _peer(self.client), head_timeout_s)
            self.transport.close()

        def _restart_body_clock(self) -> None:
            self._body_since = self.loop.time()
            self._body_bytes = 0
            self._body_timer = self.loop.call_later(body_grace_s, self._check_body_rate)

        def _cancel_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _check_body_rate(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if cycle is None or not cycle.more_body or self.transport.is_closing():
                return
            if self.flow.read_paused or cycle.waiting_for_100_continue:
                self._restart_body_clock()   # the server is not taking the body: not the client's delay
                return
            elapsed = self.loop.time() - self._body_since
            if self._body_bytes >= min_body_rate * elapsed:
                # On pace: look again when the average would fall below the minimum if nothing more came.
                self._body_timer = self.loop.call_at(self._body_since + self._body_bytes / min_body_rate,
                                                     self._check_body_rate)
                return
            log.info("closing a connection from %s: the body of %s %s came at %.0f bytes/s over %.1fs, below the "
                     "minimum of %.0f bytes/s", _peer(self.client), cycle.scope["method"], cycle.scope["path"],
                     self._body_bytes / elapsed, elapsed, min_body_rate)
            if not cycle.response_started:
                self.transport.write(_timeout_answer(self.server_state.default_headers, min_body_rate))
            # The handler waiting for the body gets a disconnect and sends nothing more.
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.close()

    return LimitedProtocol


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "an unknown client"


def _timeout_answer(default_headers: list[tuple[bytes, bytes]], min_body_rate: float) -> bytes:
    """The raw 408 answer to a body that came too slowly, JSON ``{"detail": ...}`` like every error."""
    body = json.dumps({"detail": f"request body too slow: under {min_body_rate:.0f} bytes/s"}).encode()
    head = [b"HTTP/1.1 408 Request Timeout"] + [name + b": " + value for name, value in default_headers] + [
        b"content-type: application/json", b"content-length: " + str(len(body)).encode(), b"connection: close"]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def serve(app, args: argparse.Namespace) -> None:
    """Run an ASGI app with uvicorn in this process, over HTTPS when a certificate is given, with
    the connection limits of ``--head-timeout-s``, ``--min-body-rate``, ``--body-grace-s`` and
    ``--keep-alive-s``.

    On SIGTERM uvicorn waits for the requests still running before it stops, with no limit of its
    own; a status or task answer held for up to 30 s (long-poll) would hold the shutdown that long.
    So the app's ``on_stopping`` callbacks (:class:`http_api.server.ServiceApp`) run first and let
    such answers go at once; ``--shutdown-grace-s`` bounds the wait for the rest (a step at its
    group's barrier): what still runs then is cancelled.

    The app and what it holds are built by now: they are frozen out of the garbage collector's
    full collections first (:func:`shared.service.freeze_startup_objects`)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    freeze_startup_objects()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                            ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key,
                            http=head_timeout_protocol(args.head_timeout_s, args.min_body_rate, args.body_grace_s),
                            timeout_keep_alive=args.keep_alive_s, timeout_graceful_shutdown=args.shutdown_grace_s)
    _StoppingServer(config, getattr(app, "on_stopping", [])).run()


class _StoppingServer(uvicorn.Server):
    """uvicorn's server, calling ``stopping`` before it waits for the requests still running."""

    def __init__(self, config: uvicorn.Config, stopping: list[Callable[[], None]]) -> None:
        super().__init__(config)
        self.stopping = stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for release in self.stopping:
            release()
        await super().shutdown(sockets)


def refuse_to_start(parser: argparse.ArgumentParser, args: argparse.Namespace, service: str, reason: str) -> NoReturn:
    """A server that cannot start: exit with code 2 and ``reason`` in one line, as argparse does for
    bad usage; with ``--wait-on-refusal`` log ``reason`` once and serve it until stopped
    (:func:`http_api.server.create_refusal_app`), so a supervisor that restarts exited servers does
    not restart this one into the same refusal for ever."""
    if args.wait_on_refusal:
        logging.getLogger(service).error("not starting: %s", reason)
        serve(create_refusal_app(service, reason), args)
        sys.exit(0)
    parser.exit(2, f"{parser.prog}: error: {reason}\n")
