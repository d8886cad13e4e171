"""The Fed Server's Prometheus metrics (served at ``/metrics``; documented in docs/metrics.md).

Round-level values are fed by :meth:`FedMetrics.observe_round` with the round record that
``Progress.record`` returns (the record that goes to ``metrics.jsonl``); values that describe the
present (registered devices, current round, live replicas, time table) are read from the run's
parts at scrape time by a custom collector.

Cardinality: the only unbounded-looking label is ``device``. Device ids are a configured, bounded
set (one per data shard, ``data.num_devices``; the registry refuses shards beyond it), so
per-device series grow with the deployment, not with time. They are off by default for runs of
more than 1,000 devices (``FedServerSettings.per_device_series``), and can be turned on or off
(``--per-device-metrics`` / ``SFL_PER_DEVICE_METRICS``): the per-phase and
per-split-point aggregates below carry no device label and stay.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fed_server.coordinator import Coordinator
from fed_server.records import PrivacyRecord, RoundRecord
from shared.http_metrics import HTTP_METRICS, MetricSpec, metric_maker, new_registry

PHASES = ("compute", "transfer", "wait", "server", "total")
BYTE_DIRECTIONS = ("up", "down", "server")
ACTIVE_WINDOW_S = 30.0

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600)
AGGREGATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

#: Every metric the Fed Server exports (besides prometheus-client's process_*/python_* collectors).
#: docs/metrics.md mirrors this list; tests/unit/fed_server/test_metrics.py checks both directions.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("sfl_fed_current_round", "gauge", (), "id of the open round; the last completed round between rounds (0 before the first)"),
    MetricSpec("sfl_fed_rounds_configured", "gauge", (), "rounds the run is configured for (`rounds`)"),
    MetricSpec("sfl_fed_rounds_completed_total", "counter", ("status",), "completed rounds by status (ok, failed)"),
    MetricSpec("sfl_fed_round_duration_seconds", "histogram", (), "round time from selection to the end of aggregation and evaluation (record round_time_s)"),
    MetricSpec("sfl_fed_devices_registered", "gauge", (), "registered devices"),
    MetricSpec("sfl_fed_devices_expected", "gauge", (), "devices the run waits for (data.num_devices)"),
    MetricSpec("sfl_fed_devices_active", "gauge", (), f"registered devices that called the Fed Server in the last {ACTIVE_WINDOW_S:.0f} s"),
    MetricSpec("sfl_fed_round_devices", "gauge", ("state",), "devices of the last completed round by state: selected, aggregated, dropped"),
    MetricSpec("sfl_fed_devices_dropped_total", "counter", (), "selected devices that were not aggregated: taken out of the attempt (refused upload, withdrawal, dropped or absent at the Main Server, no group portion) or without an upload by the round deadline; the round record's left says why"),
    MetricSpec("sfl_fed_split_point_devices", "gauge", ("split_point",), "devices of the last completed round cut after each split point (blocks on the device)"),
    MetricSpec("sfl_fed_device_split_point", "gauge", ("device",), "blocks on the device in the last round it was selected (per-device series)"),
    MetricSpec("sfl_fed_device_round_seconds", "gauge", ("device", "phase"), "the device's reported timings of its last uploaded round: compute, transfer, wait, server, total (per-device series)"),
    MetricSpec("sfl_fed_device_phase_duration_seconds", "histogram", ("phase",), "device-reported round timings of all uploads, by phase (no device label)"),
    MetricSpec("sfl_fed_time_table_entries", "gauge", (), "filled cells (device, split candidate) of the client time table"),
    MetricSpec("sfl_fed_time_table_seconds", "gauge", ("device", "candidate"), "client time table cell: running average of the device's measured round time at split candidate j (per-device series)"),
    MetricSpec("sfl_fed_aggregation_duration_seconds", "histogram", (), "seconds the round's aggregation (Algorithm 1 or the algorithm's own rule) took"),
    MetricSpec("sfl_fed_test_accuracy_ratio", "gauge", (), "global model's test accuracy (0..1) after the last round (the initial model's before round 1)"),
    MetricSpec("sfl_fed_test_loss", "gauge", (), "global model's mean test cross-entropy after the last round (the initial model's before round 1)"),
    MetricSpec("sfl_fed_train_loss", "gauge", (), "sample-weighted mean training loss of the last round's aggregated devices"),
    MetricSpec("sfl_fed_round_bytes_total", "counter", ("direction",), "bytes of completed rounds as in the round record: up (device to servers), down (servers to devices), server (between the servers)"),
    MetricSpec("sfl_fed_main_server_replicas_live", "gauge", (), "configured Main Server replicas not set aside (one that did not accept a plan or was lost is set aside until it answers its health check)"),
    MetricSpec("sfl_fed_checkpoint_writes_total", "counter", (), "checkpoint.msgpack writes (one per completed round)"),
    MetricSpec("sfl_fed_privacy_epsilon", "gauge", (), "epsilon spent so far at the run's privacy.delta, after the last aggregated round (runs with privacy.noise; docs/privacy.md)"),
    MetricSpec("sfl_fed_sample_epsilon", "gauge", (), "the largest sample-level epsilon of any device so far, at train.dp_sgd.delta (runs with train.dp_sgd; docs/privacy.md)"),
    MetricSpec("sfl_fed_privacy_clip_norm", "gauge", (), "the clip bound of the last aggregated round (runs with privacy.clipping; adaptive clipping moves it)"),
    MetricSpec("sfl_fed_secure_clamped_entries_total", "counter", (), "entries of securely aggregated sums beyond what the survivors' clipped updates can add up to, clamped (record secure_clamped; some device uploaded outside value_range; docs/privacy.md)"),
    *HTTP_METRICS,
)
_HELP = {s.name: s.help for s in METRICS}


class _LiveCollector(Collector):
    """Values read from the run's parts at scrape time."""

    def __init__(self, coordinator: Coordinator, per_device: bool) -> None:
        self.coordinator = coordinator
        self.per_device = per_device

    def describe(self):  # no describe at registration: collect() reads a coordinator that may be half-built
        return []

    def collect(self):
        c = self.coordinator
        open_round = c.core.round
        current = open_round.round_id if open_round is not None else c.progress.rounds_done
        yield GaugeMetricFamily("sfl_fed_current_round", _HELP["sfl_fed_current_round"], value=current)
        yield GaugeMetricFamily("sfl_fed_rounds_configured", _HELP["sfl_fed_rounds_configured"], value=c.config.rounds)
        devices = list(c.core.devices.devices.values())
        yield GaugeMetricFamily("sfl_fed_devices_registered", _HELP["sfl_fed_devices_registered"], value=len(devices))
        yield GaugeMetricFamily("sfl_fed_devices_expected", _HELP["sfl_fed_devices_expected"], value=c.config.data.num_devices)
        now = time.monotonic()
        active = sum(1 for d in devices if now - d.last_seen <= ACTIVE_WINDOW_S)
        yield GaugeMetricFamily("sfl_fed_devices_active", _HELP["sfl_fed_devices_active"], value=active)
        yield GaugeMetricFamily("sfl_fed_main_server_replicas_live", _HELP["sfl_fed_main_server_replicas_live"],
                                value=c.replicas.live())
        entries = _table_entries(c)
        yield GaugeMetricFamily("sfl_fed_time_table_entries", _HELP["sfl_fed_time_table_entries"],
                                value=sum(len(row) for row in entries.values()))
        if self.per_device:
            cells = GaugeMetricFamily("sfl_fed_time_table_seconds", _HELP["sfl_fed_time_table_seconds"],
                                      labels=["device", "candidate"])
            for device in sorted(entries):
                for j, seconds in sorted(entries[device].items()):
                    cells.add_metric([device, str(j)], seconds)
            yield cells


