"""The machine-readable results of a grid: one row per cell, and mean/std over the repeat axis."""
from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fed_server.records import RoundRecord, read_round_records

from experiments.grid import Cell
from experiments.runner import cell_dir, ran_as, read_cell_record
from experiments.spec import ExperimentSpec


@dataclass
class CellResult:
    """A cell with its round records (completed rounds only) and its status."""

    cell: Cell
    status: str                               # finished / failed / interrupted / running / not run
    rounds: list[RoundRecord] = field(default_factory=list)
    error: str | None = None
    machine: str | None = None                # the CPU it ran on (cell.json); None: not recorded


def load_results(spec: ExperimentSpec, cells: Sequence[Cell], out: Path) -> list[CellResult]:
    """Read every cell's folder; a cell that never ran (or ran another configuration) is "not run"."""
    results = []
    for cell in cells:
        path = cell_dir(out, cell)
        record = read_cell_record(path)
        if record is None or not ran_as(path, record, cell):
            results.append(CellResult(cell, "not run"))
            continue
        rounds = [r for r in read_round_records(path / "metrics.jsonl") if r.status == "ok"]
        results.append(CellResult(cell, str(record.get("status")), rounds, record.get("error"),
                                  machine_label(record.get("machine"))))
    return results


def machine_label(machine: dict | None) -> str | None:
    """A machine as a cell's row names it: CPU model, usable cores and torch version."""
    if not isinstance(machine, dict):
        return None
    return f"{machine.get('cpu_model')}, {machine.get('cpus_usable')} cores, torch {machine.get('torch')}"


def first_reaching(rounds: Sequence[RoundRecord], target: float) -> RoundRecord | None:
    """The first completed round whose test accuracy is at least ``target`` (rounds without an
    accuracy, federated evaluation that no device reported, never reach it)."""
    return next((r for r in rounds if r.test_accuracy is not None and r.test_accuracy >= target), None)


def _metric(record: RoundRecord, dotted: str) -> Any:
    value: Any = record.algorithm_metrics
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def cell_row(result: CellResult, spec: ExperimentSpec) -> dict[str, Any]:
    """One flat row: axis labels, headline figures, time / bytes / rounds to each target."""
    rounds = result.rounds
    cfg = result.cell.config
    row: dict[str, Any] = {**result.cell.labels, "cell_id": result.cell.cell_id, "status": result.status,
                           "machine": result.machine}
    for key, value in (("algorithm", cfg.algorithm), ("model", cfg.model)):
        row.setdefault(key, value)   # an axis of that name keeps its label (e.g. "fedipg+exit")
    row["rounds_done"] = len(rounds)
    accs = [r.test_accuracy for r in rounds if r.test_accuracy is not None]   # federated: may be missing
    row["final_accuracy"] = accs[-1] if accs else None
    row["best_accuracy"] = max(accs) if accs else None
    row[f"last{spec.report.last_k}_accuracy"] = statistics.fmean(accs[-spec.report.last_k:]) if accs else None
    times = [r.round_time_s for r in rounds]
    row["median_round_time_s"] = statistics.median(times) if times else None
    row["total_time_s"] = rounds[-1].elapsed_s if rounds else None
    row["total_bytes"] = rounds[-1].cumulative_bytes if rounds else None
    for target in spec.targets:
        hit = first_reaching(rounds, target)
        key = f"{round(100 * target):g}"
        row[f"rounds_to_{key}"] = hit.round if hit else None
        row[f"time_to_{key}_s"] = hit.elapsed_s if hit else None
        row[f"bytes_to_{key}"] = hit.cumulative_bytes if hit else None
    for name in spec.report.metrics:
        metric = _metric(rounds[-1], name) if rounds else None
        row[name] = metric if isinstance(metric, (int, float)) and not isinstance(metric, bool) else None
    return row


def numeric_columns(rows: Sequence[dict], spec: ExperimentSpec) -> list[str]:
    """Columns worth averaging: numbers, excluding the axis labels."""
    skip = set(spec.axes) | {"cell_id", "status", "machine", "algorithm", "model"}
    columns: list[str] = []
    for row in rows:
        for key in row:
            if key not in skip and key not in columns:
                columns.append(key)
    return columns


def aggregate(rows: Sequence[dict], spec: ExperimentSpec) -> list[dict[str, Any]]:
    """Rows grouped by every axis but the repeat axis: ``<col>_mean``, ``<col>_std`` and ``n``.

    Only finished cells count. A "to target" column averages the cells that reached the target
    and says how many did (``<col>_n``): an average that silently dropped the misses would flatter.
    """
    repeat = spec.repeat_axis
    keys = [a for a in spec.axes if a != repeat]
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    out = []
    for group_key, members in groups.items():
        done = [m for m in members if m["status"] == "finished"]
        agg: dict[str, Any] = {**dict(zip(keys, group_key)), "n": len(done), "cells": len(members)}
        for col in numeric_columns(members, spec):
            if col == "rounds_done":
                continue
            values = [m[col] for m in done if isinstance(m.get(col), (int, float)) and math.isfinite(m[col])]
            agg[f"{col}_mean"] = statistics.fmean(values) if values else None
            agg[f"{col}_std"] = statistics.stdev(values) if len(values) > 1 else (0.0 if values else None)
            if "_to_" in col:
                agg[f"{col}_n"] = len(values)
        out.append(agg)
    return out


def write_table(rows: Sequence[dict], path: Path) -> None:
    """CSV with the union of the rows' columns (first-seen order); None is written as empty."""
    columns: list[str] = []
    for row in rows:
        columns.extend(k for k in row if k not in columns)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row[k]) for k in columns})


def write_results(results: Sequence[CellResult], spec: ExperimentSpec, out: Path) -> tuple[list[dict], list[dict]]:
    """``results.csv`` / ``results.json`` (one row per cell) and ``summary.csv`` (mean/std over the repeat axis)."""
    rows = [cell_row(r, spec) for r in results]
    summary = aggregate(rows, spec)
    write_table(rows, out / "results.csv")
    write_table(summary, out / "summary.csv")
    (out / "results.json").write_text(json.dumps({"experiment": spec.name, "cells": rows, "summary": summary},
                                                 indent=2) + "\n")
    return rows, summary
