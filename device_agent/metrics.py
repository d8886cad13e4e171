"""The device agent's optional Prometheus port (``--metrics-port``, off by default).

Devices also report their per-round timings to the Fed Server inside every upload, which exports
them (``sfl_fed_device_round_seconds``), so devices behind NAT stay observable without this port.
The port is for devices that a Prometheus can reach directly. ``device`` labels are bounded by the
shards the agent hosts. prometheus-client is pure Python and part of the agent's minimal install.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from shared.http_metrics import MetricSpec, metric_maker, new_registry

PHASES = ("compute", "transfer", "wait", "server", "total")
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: Every metric of the agent's port (besides process_*/python_*); docs/metrics.md mirrors it.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("sfl_device_rounds_completed_total", "counter", ("device",), "rounds the device trained and uploaded"),
    MetricSpec("sfl_device_last_round", "gauge", ("device",), "id of the device's last uploaded round"),
    MetricSpec("sfl_device_split_point", "gauge", ("device",), "blocks the device trained in its last round (the split point)"),
    MetricSpec("sfl_device_round_seconds", "gauge", ("device", "phase"), "the device's timings of its last round: compute, transfer, wait, server, total"),
    MetricSpec("sfl_device_phase_duration_seconds", "histogram", ("phase",), "round timings of every device of the agent, by phase"),
    MetricSpec("sfl_device_main_server_bytes_total", "counter", ("device", "direction"), "body bytes exchanged with the Main Server (join and steps): sent, received"),
    MetricSpec("sfl_device_train_loss", "gauge", ("device",), "mean training loss of the device's last round"),
)


#: The header Prometheus sends with every scrape: how a scrape is told from a health check's GET.
SCRAPE_HEADER = "X-Prometheus-Scrape-Timeout-Seconds"


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:   # no line per scrape
        pass


class _AfterSent:
    """A WSGI answer that calls ``sent`` once every byte of it is written to the socket: an agent
    that exits then has handed its answer to the kernel, which delivers it.

    wsgiref writes each piece before it asks for the next, so the iteration runs past the last
    piece only after that piece is written; it then calls ``close()``, also after a failed write,
    which therefore calls ``sent`` only for an answer written whole."""

    def __init__(self, body: Iterable[bytes], sent: Callable[[], None]) -> None:
        self.body = body
        self.sent = sent
        self.written = False

    def __iter__(self) -> Iterator[bytes]:
        yield from self.body
        self.written = True

    def close(self) -> None:
        try:
            close = getattr(self.body, "close", None)
            if close is not None:
                close()
        finally:
            if self.written:
                self.sent()


class AgentMetrics:
    """Per-device round timings of one agent process, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        # Prometheus's scrapes in the order they arrived, and the newest of them whose answer is sent.
        self._scrapes_begun = 0
        self._newest_sent = -1
        self._scraped = threading.Condition()
        make = metric_maker(self.registry, METRICS)

        self.rounds = make(Counter, "sfl_device_rounds_completed_total")
        self.last_round = make(Gauge, "sfl_device_last_round")
        self.split_point = make(Gauge, "sfl_device_split_point")
        self.round_seconds = make(Gauge, "sfl_device_round_seconds")
        self.phase = make(Histogram, "sfl_device_phase_duration_seconds", buckets=PHASE_BUCKETS)
        self.main_bytes = make(Counter, "sfl_device_main_server_bytes_total")
        self.train_loss = make(Gauge, "sfl_device_train_loss")
        for phase in PHASES:
            self.phase.labels(phase)

    def add_device(self, device_id: str) -> None:
        """Create the device's series at zero, so it shows before its first round."""
        self.rounds.labels(device_id)
        for direction in ("sent", "received"):
            self.main_bytes.labels(device_id, direction)

    def observe_upload(self, update, split_point: int | None = None) -> None:
        """Fold an ``UpdateRequest`` the device sent (successfully) into the metrics."""
        device = update.device_id
        self.rounds.labels(device).inc()
        self.last_round.labels(device).set(update.round_id)
        if split_point is not None:
            self.split_point.labels(device).set(split_point)
        self.train_loss.labels(device).set(update.train_loss)
        timings = update.timings.model_dump()
        for phase in PHASES:
            value = timings.get(f"{phase}_s")
            if value is not None:
                self.round_seconds.labels(device, phase).set(value)
                self.phase.labels(phase).observe(value)
        self.main_bytes.labels(device, "sent").inc(update.bytes_up)
        self.main_bytes.labels(device, "received").inc(update.bytes_down)

    def serve(self, port: int, host: str = "127.0.0.1") -> tuple[WSGIServer, threading.Thread]:
        """Serve ``/metrics`` on ``host:port`` from a daemon thread; returns (server, thread).

        prometheus-client's own server, but for noting each scrape by Prometheus (a request with
        :data:`SCRAPE_HEADER`): numbered when it arrives, before the figures are collected, and
        marked sent once its answer is written, so that :meth:`wait_for_scrape` knows the final
        figures were taken and delivered."""
        exposition = make_wsgi_app(self.registry)
        scrape_key = "HTTP_" + SCRAPE_HEADER.upper().replace("-", "_")

        def app(environ, start_response):
            if scrape_key not in environ:
                return exposition(environ, start_response)
            with self._scraped:
                index = self._scrapes_begun
                self._scrapes_begun += 1
            return _AfterSent(exposition(environ, start_response), lambda: self._scrape_sent(index))

        server_class = type("MetricsServer", (_MetricsServer,), {
            "address_family": socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]})   # "::" too
        server: WSGIServer = make_server(host, port, app, server_class, handler_class=_QuietHandler)
        thread = threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True)
        thread.start()
        return server, thread

    def _scrape_sent(self, index: int) -> None:
        with self._scraped:
            self._newest_sent = max(self._newest_sent, index)
            self._scraped.notify_all()

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Wait until Prometheus scrapes ``/metrics`` once more and has its answer (a scrape that
        arrives after this call, so it takes every figure recorded before it), or ``timeout_s``;
        whether it did.

        An agent exits when its run ends; without this its last round's figures, recorded after
        the previous scrape, would never reach Prometheus (``--metrics-linger-s``). Waiting for
        the answer to be written, not only for the request: an agent that exited as the request
        came in cut the answer off, and Prometheus marked it down (the compose check, once)."""
        with self._scraped:
            first = self._scrapes_begun
            return self._scraped.wait_for(lambda: self._newest_sent >= first, timeout_s)
