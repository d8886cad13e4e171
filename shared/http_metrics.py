"""Prometheus plumbing shared by the servers (and the device agent's optional metrics port).

Every service keeps its metrics in its **own** :class:`prometheus_client.CollectorRegistry` (not the
process-global one), so several apps can live in one process (tests) without name clashes.

``MetricSpec`` rows are the documented list of metric names, types and labels; each service's
``metrics.py`` has a ``METRICS`` tuple of them that ``docs/metrics.md`` mirrors, and the unit tests
check the two against each other and against what the registry actually exports.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client import GCCollector, PlatformCollector, ProcessCollector

# Body bytes by route template and direction, exported by both servers (see BodyBytesMiddleware).
HTTP_BODY_BYTES = "sfl_http_body_bytes_total"
UNMATCHED_ROUTE = "unmatched"


@dataclass(frozen=True)
class MetricSpec:
    """One documented metric: full sample name (counters with ``_total``), type, labels, meaning."""

    name: str
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str


HTTP_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(HTTP_BODY_BYTES, "counter", ("route", "direction"),
               "HTTP body bytes by route template (message kind) and direction (received = request bodies, "
               "sent = response bodies)"),
)


def new_registry(process: bool = True) -> CollectorRegistry:
    """A fresh registry, with the standard process/platform/GC collectors unless ``process`` is false."""
    registry = CollectorRegistry(auto_describe=True)
    if process:
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in the Prometheus text format, with its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def body_bytes_counter(registry: CollectorRegistry) -> Counter:
    spec = HTTP_METRICS[0]
    return Counter(spec.name, spec.help, list(spec.labels), registry=registry)


def _route_template(scope: dict) -> str:
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) and path else UNMATCHED_ROUTE


class BodyBytesMiddleware:
    """Pure ASGI middleware counting request and response body bytes per route template.

    The label is the route's template (``/v1/rounds/{round_id}/step``), never the raw path, so the
    number of series is bounded by the number of routes; requests that match no route count as
    ``unmatched``.
    """

    def __init__(self, app, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await call_counting_body_bytes(self.app, self.counter, scope, receive, send)


async def call_counting_body_bytes(app, counter: Counter, scope, receive, send, route: str | None = None) -> None:
    """Run the ASGI ``app`` on an HTTP request, counting its request and response body bytes under
    ``route`` (None: the template of the route the router matched, see BodyBytesMiddleware).

    The middleware and the servers' lean routes (``http_api.server.ServiceApp``), which are served
    before the middleware stack, count through this one function.
    """
    received = 0
    sent = 0

    async def counting_receive():
        nonlocal received
        message = await receive()
        if message.get("type") == "http.request":
            received += len(message.get("body", b""))
        return message

    async def counting_send(message) -> None:
        nonlocal sent
        if message.get("type") == "http.response.body":
            sent += len(message.get("body", b""))
        await send(message)

    try:
        await app(scope, counting_receive, counting_send)
    finally:
        label = route if route is not None else _route_template(scope)
        if received:
            counter.labels(label, "received").inc(received)
        if sent:
            counter.labels(label, "sent").inc(sent)


def family_name(spec: MetricSpec) -> str:
    """The family name prometheus-client reports (counters drop ``_total``)."""
    return spec.name[: -len("_total")] if spec.type == "counter" and spec.name.endswith("_total") else spec.name


def exported_families(registry: CollectorRegistry) -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names) of what the registry exports now (histogram ``le`` left out)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for family in registry.collect():
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        out[family.name] = (family.type, labels)
    return out


def spec_mismatches(registry: CollectorRegistry, specs: Iterable[MetricSpec], prefix: str = "sfl_") -> list[str]:
    """Differences between what ``registry`` exports (families starting with ``prefix``) and the
    documented ``specs``: missing or undeclared families, wrong types, wrong label names."""
    exported = {k: v for k, v in exported_families(registry).items() if k.startswith(prefix)}
    declared = {family_name(s): s for s in specs}
    problems = [f"not exported: {n}" for n in sorted(set(declared) - set(exported))]
    problems += [f"not documented: {n}" for n in sorted(set(exported) - set(declared))]
    for name in sorted(set(exported) & set(declared)):
        kind, labels = exported[name]
        if kind != declared[name].type:
            problems.append(f"{name}: type {kind}, documented {declared[name].type}")
        if labels != set(declared[name].labels):
            problems.append(f"{name}: labels {sorted(labels)}, documented {sorted(declared[name].labels)}")
    return problems


def spec_names(specs: Iterable[MetricSpec]) -> list[str]:
    return [s.name for s in specs]


def metric_maker(registry: CollectorRegistry, specs: "tuple[MetricSpec, ...]"):
    """``make(cls, name, **kw)``: a metric of ``cls`` named, labelled and described by its spec.

    One place ties a metric to its documented spec, so code and docs/metrics.md cannot drift.
    """
    by_name = {s.name: s for s in specs}

    def make(cls, name: str, **kw):
        spec = by_name[name]
        return cls(name, spec.help, list(spec.labels), registry=registry, **kw)

    return make
