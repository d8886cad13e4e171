"""Experiment tracking (fed_server/tracking/): the registry and config errors, the figures a round
logs, a backend that fails or hangs, and a restarted run that continues the same logs (the real
TensorBoard and MLflow file store in a temporary run directory)."""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fed_server.records import RoundRecord
from fed_server.tracking import TRACKERS, Tracker, Tracking
from fed_server.tracking.base import flat_config, round_figures
from shared.config import TrackingConfig
from shared.run_config import ConfigError, load_run_config

SUMMARY = {"run_id": "r1", "rounds": 2, "final_accuracy": 0.75, "finished": True, "stop_reason": "completed"}


def _record(round_: int, accuracy: float, status: str = "ok", **fields: Any) -> RoundRecord:
    return RoundRecord.model_validate({
        "round": round_, "round_id": round_, "algorithm": "fedavg", "status": status, "test_accuracy": accuracy,
        "test_loss": 1.0 - accuracy, "train_loss": 0.5, "round_time_s": 2.0, "elapsed_s": 2.0 * round_,
        "selected": ["a", "b", "c"], "aggregated": ["a", "b"], "dropped": ["c"], "split_points": {"a": 1, "b": 2, "c": 3},
        "device_times": {}, "device_kinds": {}, "groups": [], "bytes_up": 10, "bytes_down": 20, "bytes_server": 0,
        "bytes_total": 30, "cumulative_bytes": 30 * round_, "plan_error": None, **fields})


def _wait_for(probe, what: str, timeout: float = 20.0) -> Any:
    """The first truthy value ``probe`` returns (a file store read twice may answer differently)."""
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


# --- registry and configuration -------------------------------------------------------------------
def test_no_backend_is_the_default_and_builds_nothing(tmp_path):
    config = load_run_config({})
    assert config.tracking.backends == []
    tracking = Tracking(config.tracking, tmp_path)
    tracking.start("r1", {})
    tracking.log_round(_record(1, 0.5))
    tracking.finish(SUMMARY)
    assert tracking.trackers == [] and list(tmp_path.iterdir()) == []


def test_unknown_backend_names_the_registered_ones(tmp_path):
    with pytest.raises(ValueError) as exc:
        Tracking(TrackingConfig(backends=["wandb"]), tmp_path)
    assert str(exc.value) == f"unknown tracking backend 'wandb'; choose from {sorted(TRACKERS)}"


def test_a_backend_named_twice_is_a_config_error():
    with pytest.raises(ConfigError, match="tracking.backends: .*at most once"):
        load_run_config({"tracking": {"backends": ["tensorboard", "tensorboard"]}})
    with pytest.raises(ConfigError, match="tracking.mlflow_experiment"):
        load_run_config({"tracking": {"mlflow_experiment": ""}})


@pytest.mark.parametrize("backend, module, line", [
    ("mlflow", "mlflow.tracking", "tracking backend 'mlflow' needs the mlflow package: pip install 'mlflow-skinny'"),
    ("tensorboard", "torch.utils.tensorboard",
     "tracking backend 'tensorboard' needs the tensorboard package: pip install 'tensorboard>=2.14'"),
])
def test_a_missing_package_is_one_line_at_start_up(tmp_path, monkeypatch, backend, module, line):
    monkeypatch.setitem(sys.modules, module, None)   # import raises ModuleNotFoundError, as when not installed
    with pytest.raises(ValueError) as exc:
        Tracking(TrackingConfig(backends=[backend]), tmp_path)
    assert str(exc.value) == line


