"""The Fed Server's registry exports exactly the documented metrics, fed by round records."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace as NS

import httpx

from fed_server.metrics import METRICS, FedMetrics
from fed_server.records import RoundRecord
from fed_server.settings import PER_DEVICE_SERIES_LIMIT, FedServerSettings
from shared.http_metrics import exported_families, spec_mismatches
from http_api.server import create_service_app

BASE = {
    "round": 3, "round_id": 4, "algorithm": "s2fl", "status": "ok", "test_accuracy": 0.75, "test_loss": 0.8, "train_loss": 0.9, "round_time_s": 4.5,
    "selected": ["dev-000", "dev-001", "dev-002"], "aggregated": ["dev-000", "dev-001"], "dropped": ["dev-002"],
    "split_points": {"dev-000": 1, "dev-001": 3, "dev-002": 3},
    "device_times": {d: {"compute_s": 1.0, "transfer_s": 0.5, "wait_s": 0.2, "server_s": 0.3, "total_s": 2.0}
                     for d in ("dev-000", "dev-001")},
    "groups": [], "bytes_up": 100, "bytes_down": 200, "bytes_server": 50,
    "elapsed_s": 9.0, "device_kinds": {}, "bytes_total": 350, "cumulative_bytes": 350, "plan_error": None,
}


def record(**changes) -> RoundRecord:
    return RoundRecord.model_validate({**BASE, **changes})


RECORD = record()


def fake_coordinator(round_open: bool = False, history: tuple[RoundRecord, ...] = ()):
    devices = {f"dev-00{i}": NS(last_seen=time.monotonic() - (100 if i == 2 else 0)) for i in range(3)}
    replicas = NS(urls=["http://a:8081", "http://b:8081", "http://c:8081"], down={"http://b:8081"})
    replicas.live = lambda: len(set(replicas.urls) - replicas.down)
    return NS(core=NS(round=NS(round_id=4) if round_open else None, devices=NS(devices=devices)),
              progress=NS(rounds_done=3, initial={"test_accuracy": 0.1, "test_loss": 2.3}, history=list(history)),
              config=NS(rounds=10, data=NS(num_devices=3)),
              table=NS(entries=lambda: {"dev-000": {0: 1.5, 1: 2.5}, "dev-001": {2: 3.0}}), replicas=replicas)


def sample(metrics: FedMetrics, name: str, labels: dict | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


def test_exports_exactly_the_documented_metrics():
    metrics = FedMetrics(fake_coordinator())
    metrics.observe_round(record(aggregation_s=0.2))
    metrics.checkpoint_written()
    create_service_app("fed_server", "t", "t", registry=metrics.registry)  # adds the HTTP counter
    metrics.registry._names_to_collectors["sfl_http_body_bytes_total"].labels("/metrics", "sent").inc(1)
    assert spec_mismatches(metrics.registry, METRICS) == []


def test_round_record_values():
    metrics = FedMetrics(fake_coordinator())
    assert sample(metrics, "sfl_fed_test_accuracy_ratio") == 0.1  # the initial model before round 1
    metrics.observe_round(record(aggregation_s=0.2))
    assert sample(metrics, "sfl_fed_rounds_completed_total", {"status": "ok"}) == 1
    assert sample(metrics, "sfl_fed_rounds_completed_total", {"status": "failed"}) == 0
    assert sample(metrics, "sfl_fed_round_duration_seconds_sum") == 4.5
    assert sample(metrics, "sfl_fed_aggregation_duration_seconds_sum") == 0.2
    assert sample(metrics, "sfl_fed_test_accuracy_ratio") == 0.75
    assert sample(metrics, "sfl_fed_test_loss") == 0.8
    assert sample(metrics, "sfl_fed_devices_dropped_total") == 1
    assert sample(metrics, "sfl_fed_round_devices", {"state": "aggregated"}) == 2
    assert sample(metrics, "sfl_fed_split_point_devices", {"split_point": "3"}) == 2
    assert sample(metrics, "sfl_fed_device_split_point", {"device": "dev-000"}) == 1
    assert sample(metrics, "sfl_fed_device_round_seconds", {"device": "dev-001", "phase": "compute"}) == 1.0
    assert sample(metrics, "sfl_fed_device_phase_duration_seconds_count", {"phase": "total"}) == 2
    assert sample(metrics, "sfl_fed_round_bytes_total", {"direction": "server"}) == 50
    # A split point that is no longer used drops to zero instead of keeping its old count.
    metrics.observe_round(record(split_points={"dev-000": 2}, aggregation_s=0.05))
    assert sample(metrics, "sfl_fed_split_point_devices", {"split_point": "3"}) == 0
    assert sample(metrics, "sfl_fed_aggregation_duration_seconds_sum") == 0.25


def test_privacy_gauges_follow_the_records_and_a_resumed_run_starts_from_its_last():
    spent = {"clip_norm": 0.5, "epsilon": 1.25, "delta": 1e-5, "noise_multiplier": 1.1}
    metrics = FedMetrics(fake_coordinator())
    assert sample(metrics, "sfl_fed_privacy_epsilon") == 0
    metrics.observe_round(record(privacy=spent))
    assert sample(metrics, "sfl_fed_privacy_epsilon") == 1.25
    assert sample(metrics, "sfl_fed_privacy_clip_norm") == 0.5
    metrics.observe_round(record(status="failed", privacy=None))   # nothing released: unchanged
    assert sample(metrics, "sfl_fed_privacy_epsilon") == 1.25
    resumed = FedMetrics(fake_coordinator(history=(record(privacy=spent), record(privacy={**spent, "epsilon": 2.0}))))
    assert sample(resumed, "sfl_fed_privacy_epsilon") == 2.0


def test_scrape_time_values():
    metrics = FedMetrics(fake_coordinator(round_open=True))
    assert sample(metrics, "sfl_fed_current_round") == 4
    assert sample(metrics, "sfl_fed_rounds_configured") == 10
    assert sample(metrics, "sfl_fed_devices_registered") == 3
    assert sample(metrics, "sfl_fed_devices_active") == 2
    assert sample(metrics, "sfl_fed_time_table_entries") == 3
    assert sample(metrics, "sfl_fed_main_server_replicas_live") == 2   # one of three is down
    assert sample(metrics, "sfl_fed_time_table_seconds", {"device": "dev-001", "candidate": "2"}) == 3.0
    assert sample(FedMetrics(fake_coordinator()), "sfl_fed_current_round") == 3


def test_per_device_series_can_be_turned_off():
    metrics = FedMetrics(fake_coordinator(), per_device=False)
    metrics.observe_round(RECORD)
    exported = exported_families(metrics.registry)
    device_labelled = [n for n, (_, labels) in exported.items() if "device" in labels]
    assert device_labelled == []
    assert sample(metrics, "sfl_fed_split_point_devices", {"split_point": "3"}) == 2


def test_metrics_endpoint_serves_the_registry_without_redirect():
    metrics = FedMetrics(fake_coordinator())
    app = create_service_app("fed_server", "t", "t", registry=metrics.registry)

    async def scrape():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = await client.get("/metrics")
            await client.get("/healthz")
            second = await client.get("/metrics/")
            return first, second

    first, second = asyncio.run(scrape())
    assert first.status_code == 200 and second.status_code == 200
    assert first.headers["content-type"].startswith("text/plain")
    assert "sfl_fed_rounds_configured 10.0" in first.text
    assert 'sfl_http_body_bytes_total{direction="sent",route="/healthz"}' in second.text
    assert "process_" in first.text or "python_info" in first.text


def test_per_device_series_are_on_by_default_only_up_to_a_thousand_devices():
    # So that a large population's metrics do not grow with it; the flag decides when given.
    assert FedServerSettings().per_device_series(PER_DEVICE_SERIES_LIMIT)
    assert not FedServerSettings().per_device_series(PER_DEVICE_SERIES_LIMIT + 1)
    assert FedServerSettings(per_device_metrics=True).per_device_series(10 ** 6)
    assert not FedServerSettings(per_device_metrics=False).per_device_series(10)
