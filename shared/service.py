"""What every service process does on start: logging, one torch thread, its CLI basics."""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os

from shared.config import env_default

log = logging.getLogger("service")


def configure_process(log_level: str = "INFO", threads: int | None = None) -> None:
    """Logging format and torch threads.

    One torch thread per process by default: two processes each using two threads on two cores
    run many times slower than with one thread each (measured on the 2-core dev machines).
    """
    import torch

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the useful ones
    torch.set_num_threads(threads or int(os.environ.get("SFL_TORCH_THREADS", "1")))


def parse_service_args(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Parse flags, letting a ``--settings FILE`` (YAML mapping of flag names to values) supply defaults.

    Precedence: built-in defaults < settings file < ``SFL_*`` environment variables < flags.
    """
    from shared.config import load_config_file

    parser.add_argument("--settings", default=os.environ.get("SFL_SETTINGS"),
                        help="YAML/JSON file of this service's flags, e.g. 'port: 9000' (env SFL_SETTINGS)")
    pre, _ = parser.parse_known_args(argv)
    if pre.settings:
        # Keys are flag names without dashes ("fed-server-url", "threads") or their dest names.
        known: dict[str, str] = {}
        for action in parser._actions:
            known[action.dest] = action.dest
            for flag in action.option_strings:
                known[flag.lstrip("-").replace("-", "_")] = action.dest
        values = {}
        for key, value in load_config_file(pre.settings).items():
            dest = known.get(key.replace("-", "_"))
            if dest is None or dest in ("help", "settings"):
                parser.error(f"{pre.settings}: unknown setting {key!r}")
            if f"SFL_{dest.upper()}" not in os.environ:  # the environment beats the file
                values[dest] = value
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every service has: log level and torch threads."""
    parser.add_argument("--log-level", default=env_default("log_level", "INFO"), help="logging level (env SFL_LOG_LEVEL)")
    parser.add_argument("--threads", dest="torch_threads", type=int, default=int(env_default("torch_threads", 1)),
                        help="torch threads for this process (env SFL_TORCH_THREADS; default 1)")


def add_server_args(parser: argparse.ArgumentParser, default_port: int) -> None:
    """``--host``/``--port``, TLS and secrets, plus the common flags."""
    parser.add_argument("--host", default=env_default("host", "127.0.0.1"), help="address to bind (env SFL_HOST)")
    parser.add_argument("--port", type=int, default=int(env_default("port", default_port)),
                        help=f"port to listen on (env SFL_PORT; default {default_port})")
    parser.add_argument("--tls-cert", default=env_default("tls_cert", None),
                        help="serve HTTPS with this certificate (PEM; env SFL_TLS_CERT); needs --tls-key")
    parser.add_argument("--tls-key", default=env_default("tls_key", None), help="private key of --tls-cert (env SFL_TLS_KEY)")
    parser.add_argument("--ca-file", default=env_default("ca_file", None),
                        help="CA bundle to verify the other server's HTTPS certificate (env SFL_CA_FILE)")
    parser.add_argument("--service-secret-file", default=env_default("service_secret_file", None),
                        help="secret shared by the two servers; signs device tokens and authenticates server-to-server "
                             "calls (or env SFL_SERVICE_SECRET). Without it the server runs open")
    parser.add_argument("--head-timeout-s", type=positive_seconds, default=positive_seconds(env_default("head_timeout_s", 10)),
                        help="close a connection whose request head (request line and headers) is not complete "
                             "this many seconds after it opened or after the head's first byte (env SFL_HEAD_TIMEOUT_S; default 10)")
    parser.add_argument("--keep-alive-s", type=positive_seconds, default=positive_seconds(env_default("keep_alive_s", 5)),
                        help="close a kept-alive connection idle this many seconds after a response "
                             "(env SFL_KEEP_ALIVE_S; default 5)")
    add_common_args(parser)


def positive_seconds(value: str | float) -> float:
    """A duration flag's value: a finite number of seconds above zero."""
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return seconds


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
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

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
    the connection timeouts of ``--head-timeout-s`` and ``--keep-alive-s``."""
    import uvicorn

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), access_log=False,
                ssl_certfile=args.tls_cert, ssl_keyfile=args.tls_key, http=head_timeout_protocol(args.head_timeout_s),
                timeout_keep_alive=args.keep_alive_s)
