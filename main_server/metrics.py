"""The Main Server's Prometheus metrics (served at ``/metrics``; documented in docs/metrics.md).

Event metrics are fed by ``main_server/group_round.py`` (groups formed, step trained, members
dropped, group finished); the open round and its active groups are read at scrape time. No metric
carries a device or group label, so the number of series does not grow with the deployment.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.http_metrics import HTTP_METRICS, MetricSpec, metric_maker, new_registry

DISTANCE_BUCKETS = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TRAIN_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
DEADLINES = ("join", "step")

#: Every metric the Main Server exports (besides prometheus-client's process_*/python_* collectors).
#: docs/metrics.md mirrors this list; tests/unit/main_server/test_metrics.py checks both directions.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("sfl_main_current_round", "gauge", (), "id of the round whose plan the Main Server holds (0 before the first plan)"),
    MetricSpec("sfl_main_rounds_opened_total", "counter", (), "round plans accepted from the Fed Server"),
    MetricSpec("sfl_main_groups_active", "gauge", (), "groups of the open round that are still training"),
    MetricSpec("sfl_main_groups_formed_total", "counter", (), "groups formed (one server-side copy each)"),
    MetricSpec("sfl_main_group_label_distance", "histogram", (), "Eq. 2 label distance of each formed group (L2 distance of its pooled label distribution from uniform)"),
    MetricSpec("sfl_main_round_label_distance", "gauge", ("stat",), "Eq. 2 label distance over the groups of the latest round: mean, min, max"),
    MetricSpec("sfl_main_steps_total", "counter", (), "group steps trained (one per barrier release)"),
    MetricSpec("sfl_main_step_failures_total", "counter", (), "group steps whose server-side training raised (members got a 500)"),
    MetricSpec("sfl_main_step_duration_seconds", "histogram", (), "server-side training of one group step (its own training time, not its wait for a free training worker)"),
    MetricSpec("sfl_main_barrier_wait_seconds", "histogram", (), "per group step, how long the fastest member (the first to arrive) waited before the step began training: at the barrier, then for a free training worker"),
    MetricSpec("sfl_main_activation_bytes_total", "counter", (), "activation (fx) tensor bytes received in steps"),
    MetricSpec("sfl_main_gradient_bytes_total", "counter", (), "gradient (dfx) tensor bytes answered to devices"),
    MetricSpec("sfl_main_server_training_seconds_total", "counter", (), "server-portion training time, summed over all group steps"),
    MetricSpec("sfl_main_group_training_duration_seconds", "histogram", (), "server-portion training time of each finished group in its round"),
    MetricSpec("sfl_main_devices_dropped_total", "counter", ("deadline",), "participants dropped at a deadline: join (never joined before groups were formed), step (missed a step deadline)"),
    MetricSpec("sfl_main_steps_refused_total", "counter", (), "member steps refused by the step checks (tensors that do not decode or do not fit the group's batch, activations not finite or beyond grouping.max_activation, labels out of range); each dropped its sender from its group"),
    MetricSpec("sfl_main_members_not_finite_total", "counter", (), "members dropped because a group step came out not finite (their own loss or dfx, or nobody could be singled out); the step was not applied"),
    *HTTP_METRICS,
)
_HELP = {s.name: s.help for s in METRICS}


class _LiveCollector(Collector):
    def __init__(self, server) -> None:
        self.server = server

    def describe(self):
        return []

    def collect(self):
        state = self.server.round
        yield GaugeMetricFamily("sfl_main_current_round", _HELP["sfl_main_current_round"],
                                value=state.round_id if state is not None else 0)
        groups = list(getattr(state, "groups", None) or []) if state is not None and not state.abandoned else []
        yield GaugeMetricFamily("sfl_main_groups_active", _HELP["sfl_main_groups_active"],
                                value=sum(1 for g in groups if not g.finished))


class MainMetrics:
    """The Main Server's metric objects, in their own registry."""

    def __init__(self, server=None, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        make = metric_maker(self.registry, METRICS)

        self.rounds_opened = make(Counter, "sfl_main_rounds_opened_total")
        self.groups_formed = make(Counter, "sfl_main_groups_formed_total")
        self.group_distance = make(Histogram, "sfl_main_group_label_distance", buckets=DISTANCE_BUCKETS)
        self.round_distance = make(Gauge, "sfl_main_round_label_distance")
        self.steps = make(Counter, "sfl_main_steps_total")
        self.step_failures = make(Counter, "sfl_main_step_failures_total")
        self.step_duration = make(Histogram, "sfl_main_step_duration_seconds", buckets=STEP_BUCKETS)
        self.barrier_wait = make(Histogram, "sfl_main_barrier_wait_seconds", buckets=WAIT_BUCKETS)
        self.activation_bytes = make(Counter, "sfl_main_activation_bytes_total")
        self.gradient_bytes = make(Counter, "sfl_main_gradient_bytes_total")
        self.training_seconds = make(Counter, "sfl_main_server_training_seconds_total")
        self.group_training = make(Histogram, "sfl_main_group_training_duration_seconds", buckets=TRAIN_BUCKETS)
        self.dropped = make(Counter, "sfl_main_devices_dropped_total")
        for deadline in DEADLINES:
            self.dropped.labels(deadline)
        self.refused = make(Counter, "sfl_main_steps_refused_total")
        self.not_finite = make(Counter, "sfl_main_members_not_finite_total")
        for stat in ("mean", "min", "max"):
            self.round_distance.labels(stat)
        if server is not None:
            self.registry.register(_LiveCollector(server))

    # --- events (called from main_server/group_round.py) ----------------------------------------
    def round_opened(self) -> None:
        self.rounds_opened.inc()

    def groups_formed_with(self, distances: list[float], absent: int) -> None:
        """Groups of a round were formed: their Eq. 2 distances; ``absent`` participants never joined."""
        self.groups_formed.inc(len(distances))
        for d in distances:
            self.group_distance.observe(d)
        if distances:
            self.round_distance.labels("mean").set(sum(distances) / len(distances))
            self.round_distance.labels("min").set(min(distances))
            self.round_distance.labels("max").set(max(distances))
        if absent:
            self.dropped.labels("join").inc(absent)

    def step_trained(self, server_s: float, fastest_wait_s: float, activation_bytes: int, gradient_bytes: int) -> None:
        self.steps.inc()
        self.step_duration.observe(server_s)
        self.barrier_wait.observe(max(0.0, fastest_wait_s))
        self.training_seconds.inc(max(0.0, server_s))
        self.activation_bytes.inc(activation_bytes)
        self.gradient_bytes.inc(gradient_bytes)

    def step_failed(self) -> None:
        self.step_failures.inc()

    def members_dropped(self, cause: str, count: int) -> None:
        """``count`` members dropped from their group for ``cause``: ``deadline`` (a missed step
        deadline), ``checks`` (a refused step), ``non_finite`` (a step not finite),
        ``failed_step`` (counted as the step's failure, :meth:`step_failed`) or ``departed`` (the
        Fed Server took it out of the attempt; counted there, ``sfl_fed_devices_dropped_total``)."""
        if cause == "deadline":
            self.dropped.labels("step").inc(count)
        elif cause == "checks":
            self.refused.inc(count)
        elif cause == "non_finite":
            self.not_finite.inc(count)

    def group_finished(self, train_time_s: float) -> None:
        self.group_training.observe(train_time_s)
