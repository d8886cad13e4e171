"""Experiment tracking through the real services: a FedAvg testbed run logs every round to
TensorBoard and MLflow, and what they hold is what ``metrics.jsonl`` says; a backend that cannot
write never stops the run; a Fed Server whose backend's package is missing refuses to start."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from integration_support import small_config
from testbed.processes import free_port, service_env

ROOT = Path(__file__).resolve().parents[2]


def _tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_every_round_goes_to_tensorboard_and_mlflow(run_testbed, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 reads a file store only with it (docs/tracking.md)

    config = small_config(algorithm="fedavg", **{"tracking.backends": ["tensorboard", "mlflow"]})
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished" and [m["round"] for m in metrics] == [1, 2]
    accuracy = [(m["round"], m["test_accuracy"]) for m in metrics]
    moved = [(m["round"], float(m["cumulative_bytes"])) for m in metrics]

    # TensorBoard keeps 32-bit floats.
    assert _tensorboard_scalars(run_dir / "tensorboard", "test_accuracy") == [(r, pytest.approx(a)) for r, a in accuracy]
    assert _tensorboard_scalars(run_dir / "tensorboard", "cumulative_bytes") == [(r, pytest.approx(b)) for r, b in moved]

    store = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    runs = store.search_runs([store.get_experiment_by_name("s2fl").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_name == status["run_id"] and run.info.status == "FINISHED"
    assert run.data.params["algorithm"] == "fedavg" and run.data.params["rounds"] == "2"
    assert [(m.step, m.value) for m in store.get_metric_history(run.info.run_id, "test_accuracy")] == accuracy
    assert [(m.step, m.value) for m in store.get_metric_history(run.info.run_id, "cumulative_bytes")] == moved
    assert run.data.metrics["summary/final_accuracy"] == status["summary"]["final_accuracy"]


def test_a_backend_that_cannot_write_never_stops_the_run(run_testbed, tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the TensorBoard folder would go\n")
    config = small_config(algorithm="fedavg", **{"tracking.backends": ["tensorboard"],
                                                 "tracking.tensorboard_dir": str(blocked)})
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok", "ok"]
    log = (run_dir / "logs" / "fed_server.log").read_text()
    assert log.count("tracking backend 'tensorboard' failed, the run goes on without it") == 1, log


def test_a_missing_backend_package_stops_the_fed_server_at_start_up(tmp_path):
    # A stand-in for a machine without mlflow: an importable 'mlflow' that fails like a missing one.
    shadow = tmp_path / "shadow" / "mlflow"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'mlflow'\")\n")
    env = service_env({"PYTHONPATH": f"{shadow.parent}:{ROOT}"})
    result = subprocess.run([sys.executable, "-m", "fed_server", "--run-dir", str(tmp_path / "run"), "--port",
                             str(free_port()), "--set", "tracking.backends=[mlflow]", "--set", "data.max_samples=200"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[-1] == ("python -m fed_server: error: tracking backend 'mlflow' needs the "
                                              "mlflow package: pip install 'mlflow-skinny'"), result.stderr
    assert "Traceback" not in result.stderr
