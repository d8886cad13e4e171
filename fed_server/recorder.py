"""The one writer of a run's durable state: attempt ids, round records, checkpoint, summary.

Order of writes, and why (each rule closes a crash window a killed Fed Server could hit):

* An attempt id is reserved on disk (atomic write) *before* it is handed out, so no number of
  restarts, with or without a checkpoint in between, hands out the same id twice.
* A round's ``metrics.jsonl`` line is appended *before* the checkpoint that counts it. A crash in
  between leaves a line the checkpoint does not cover; resume drops it and the round is re-run
  (the checkpoint, model included, is the truth), so a round is never counted without its record.
* ``summary.json`` is written after the checkpoint of a finished run, and again by every resume
  of a finished run, so a crash after the last record still leaves a finished run with a summary.

Fault injection, for the crash tests to kill the server at exactly these points (docs/operations.md):
``SFL_FAULT_PAUSE_BEFORE_CHECKPOINT_S`` (seconds, default 0) pauses between a round's metrics line
and its checkpoint; ``SFL_FAULT_PAUSE_BEFORE_SUMMARY_S`` between a finished run's last checkpoint
and its summary.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from fed_server.checkpoint import RunProgress, load_checkpoint, save_checkpoint
from fed_server.records import RoundRecord
from fed_server.run_dir import RunDirectory
from shared.config import RunConfig

log = logging.getLogger("fed_server")

FAULT_PAUSE_ENV = {"checkpoint": "SFL_FAULT_PAUSE_BEFORE_CHECKPOINT_S", "summary": "SFL_FAULT_PAUSE_BEFORE_SUMMARY_S"}


class Recorder:
    """Writes and restores what a restarted Fed Server needs; the coordinator decides what it is."""

    def __init__(self, run_dir: RunDirectory) -> None:
        self.run_dir = run_dir
        self.fault_pause_s = {point: float(os.environ.get(name) or 0) for point, name in FAULT_PAUSE_ENV.items()}

    def reserve_attempt(self, attempt: int) -> int:
        """Durably record ``attempt`` as handed out, then return it (see the module docstring)."""
        self.run_dir.write_last_attempt(attempt)
        return attempt

    def last_attempt(self) -> int:
        """The newest attempt id ever reserved in this run directory (0 for a new run)."""
        return self.run_dir.read_last_attempt()

    def persist(self, record: RoundRecord, model_state: Mapping[str, torch.Tensor], progress: RunProgress,
                     summary: Mapping[str, Any] | None) -> None:
        """Persist one finished attempt: its record, then the checkpoint counting it, then (for a
        finished run) the summary."""
        self.run_dir.append_metrics(record.to_json())
        self._fault_pause("checkpoint", record.round_id)
        save_checkpoint(self.run_dir, model_state, progress)
        if summary is not None:
            self._fault_pause("summary", record.round_id)
            self.run_dir.write_summary(summary)

    def _fault_pause(self, before: str, attempt: int) -> None:
        if self.fault_pause_s[before] > 0:
            log.warning("fault injection: attempt %d pausing %.1fs before the %s", attempt, self.fault_pause_s[before], before)
            time.sleep(self.fault_pause_s[before])

    def write_summary(self, summary: Mapping[str, Any]) -> None:
        self.run_dir.write_summary(summary)

    def resume(self, config: RunConfig) -> tuple[dict[str, torch.Tensor], RunProgress, list[RoundRecord]] | None:
        """The checkpoint's model and progress and the records it covers, or None for a new run.

        ``progress.attempts`` is raised to the last *reserved* id, which may be newer than the
        checkpoint (an attempt begun, or a whole incarnation run, after it). Metrics lines the
        checkpoint does not cover are dropped from the file. ValueError for a checkpoint of a
        different configuration (``fed_server/checkpoint.py``).
        """
        loaded = load_checkpoint(self.run_dir, config)
        if loaded is None:
            # A run that stopped before its first checkpoint: a metrics line it wrote is not
            # covered by any checkpoint, so it goes, like every uncovered line.
            if self.run_dir.metrics_path.exists() and self.run_dir.metrics_path.stat().st_size:
                self.run_dir.rewrite_metrics([])
            return None
        state, progress = loaded
        progress.attempts = max(progress.attempts, self.run_dir.read_last_attempt())
        written = self.run_dir.read_metrics()
        # Only the covered lines are parsed as records: an uncovered one may be the half-written
        # line of the crash.
        history = [RoundRecord.model_validate(line) for line in written[: progress.history_len]]
        if len(written) > len(history):
            self.run_dir.rewrite_metrics([r.to_json() for r in history])
        return state, progress, history