# --- what a round logs ------------------------------------------------------------------------------
def test_round_figures_are_the_records_numbers():
    record = _record(3, 0.9, evaluation_s=0.25, algorithm_metrics={"entropy": 1.5, "leaky": False, "per_device": {"a": 1}})
    assert round_figures(record) == {
        "test_accuracy": 0.9, "test_loss": pytest.approx(0.1), "train_loss": 0.5, "round_time_s": 2.0, "elapsed_s": 6.0,
        "aggregation_s": 0.0, "evaluation_s": 0.25, "bytes_up": 10.0, "bytes_down": 20.0, "bytes_server": 0.0,
        "bytes_total": 30.0, "cumulative_bytes": 90.0, "selected": 3.0, "participants": 2.0, "dropped": 1.0,
        "split_point_mean": 2.0, "algorithm/entropy": 1.5}
    # Federated evaluation without a report: no accuracy, and nothing is made up for it.
    assert "test_accuracy" not in round_figures(_record(1, 0.5, test_accuracy=None, test_loss=None))


def test_per_device_figures_are_each_uploaders_split_and_timings():
    timings = {"compute_s": 1.0, "transfer_s": 0.5, "wait_s": 0.25, "server_s": 0.125, "total_s": 2.0}
    record = _record(2, 0.8, device_times={"a": timings}, upload_times={"a": 0.3}, table_times={"a": 1.9})
    figures = round_figures(record, per_device=True)
    assert {k: v for k, v in figures.items() if k.startswith("device/")} == {
        "device/a/split_point": 1.0, "device/a/compute_s": 1.0, "device/a/transfer_s": 0.5, "device/a/wait_s": 0.25,
        "device/a/server_s": 0.125, "device/a/total_s": 2.0, "device/a/upload_s": 0.3, "device/a/table_s": 1.9}
    assert not any(k.startswith("device/") for k in round_figures(record))


def test_flat_config_is_dotted_text():
    assert flat_config({"train": {"lr": 0.05}, "model_params": {}, "tracking": {"backends": ["mlflow"]}, "model": "cnn"}) == {
        "train.lr": "0.05", "model_params": "{}", "tracking.backends": '["mlflow"]', "model": "cnn"}


