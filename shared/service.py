"""What every service process does on start: logging, one torch thread, its CLI basics."""
from __future__ import annotations

import argparse
import faulthandler
import gc
import logging
import math
import os
import signal
from typing import TYPE_CHECKING

from shared.config import env_default, env_switch

if TYPE_CHECKING:   # torch is imported when a process starts, not when this module is
    import torch


def configure_process(log_level: str = "INFO", threads: int | None = None, torch_device: "torch.device | None" = None) -> None:
    """Logging format (identical lines folded, :mod:`shared.log_limit`), torch threads and the
    allocator's arenas; logs the ``--torch-device`` when it is not the CPU. ``kill -USR2 <pid>``
    writes every thread's stack to the process's stderr (its log), to see where a service that
    went silent waits, without stopping it (docs/operations.md, "A silent service").

    One torch thread per process by default: two processes each using two threads on two cores
    run many times slower than with one thread each (measured on the 2-core dev machines). As
    many malloc arenas as threads compute at once (:func:`shared.machine.limit_allocator_arenas`).
    """
    import torch

    from shared.log_limit import limit_repeats
    from shared.machine import compute_workers, limit_allocator_arenas

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if hasattr(signal, "SIGUSR2"):   # not on Windows
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    limit_repeats()   # a device repeating a request in a loop must not decide how much the log writes
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the useful ones
    torch.set_num_threads(threads or int(os.environ.get("SFL_TORCH_THREADS", "1")))
    limit_allocator_arenas(compute_workers())
    if torch_device is not None and str(torch_device) != "cpu":
        logging.getLogger("service").info("computing on torch device %s", torch_device)


def freeze_startup_objects() -> None:
    """Collect garbage once, then take every object alive now out of the cyclic garbage
    collector's reach (``gc.freeze``): called when a service has built what it keeps for its
    lifetime and is about to serve or run.

    What is alive then (modules, classes, functions, torch's and FastAPI's machinery, the app:
    hundreds of thousands of tracked objects in a Main Server) lives as long as the process, so no
    collection ever frees any of it; yet every full collection traversed all of it, holding the
    GIL, every thread stopped, a device step answered that much later. Frozen, a full collection
    walks only what was made since; objects made later are collected as before (measured:
    benchmarks/why-the-code-is-as-it-is.md, "Startup objects frozen out of the collector"). The
    collection first costs one full traversal at start and frees what is already garbage then,
    which a freeze alone would keep for good.
    """
    gc.collect()
    gc.freeze()


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
        try:
            settings = load_config_file(pre.settings)
        except ValueError as exc:   # missing, unreadable, or a syntax error: file and line, no traceback
            parser.error(str(exc))
        for key, value in settings.items():
            dest = known.get(key.replace("-", "_"))
            if dest is None or dest in ("help", "settings"):
                parser.error(f"{pre.settings}: unknown setting {key!r}")
            if f"SFL_{dest.upper()}" not in os.environ:  # the environment beats the file
                values[dest] = value
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Flags every service has: log level, torch threads and torch device."""
    from shared.torch_device import TORCH_DEVICE_CHOICES, torch_device_flag

    parser.add_argument("--log-level", default=env_default("log_level", "INFO"), help="logging level (env SFL_LOG_LEVEL)")
    parser.add_argument("--threads", dest="torch_threads", type=int, default=int(env_default("torch_threads", 1)),
                        help="torch threads for this process (env SFL_TORCH_THREADS; default 1)")
    # Default cpu, not auto: seeded runs stay bit-for-bit reproducible, and a testbed's many
    # processes on one machine do not each open a CUDA context unless asked (docs/deployment.md).
    parser.add_argument("--torch-device", type=torch_device_flag, default=env_default("torch_device", "cpu"),
                        help=f"where this process computes: {TORCH_DEVICE_CHOICES} (env SFL_TORCH_DEVICE; default cpu; "
                             "auto = cuda if available, else mps, else cpu). Refused at start if not available")


#: A request body slower than this many bytes a second on average, judged from
#: ``DEFAULT_BODY_GRACE_S`` after its head on, is cut off (--min-body-rate, --body-grace-s): far
#: below any real link, far above a slowloris trickle.
DEFAULT_MIN_BODY_RATE = 1024
DEFAULT_BODY_GRACE_S = 10.0


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
                             "this many seconds after the head's first byte, or after the connection opened when "
                             "nothing comes (env SFL_HEAD_TIMEOUT_S; default 10)")
    parser.add_argument("--min-body-rate", type=positive_rate,
                        default=positive_rate(env_default("min_body_rate", DEFAULT_MIN_BODY_RATE)),
                        help="answer 408 and close a connection whose request body comes slower than this many bytes "
                             "a second on average, judged from --body-grace-s after its head on (env SFL_MIN_BODY_RATE; "
                             f"default {DEFAULT_MIN_BODY_RATE})")
    parser.add_argument("--body-grace-s", type=positive_seconds,
                        default=positive_seconds(env_default("body_grace_s", DEFAULT_BODY_GRACE_S)),
                        help="seconds a request body may take before --min-body-rate is applied to it "
                             f"(env SFL_BODY_GRACE_S; default {DEFAULT_BODY_GRACE_S:g})")
    parser.add_argument("--keep-alive-s", type=positive_seconds, default=positive_seconds(env_default("keep_alive_s", 5)),
                        help="close a kept-alive connection idle this many seconds after a response "
                             "(env SFL_KEEP_ALIVE_S; default 5)")
    parser.add_argument("--shutdown-grace-s", type=positive_seconds,
                        default=positive_seconds(env_default("shutdown_grace_s", 3)),
                        help="on SIGTERM or Ctrl-C, cancel the requests still running this many seconds later: "
                             "answers held for work or status (long-poll), watch streams, steps at a barrier "
                             "(env SFL_SHUTDOWN_GRACE_S; default 3)")
    parser.add_argument("--wait-on-refusal", action=argparse.BooleanOptionalAction,
                        default=env_switch("wait_on_refusal"),
                        help="when the server cannot start (a configuration error, a secret that cannot be read; the Fed "
                             "Server: a configuration other than the unfinished run's), log why and keep serving: "
                             "/livez answers 200, /healthz and every /v1 route 503 with the reason, instead of exiting "
                             "with code 2 (env SFL_WAIT_ON_REFUSAL): for a supervisor that would restart it for ever")
    add_common_args(parser)


def positive_seconds(value: str | float) -> float:
    """A duration flag's value: a finite number of seconds above zero."""
    return _positive(value, "seconds")


def positive_rate(value: str | float) -> float:
    """A rate flag's value: a finite number of bytes a second above zero."""
    return _positive(value, "bytes a second")


def _positive(value: str | float, unit: str) -> float:
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of {unit}")
    return number


def interrupt_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``, ``docker stop``, a Kubernetes pod's end) raise
    KeyboardInterrupt in the main thread, so a process stops the way Ctrl-C stops it: the testbed's
    ``with Testbed(...)`` blocks stop their services instead of orphaning them, and a device agent
    stops its devices and exits instead of being killed at the end of the grace period (Python
    running as a container's PID 1 otherwise ignores SIGTERM)."""
    def _interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)
