"""A run's directory: resolved config, per-round metrics (JSON lines), checkpoint, summary."""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import yaml

from fed_server.records import finite_json, json_line
from shared.config import RunConfig
from shared.files import atomic_write
from shared.wire import decode_state, encode_state, packb, unpackb


class RunDirectory:
    """Files of one run. Checkpoints use the project's msgpack tensor format, never pickle."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def checkpoint_path(self) -> Path:
        return self.path / "checkpoint.msgpack"

    @staticmethod
    def summary_path_of(path: str | Path) -> Path:
        """Where the summary of the run in directory ``path`` is: written once the run is over."""
        return Path(path) / "summary.json"

    def write_config(self, config: RunConfig, run_id: str) -> None:
        data = {"run_id": run_id, **config.model_dump(mode="json")}
        atomic_write(self.path / "config.yaml", yaml.safe_dump(data, sort_keys=False).encode())

    def read_config(self) -> dict[str, Any] | None:
        """The configuration this directory's run was started with (None for a new directory)."""
        path = self.path / "config.yaml"
        if not path.exists():
            return None
        data = yaml.safe_load(path.read_text())
        return data if isinstance(data, dict) else None

    @property
    def attempt_path(self) -> Path:
        return self.path / "last_attempt.json"

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one round record as a standard-JSON line (non-finite numbers become null)."""
        with open(self.metrics_path, "a") as fh:
            fh.write(json_line(record))
            fh.flush()
            os.fsync(fh.fileno())

    def read_metrics(self) -> list[dict]:
        """Every line written so far as raw JSON (empty for a new run): a resume types only the
        lines its checkpoint covers. A reader of the records uses
        ``fed_server.records.read_round_records(run_dir.metrics_path)``, which types them all."""
        if not self.metrics_path.exists():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line.strip()]

    def rewrite_metrics(self, records: list[Mapping[str, Any]]) -> None:
        """Replace metrics.jsonl atomically (resume drops lines newer than the checkpoint)."""
        atomic_write(self.metrics_path, "".join(json_line(r) for r in records).encode())

    def write_last_attempt(self, attempt: int) -> None:
        """Durably note the newest attempt id handed out (``fed_server/recorder.py``)."""
        atomic_write(self.attempt_path, json.dumps({"last_attempt": attempt}).encode())

    def read_last_attempt(self) -> int:
        """The newest attempt id ever handed out in this directory (0 for a new run)."""
        if not self.attempt_path.exists():
            return 0
        return int(json.loads(self.attempt_path.read_text())["last_attempt"])

    def released_path(self, ledger: str) -> Path:
        """Where :meth:`write_released` notes ``ledger``."""
        return self.path / f"{ledger}_released.json"

    def write_released(self, ledger: str, state: Mapping[str, Any]) -> None:
        """Durably note a privacy ledger (``privacy``: the run's, ``fed_server/privacy.py``;
        ``sample_privacy``: DP-SGD's, ``fed_server/sample_privacy.py``) as soon as it counts what
        is about to leave the Fed Server or its devices: the checkpoint that counts it comes later,
        and a Fed Server stopped in between runs it again."""
        atomic_write(self.released_path(ledger), json.dumps(dict(state)).encode())

    def read_released(self, ledger: str) -> dict[str, Any] | None:
        """The state :meth:`write_released` noted last for ``ledger`` (None: none yet)."""
        path = self.released_path(ledger)
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else None

    def write_checkpoint(self, round_id: int, state: Mapping[str, torch.Tensor], extra: Mapping[str, Any]) -> None:
        atomic_write(self.checkpoint_path, packb({"round": round_id, "state": encode_state(state), "extra": dict(extra)}))

    def read_checkpoint(self) -> tuple[int, dict[str, torch.Tensor], dict[str, Any]]:
        obj = unpackb(self.checkpoint_path.read_bytes())
        state = {k: v.clone() for k, v in decode_state(obj["state"], what="checkpoint").items()}
        return int(obj["round"]), state, obj.get("extra", {})

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        text = json.dumps(finite_json(summary), indent=2, allow_nan=False)
        atomic_write(self.summary_path_of(self.path), (text + "\n").encode())