# --- a backend that fails or hangs never holds the run -------------------------------------------------
class _Recording(Tracker):
    """Remembers what it was given; ``fail`` and ``hang`` make it misbehave."""

    name = "recording"
    fail_start = 0            # how many starts fail before one works
    fail_rounds: set[int] = set()
    hang: threading.Event | None = None

    def __init__(self, config: TrackingConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self.rounds: list[int] = []
        self.summary: Mapping[str, Any] | None = None
        self.starts = 0

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        self.starts += 1
        if self.starts <= self.fail_start:
            raise OSError(28, "No space left on device")

    def log_round(self, record: RoundRecord) -> None:
        if self.hang is not None:
            self.hang.wait()
        if record.round in self.fail_rounds:
            raise ConnectionError("tracking server down\nsecond line")
        self.rounds.append(record.round)

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.summary = summary


def _tracking(tmp_path, monkeypatch, **behaviour: Any) -> tuple[Tracking, _Recording]:
    kind = type("Misbehaving", (_Recording,), {"name": "misbehaving", **behaviour})
    monkeypatch.setitem(TRACKERS, "misbehaving", kind)
    tracking = Tracking(TrackingConfig(backends=["misbehaving"]), tmp_path)
    tracker = tracking.trackers[0]
    assert isinstance(tracker, _Recording)
    return tracking, tracker


def test_a_failing_backend_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    tracking, tracker = _tracking(tmp_path, monkeypatch, fail_rounds={2, 3})
    with caplog.at_level(logging.INFO, logger="fed_server"):
        tracking.start("r1", {})
        for round_ in (1, 2, 3, 4):
            tracking.log_round(_record(round_, 0.5))
        tracking.log_round(_record(4, 0.5, status="failed"))   # a failed attempt is not logged
        tracking.finish(SUMMARY, wait_s=10)
    assert tracker.rounds == [1, 4] and tracker.summary == SUMMARY
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["tracking backend 'misbehaving' failed, the run goes on without it until it works again: "
                        "ConnectionError: tracking server down"]
    assert "tracking backend 'misbehaving' works again" in caplog.messages


def test_a_backend_that_could_not_start_tries_again_before_each_round(tmp_path, monkeypatch, caplog):
    tracking, tracker = _tracking(tmp_path, monkeypatch, fail_start=2)
    with caplog.at_level(logging.WARNING, logger="fed_server"):
        tracking.start("r1", {})
        for round_ in (1, 2, 3):
            tracking.log_round(_record(round_, 0.5))
        tracking.finish(SUMMARY, wait_s=10)
    # Its start failed twice (at start and before round 1): round 1 is lost, rounds 2 and 3 are not.
    assert tracker.starts == 3 and tracker.rounds == [2, 3] and tracker.summary == SUMMARY
    assert len(caplog.records) == 1 and "OSError: [Errno 28] No space left on device" in caplog.messages[0]


def test_a_hanging_backend_never_holds_a_round_and_the_end_waits_a_bounded_time(tmp_path, monkeypatch, caplog):
    release = threading.Event()
    tracking, tracker = _tracking(tmp_path, monkeypatch, hang=release)
    try:
        tracking.start("r1", {})
        started = time.monotonic()
        for round_ in (1, 2, 3):
            tracking.log_round(_record(round_, 0.5))
        assert time.monotonic() - started < 0.5
        with caplog.at_level(logging.WARNING, logger="fed_server"):
            tracking.finish(SUMMARY, wait_s=0.3)
        assert time.monotonic() - started < 2.0
        assert caplog.messages == ["tracking backend 'misbehaving' did not finish writing within 0.3s; "
                                   "its last figures may be missing"]
    finally:
        release.set()
    _wait_for(lambda: tracker.summary == SUMMARY, "the released backend to finish")
    assert tracker.rounds == [1, 2, 3]


# --- the real backends: a restarted run continues the same logs ----------------------------------------
def test_a_resumed_run_continues_its_tensorboard_folder_and_mlflow_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # for this test's own reads of the file store
    config = TrackingConfig(backends=["tensorboard", "mlflow"])
    run_config = load_run_config({}).model_dump(mode="json")
    uri = (tmp_path / "mlruns").resolve().as_uri()

    def logged(store: MlflowClient, run_id: str) -> list[tuple[int, float]] | None:
        try:
            return [(m.step, m.value) for m in store.get_metric_history(run_id, "test_accuracy")]
        except ValueError:   # the file store read a metric file its writer had opened but not written yet
            return None

    first = Tracking(config, tmp_path)
    first.start("r1", run_config)
    first.log_round(_record(1, 0.25))
    # The Fed Server is killed here (no finish); what it queued is written by then.
    _wait_for(lambda: (tmp_path / "mlflow_run.json").exists(), "the MLflow run")
    store = MlflowClient(uri)

    def only_run() -> str | None:
        try:
            return store.search_runs([store.get_experiment_by_name("s2fl").experiment_id])[0].info.run_id
        except ValueError:   # the file store read a metric file its writer had opened but not written yet
            return None
    mlflow_run = _wait_for(only_run, "the MLflow run's files")
    _wait_for(lambda: logged(store, mlflow_run) == [(1, 0.25)], "round 1 in MLflow")
    _wait_for(lambda: bool(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))), "round 1 in TensorBoard")

    resumed = Tracking(config, tmp_path)
    resumed.start("r1", run_config)
    resumed.log_round(_record(2, 0.75))
    resumed.finish(SUMMARY, wait_s=30)

    runs = store.search_runs([store.get_experiment_by_name("s2fl").experiment_id])
    assert [r.info.run_id for r in runs] == [mlflow_run]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "r1"
    assert run.data.params["train.lr"] == "0.05" and run.data.params["algorithm"] == "s2fl"
    assert run.data.metrics["summary/final_accuracy"] == 0.75
    assert logged(store, mlflow_run) == [(1, 0.25), (2, 0.75)]

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("test_accuracy")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("participants")] == [(1, 2.0), (2, 2.0)]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