def _table_entries(coordinator: Coordinator) -> dict[str, dict[int, float]]:
    for _ in range(5):  # the round driver's thread may update the table while we copy it
        try:
            return coordinator.table.entries()
        except RuntimeError:
            continue
    return {}


class FedMetrics:
    """The Fed Server's metric objects, in their own registry."""

    def __init__(self, coordinator: Coordinator | None = None, per_device: bool = True,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        self.per_device = per_device
        make = metric_maker(self.registry, METRICS)

        self.rounds_completed = make(Counter, "sfl_fed_rounds_completed_total")
        self.round_duration = make(Histogram, "sfl_fed_round_duration_seconds", buckets=ROUND_BUCKETS)
        self.round_devices = make(Gauge, "sfl_fed_round_devices")
        self.devices_dropped = make(Counter, "sfl_fed_devices_dropped_total")
        self.split_point_devices = make(Gauge, "sfl_fed_split_point_devices")
        self.device_split_point = make(Gauge, "sfl_fed_device_split_point")
        self.device_round_seconds = make(Gauge, "sfl_fed_device_round_seconds")
        self.device_phase = make(Histogram, "sfl_fed_device_phase_duration_seconds", buckets=PHASE_BUCKETS)
        self.aggregation = make(Histogram, "sfl_fed_aggregation_duration_seconds", buckets=AGGREGATION_BUCKETS)
        self.test_accuracy = make(Gauge, "sfl_fed_test_accuracy_ratio")
        self.test_loss = make(Gauge, "sfl_fed_test_loss")
        self.train_loss = make(Gauge, "sfl_fed_train_loss")
        self.round_bytes = make(Counter, "sfl_fed_round_bytes_total")
        self.checkpoints = make(Counter, "sfl_fed_checkpoint_writes_total")
        self.epsilon = make(Gauge, "sfl_fed_privacy_epsilon")
        self.clip_norm = make(Gauge, "sfl_fed_privacy_clip_norm")
        self.sample_epsilon = make(Gauge, "sfl_fed_sample_epsilon")
        self.secure_clamped = make(Counter, "sfl_fed_secure_clamped_entries_total")
        for status in ("ok", "failed"):
            self.rounds_completed.labels(status)
        for direction in BYTE_DIRECTIONS:
            self.round_bytes.labels(direction)
        for state in ("selected", "aggregated", "dropped"):
            self.round_devices.labels(state)
        for phase in PHASES:
            self.device_phase.labels(phase)
        self._known_splits: set[str] = set()
        if coordinator is not None:
            initial = coordinator.progress.initial
            if initial.get("test_accuracy") is not None:
                self.test_accuracy.set(initial["test_accuracy"])
            if initial.get("test_loss") is not None:
                self.test_loss.set(initial["test_loss"])
            spent = [r.privacy for r in coordinator.progress.history if r.privacy is not None]
            if spent:   # a resumed run's epsilon is its last record's, not 0
                self._observe_privacy(spent[-1])
            sample = [r.sample_privacy for r in coordinator.progress.history if r.sample_privacy is not None]
            if sample:
                self.sample_epsilon.set(sample[-1].epsilon)
            self.registry.register(_LiveCollector(coordinator, per_device))

    def observe_round(self, record: RoundRecord) -> None:
        """Fold one round record (``Progress.record``'s return value) into the metrics."""
        self.rounds_completed.labels(record.status).inc()
        self.round_duration.observe(record.round_time_s)
        self.aggregation.observe(record.aggregation_s)
        for gauge, value in ((self.test_accuracy, record.test_accuracy), (self.test_loss, record.test_loss),
                             (self.train_loss, record.train_loss)):
            if value is not None:
                gauge.set(value)
        self.devices_dropped.inc(len(record.dropped))
        self.round_devices.labels("selected").set(len(record.selected))
        self.round_devices.labels("aggregated").set(len(record.aggregated))
        self.round_devices.labels("dropped").set(len(record.dropped))
        counts: dict[str, int] = {}
        for device, k in record.split_points.items():
            counts[str(k)] = counts.get(str(k), 0) + 1
            if self.per_device:
                self.device_split_point.labels(device).set(k)
        for split in self._known_splits | set(counts):  # a split point no longer used drops to 0
            self.split_point_devices.labels(split).set(counts.get(split, 0))
        self._known_splits |= set(counts)
        for device, timings in record.device_times.items():
            for phase in PHASES:
                value = getattr(timings, f"{phase}_s")
                self.device_phase.labels(phase).observe(value)
                if self.per_device:
                    self.device_round_seconds.labels(device, phase).set(value)
        for direction in BYTE_DIRECTIONS:
            self.round_bytes.labels(direction).inc(max(0, getattr(record, f"bytes_{direction}")))
        if record.privacy is not None:
            self._observe_privacy(record.privacy)
        if record.sample_privacy is not None:
            self.sample_epsilon.set(record.sample_privacy.epsilon)
        if record.secure_clamped:
            self.secure_clamped.inc(record.secure_clamped)

    def _observe_privacy(self, privacy: PrivacyRecord) -> None:
        self.clip_norm.set(privacy.clip_norm)
        if privacy.epsilon is not None:
            self.epsilon.set(privacy.epsilon)

    def checkpoint_written(self) -> None:
        self.checkpoints.inc()
