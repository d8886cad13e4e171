"""The Main Server's registry exports exactly the documented metrics."""
from __future__ import annotations

from types import SimpleNamespace as NS

from main_server.metrics import METRICS, MainMetrics
from shared.http_metrics import spec_mismatches
from http_api.server import create_service_app


def server_with_groups():
    groups = [NS(finished=False), NS(finished=True), NS(finished=False)]
    return NS(round=NS(round_id=7, abandoned=False, groups=groups))


def sample(metrics: MainMetrics, name: str, labels: dict | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, labels or {})


def test_exports_exactly_the_documented_metrics():
    metrics = MainMetrics(server_with_groups())
    create_service_app("main_server", "t", "t", registry=metrics.registry)
    metrics.registry._names_to_collectors["sfl_http_body_bytes_total"].labels("/v1/rounds/{round_id}/step", "received").inc(10)
    metrics.round_opened()
    metrics.groups_formed_with([0.1, 0.3], absent=1)
    metrics.step_trained(0.02, 0.5, 1000, 1000)
    metrics.step_failed()
    metrics.members_dropped("deadline", 2)
    metrics.members_dropped("checks", 1)
    metrics.members_dropped("non_finite", 1)
    metrics.group_finished(1.5)
    assert spec_mismatches(metrics.registry, METRICS) == []


def test_event_values():
    metrics = MainMetrics(server_with_groups())
    assert sample(metrics, "sfl_main_current_round") == 7
    assert sample(metrics, "sfl_main_groups_active") == 2
    metrics.groups_formed_with([0.1, 0.3], absent=1)
    assert sample(metrics, "sfl_main_groups_formed_total") == 2
    assert sample(metrics, "sfl_main_round_label_distance", {"stat": "max"}) == 0.3
    assert abs(sample(metrics, "sfl_main_round_label_distance", {"stat": "mean"}) - 0.2) < 1e-12
    assert sample(metrics, "sfl_main_group_label_distance_count") == 2
    assert sample(metrics, "sfl_main_devices_dropped_total", {"deadline": "join"}) == 1
    metrics.members_dropped("deadline", 2)
    assert sample(metrics, "sfl_main_devices_dropped_total", {"deadline": "step"}) == 2
    metrics.members_dropped("checks", 1)
    metrics.members_dropped("non_finite", 3)
    metrics.members_dropped("failed_step", 2)   # counted as the step's failure (step_failed)
    assert sample(metrics, "sfl_main_steps_refused_total") == 1
    assert sample(metrics, "sfl_main_members_not_finite_total") == 3
    metrics.step_trained(0.02, 0.5, 1000, 800)
    metrics.step_trained(0.04, 0.0, 1000, 800)
    assert sample(metrics, "sfl_main_steps_total") == 2
    assert abs(sample(metrics, "sfl_main_step_duration_seconds_sum") - 0.06) < 1e-12
    assert abs(sample(metrics, "sfl_main_server_training_seconds_total") - 0.06) < 1e-12
    assert sample(metrics, "sfl_main_barrier_wait_seconds_sum") == 0.5
    assert sample(metrics, "sfl_main_activation_bytes_total") == 2000
    assert sample(metrics, "sfl_main_gradient_bytes_total") == 1600
    assert sample(MainMetrics(NS(round=None)), "sfl_main_groups_active") == 0
