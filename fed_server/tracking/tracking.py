"""The run's trackers, each writing from its own thread so that a slow or broken backend never
stops or stalls the run.

:class:`Tracking` is called where a round's record has just been written (``Progress.record``,
itself off the event loop): it only queues the round for each backend's worker and returns. A
backend that raises is reported by one warning (and one line when it works again); its worker
keeps going with the next round, and one that could not start tries again before each round. Only
the run's end waits for the workers, at most ``FINISH_WAIT_S`` seconds, so that the summary and
the last rounds are written before the Fed Server says the run is finished.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from fed_server.records import RoundRecord
from fed_server.tracking.base import Tracker
from fed_server.tracking.registry import build_trackers
from shared.config import TrackingConfig

log = logging.getLogger("fed_server")

#: How long the run's end waits for the backends to write what is queued and close.
FINISH_WAIT_S = 30.0

_Job = tuple[Literal["round"], RoundRecord] | tuple[Literal["finish"], Mapping[str, Any]]


class _Worker:
    """One backend's thread: starts the backend, then writes the queued rounds and the summary in order."""

    def __init__(self, tracker: Tracker, run_id: str, config: Mapping[str, Any]) -> None:
        self.tracker = tracker
        self.run_id, self.config = run_id, config
        self.started = False
        self.failing = False
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()   # None: only start
        self.thread = threading.Thread(target=self._run, name=f"tracking-{tracker.name}", daemon=True)
        self.jobs.put(None)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if not self.started:
                    self.tracker.start(self.run_id, self.config)
                    self.started = True
                if job is not None and job[0] == "round":
                    self.tracker.log_round(job[1])
                elif job is not None:
                    self.tracker.finish(job[1])
                self._works()
            except Exception as exc:   # whatever the backend raises, the run goes on
                self._failed(exc)
            if job is not None and job[0] == "finish":
                return

    def _failed(self, exc: Exception) -> None:
        if not self.failing:
            first_line = (str(exc).strip().splitlines() or [""])[0]
            log.warning("tracking backend %r failed, the run goes on without it until it works again: %s: %s",
                        self.tracker.name, type(exc).__name__, first_line)
        else:
            log.debug("tracking backend %r failed again", self.tracker.name, exc_info=exc)
        self.failing = True

    def _works(self) -> None:
        if self.failing:
            log.info("tracking backend %r works again", self.tracker.name)
        self.failing = False


class Tracking:
    """The backends ``tracking.backends`` names, for one run directory. Construction imports
    their packages: ValueError (one line) for an unknown name or a package that is missing."""

    def __init__(self, config: TrackingConfig, run_dir: Path) -> None:
        self.trackers = build_trackers(config, run_dir)
        self.workers: list[_Worker] = []

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        """Start every backend's worker; each opens (or, resumed, reopens) its log in its thread."""
        if self.workers:
            raise RuntimeError("tracking has started already")
        self.workers = [_Worker(tracker, run_id, config) for tracker in self.trackers]

    def log_round(self, record: RoundRecord) -> None:
        """Queue an aggregated round for every backend (a failed attempt is not logged: the
        retry that aggregates logs its logical round)."""
        if record.status == "ok":
            for worker in self.workers:
                worker.jobs.put(("round", record))

    def finish(self, summary: Mapping[str, Any], wait_s: float = FINISH_WAIT_S) -> None:
        """Queue the summary, then wait up to ``wait_s`` in all for the backends to write and close."""
        for worker in self.workers:
            worker.jobs.put(("finish", summary))
        deadline = time.monotonic() + wait_s
        for worker in self.workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))
            if worker.thread.is_alive():
                log.warning("tracking backend %r did not finish writing within %gs; its last figures may be missing",
                            worker.tracker.name, wait_s)
