"""MLflow: a run in an MLflow tracking store, a local folder or a tracking server (``mlflow-skinny``
is enough to write; ``mlflow ui`` comes with the full ``mlflow`` package)."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fed_server.records import RoundRecord
from shared.files import atomic_write
from fed_server.tracking.base import Tracker, flat_config, import_backend, round_figures, summary_figures
from shared.config import TrackingConfig

#: MLflow's batch limits (parameters per ``log_batch``) and the shortest value limit across
#: versions: a longer configuration value is cut.
_PARAMS_PER_BATCH = 100
_PARAM_VALUE_CHARS = 500


class MlflowTracker(Tracker):
    """One MLflow run per run directory, in experiment ``mlflow_experiment``, named after the run
    id; the flattened configuration as its parameters (``train.lr``...), every round's figures
    as metrics at step = the logical round, the summary as ``summary/<key>`` metrics; it ends
    FINISHED (a completed run) or FAILED (stopped by failed attempts).

    The MLflow run id is kept in ``<run-dir>/mlflow_run.json``: a resumed run logs into the same
    MLflow run while the tracking URI is the same. ``mlflow_uri`` defaults to ``file:<run-dir>/mlruns``,
    MLflow's file store, which MLflow 3 keeps only behind ``MLFLOW_ALLOW_FILE_STORE=true``: this
    tracker sets that variable for a ``file:`` URI unless it is set already."""

    name = "mlflow"

    def __init__(self, config: TrackingConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._tracking = import_backend(self.name, "mlflow.tracking", "mlflow", "mlflow-skinny")
        self._entities = import_backend(self.name, "mlflow.entities", "mlflow", "mlflow-skinny")
        self._exceptions = import_backend(self.name, "mlflow.exceptions", "mlflow", "mlflow-skinny")
        self.uri = config.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
        self.run_file = run_dir / "mlflow_run.json"
        self.client: Any = None
        self.mlflow_run_id: str | None = None

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        if self.uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = self._tracking.MlflowClient(self.uri)
        self.mlflow_run_id = self.mlflow_run_id or self._earlier_run()
        if self.mlflow_run_id is not None:
            self.client.update_run(self.mlflow_run_id, status="RUNNING")
            return
        name = self.config.mlflow_experiment
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(name)
        run = self.client.create_run(experiment_id, run_name=run_id,
                                     tags={"s2fl.run_id": run_id, "s2fl.run_dir": str(self.run_dir.resolve())})
        self.mlflow_run_id = run.info.run_id
        atomic_write(self.run_file, json.dumps({"tracking_uri": self.uri, "run_id": self.mlflow_run_id}).encode())
        params = [self._entities.Param(key, value[:_PARAM_VALUE_CHARS]) for key, value in flat_config(config).items()]
        for start in range(0, len(params), _PARAMS_PER_BATCH):
            self.client.log_batch(self.mlflow_run_id, params=params[start:start + _PARAMS_PER_BATCH])

    def _earlier_run(self) -> str | None:
        """The MLflow run this run directory logged to before a restart, if it is in this store."""
        if not self.run_file.exists():
            return None
        noted = json.loads(self.run_file.read_text())
        if noted.get("tracking_uri") != self.uri:
            return None
        try:
            self.client.get_run(noted["run_id"])
        except self._exceptions.MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise
        return str(noted["run_id"])

    def log_round(self, record: RoundRecord) -> None:
        self._log_metrics(round_figures(record, self.config.per_device), record.round)

    def finish(self, summary: Mapping[str, Any]) -> None:
        figures = {f"summary/{key}": value for key, value in summary_figures(summary).items()}
        self._log_metrics(figures, int(summary.get("rounds") or 0))
        self.client.set_tag(self.mlflow_run_id, "s2fl.stop_reason", str(summary.get("stop_reason")))
        self.client.set_terminated(self.mlflow_run_id, "FINISHED" if summary.get("stop_reason") == "completed" else "FAILED")

    def _log_metrics(self, figures: Mapping[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.mlflow_run_id, metrics=[self._entities.Metric(key, value, now_ms, step)
                                                           for key, value in figures.items()])
