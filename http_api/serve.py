"""Running a server app: uvicorn in this process, with the connection timeouts.

Server-only (uvicorn comes with the ``server`` extra); the flags it reads are defined in
``shared/service.py`` (``add_server_args``), which the device agent shares.
"""
from __future__ import annotations

import argparse
import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from shared.service import freeze_startup_objects

log = logging.getLogger("http_api")


def head_timeout_protocol(head_timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools, else h11) that closes a connection whose request head is
    not complete ``head_timeout_s`` after the connection opened or the head's first byte arrived.

    uvicorn itself only times out a keep-alive connection that is idle *after* a response; a client
    that opens a connection and sends nothing, or trickles a header a byte at a time (slowloris),
    holds it forever. The timer runs while the server waits for a request head and stops when the
    head is complete: the body and the handler's time (a step waiting at its group's barrier) are
    not limited by it. Both parsers create a new ``cycle`` when a head is complete, which is how
    completion is seen without hooking either parser.
    """
    class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_timer()   # a connection that never sends a byte is closed too

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm_head_timer()   # the first byte of the next request head on a kept-alive connection
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:
                self._cancel_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
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
            if not self.transport.is_closing():
                log.info("closing a connection whose request head was not complete within %.1fs", head_timeout_s)
                self.transport.close()

    return HeadTimeoutProtocol


def serve(app, args: argparse.Namespace) -> None:
    """Run an ASGI app with uvicorn in this process, over HTTPS when a certificate is given, with
    the connection timeouts of ``--head-timeout-s`` and ``--keep-alive-s``.

    On SIGTERM uvicorn waits for the requests still running before it stops, with no limit of its
    own; a status or task answer held for up to 30 s (long-poll) would hold the shutdown that long.
    ``--shutdown-grace-s`` bounds that wait: what still runs then is cancelled.

    The app and what it holds are built by now: they are frozen out of the garbage collector's
    full collections first (:func:`shared.service.freeze_startup_objects`)."""
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    freeze_startup_objects()
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key, http=head_timeout_protocol(args.head_timeout_s),
                timeout_keep_alive=args.keep_alive_s, timeout_graceful_shutdown=args.shutdown_grace_s)
