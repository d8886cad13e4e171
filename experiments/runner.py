"""Runs the cells of a grid one after another, each as a real testbed run, and skips finished ones.

Layout of an experiment folder::

    <out>/experiment.yaml          the experiment file as run (copied)
    <out>/cells/<cell_id>/         one testbed run directory per cell, plus cell.json (status,
                                   wall time, the run's summary and the machine it ran on)
    <out>/machine.json             the machine the grid's first cells ran on
    <out>/results.csv|json, report.md, *.png   written by experiments.report

Several runners may work on one grid at once (separate processes): each takes a cell's lock file
before running it and skips cells another live runner holds.

A cell counts as finished when its ``cell.json`` says so and it ran the cell's configuration (the
same hash, or the same settings apart from settings added since at their defaults:
:meth:`experiments.grid.Cell.ran_as`); anything else (never run, failed, interrupted, or the file
changed the cell's configuration) is run again from scratch. Restarting instead of resuming keeps
each cell's wall-clock figures from one uninterrupted run.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from fed_server.records import RoundRecord
from fed_server.run_dir import RunDirectory
from shared.machine import describe_machine
from testbed.follow import ProgressFn
from testbed.runner import Testbed, TestbedError
from testbed.warm_start import WarmStarter

from experiments.grid import Cell
from experiments.spec import ExperimentSpec

CELL_FILE = "cell.json"


@dataclass
class CellOutcome:
    cell: Cell
    status: str          # "finished", "skipped" (finished earlier), "recovered" (completed, but its runner
                         # lost track), "busy" (another runner has it) or "failed"
    wall_s: float
    error: str | None = None


def cell_dir(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.cell_id


def read_cell_record(path: Path) -> dict | None:
    """A cell directory's ``cell.json``, or None when it is missing or unreadable."""
    try:
        record = json.loads((path / CELL_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def ran_as(path: Path, record: dict, cell: Cell) -> bool:
    """Whether the run in cell directory ``path`` (``record``: its ``cell.json``) ran ``cell``'s
    configuration (:meth:`Cell.ran_as`: the same hash, or the same settings but those added since)."""
    try:
        ran_config = RunDirectory(path).read_config()
    except (OSError, UnicodeDecodeError, yaml.YAMLError):   # unreadable: as if never written
        ran_config = None
    return cell.ran_as(record.get("config_hash"), ran_config)


def is_finished(out: Path, cell: Cell) -> bool:
    path = cell_dir(out, cell)
    record = read_cell_record(path)
    return bool(record and record.get("status") == "finished" and (path / "metrics.jsonl").exists()
                and ran_as(path, record, cell))


def _claim(out: Path, cell: Cell) -> bool:
    """Take the cell's lock file, so two runners of the same grid never run one cell twice.

    A lock left by a process that no longer exists (killed runner) is taken over.
    """
    lock = out / "cells" / f"{cell.cell_id}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text() or 0)
                os.kill(pid, 0)          # raises if no such process
                return False             # a live runner has it
            except (ValueError, ProcessLookupError, FileNotFoundError):
                lock.unlink(missing_ok=True)   # stale: its runner is gone
                continue
            except PermissionError:      # alive, another user's process
                return False
        with os.fdopen(fd, "w") as fh:
            fh.write(str(os.getpid()))
        return True
    return False


def _release(out: Path, cell: Cell) -> None:
    (out / "cells" / f"{cell.cell_id}.lock").unlink(missing_ok=True)


def _write_record(path: Path, cell: Cell, status: str, **fields: object) -> None:
    record = {"cell_id": cell.cell_id, "labels": cell.labels, "config_hash": cell.config_hash, "status": status,
              **fields}
    tmp = path / (CELL_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(path / CELL_FILE)


class Progress:
    """A one-line progress bar over cells (redrawn in place on a terminal, one line per event otherwise)."""

    def __init__(self, total: int, stream: TextIO = sys.stdout, width: int = 24) -> None:
        self.total = total
        self.stream = stream
        self.width = width
        self.done = 0
        self.started = time.monotonic()
        self.run_seconds: list[float] = []   # wall time of cells that actually ran (for the ETA)
        self.tty = stream.isatty()

    def _bar(self) -> str:
        filled = int(self.width * self.done / max(1, self.total))
        return "[" + "#" * filled + "-" * (self.width - filled) + f"] {self.done}/{self.total}"

    def _eta(self) -> str:
        if not self.run_seconds:
            return ""
        left = (self.total - self.done) * sum(self.run_seconds) / len(self.run_seconds)
        return f"  eta {_clock(left)}"

    def show(self, text: str, final: bool = False) -> None:
        line = f"{self._bar()}  {_clock(time.monotonic() - self.started)}{self._eta()}  {text}"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line + ("\n" if final else ""))
        elif final:
            self.stream.write(line + "\n")
        self.stream.flush()

    def cell_done(self, outcome: CellOutcome) -> None:
        self.done += 1
        if outcome.status in ("finished", "failed"):
            self.run_seconds.append(outcome.wall_s)
        name = ", ".join(f"{k}={v}" for k, v in outcome.cell.labels.items())
        detail = {"finished": f"done in {_clock(outcome.wall_s)}", "skipped": "already finished, skipped",
                  "recovered": "its run had completed (summary.json); marked finished",
                  "busy": "being run by another runner, skipped", "failed": f"FAILED: {outcome.error}"}[outcome.status]
        self.show(f"{name}: {detail}", final=True)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else f"{seconds // 60}:{seconds % 60:02d}"


def run_cell(out: Path, cell: Cell, spec: ExperimentSpec, on_round: ProgressFn | None = None,
             log_level: str = "WARNING", warm: WarmStarter | None = None) -> CellOutcome:
    """Run one cell from scratch through the services; a failure is recorded, not raised.
    ``warm``: fork the cell's processes from this warm starter (``--warm-start``)."""
    path = cell_dir(out, cell)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    # Each cell names its own machine: a grid continued later may run on another
    # CPU, and float results differ between CPUs (their kernels round differently), so two cells
    # are bit-comparable only when their machines match.
    record = functools.partial(_write_record, path, cell, machine=describe_machine())
    record("running")
    t0 = time.monotonic()
    try:
        with Testbed(cell.config, path, agents=spec.agents, log_level=log_level, warm=warm) as testbed:
            status = testbed.follow(on_round, timeout=spec.timeout_s)
    except KeyboardInterrupt:
        record("interrupted", wall_s=time.monotonic() - t0)
        raise
    except (TestbedError, TimeoutError, RuntimeError, OSError) as exc:
        wall = time.monotonic() - t0
        if recover_finished(out, cell, wall, f"the runner lost track of the run: {exc}"):
            return CellOutcome(cell, "finished", wall)
        error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        record("failed", wall_s=wall, error=str(exc)[-4000:])
        return CellOutcome(cell, "failed", wall, error)
    wall = time.monotonic() - t0
    record("finished", wall_s=wall, summary=status["summary"])
    return CellOutcome(cell, "finished", wall)


def recover_finished(out: Path, cell: Cell, wall_s: float | None, note: str) -> bool:
    """Mark a cell finished when its run completed although the runner did not see the end.

    The Fed Server writes ``summary.json`` with ``finished: true`` only after the last round, so
    such a cell has every round; re-running it would only cost time.
    """
    path = cell_dir(out, cell)
    record = read_cell_record(path)
    try:
        summary = json.loads((path / "summary.json").read_text())
    except (OSError, ValueError):
        return False
    if not (record and ran_as(path, record, cell) and summary.get("finished")
            and summary.get("stop_reason") == "completed" and (path / "metrics.jsonl").exists()):
        return False
    _write_record(path, cell, "finished", wall_s=wall_s if wall_s is not None else record.get("wall_s"),
                  summary=summary, note=note, machine=record.get("machine"))
    return True


def run_grid(spec: ExperimentSpec, cells: list[Cell], out: Path, spec_text: str,
             stream: TextIO = sys.stdout, log_level: str = "WARNING",
             warm: WarmStarter | None = None) -> list[CellOutcome]:
    """Run every unfinished cell in order, with a progress bar; returns one outcome per cell."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiment.yaml").write_text(spec_text)
    machine = out / "machine.json"
    if not machine.exists():   # the machine the first cells ran on; a later resume keeps it
        machine.write_text(json.dumps(describe_machine(), indent=2) + "\n")
    progress = Progress(len(cells), stream)
    outcomes = []
    for cell in cells:
        if is_finished(out, cell):
            outcome = CellOutcome(cell, "skipped", 0.0)
        elif not _claim(out, cell):
            outcome = CellOutcome(cell, "busy", 0.0)
        else:
            name = ", ".join(f"{k}={v}" for k, v in cell.labels.items())
            progress.show(f"{name}: starting services ...")

            def on_round(record: RoundRecord, status: dict, name: str = name) -> None:
                acc = record.test_accuracy
                progress.show(f"{name}: round {record.round}/{status['rounds_total']}  "
                              f"acc {'n/a' if acc is None else f'{100 * acc:.1f}%'}")

            try:
                # Checked again under the lock: another runner may have finished it meanwhile, or
                # an earlier runner may have lost track of a run that completed.
                if is_finished(out, cell):
                    outcome = CellOutcome(cell, "skipped", 0.0)
                elif recover_finished(out, cell, None, "recovered: the run had completed (summary.json)"):
                    outcome = CellOutcome(cell, "recovered", 0.0)
                else:
                    outcome = run_cell(out, cell, spec, on_round, log_level, warm)
            finally:
                _release(out, cell)
        outcomes.append(outcome)
        progress.cell_done(outcome)
    return outcomes
