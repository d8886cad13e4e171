"""The experiment runner end to end: a 2-cell, 2-round grid through the real services, then a rerun."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TINY = """
name: tiny
base:
  rounds: 2
  data: {num_devices: 3, max_samples: 300}
  devices: {profiles: [high, low], time_scale: 1000}
axes:
  algorithm: [fedavg, s2fl]
  seed: {keys: [seed, data.seed], values: [0]}
targets: [0.15]
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "experiments", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=400)


def test_tiny_grid_runs_reports_and_is_not_rerun(tmp_path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    out = tmp_path / "out"
    # Forked from one warm process (the services' starts are checked with exec elsewhere).
    first = _run("run", str(spec), "--out", str(out), "--warm-start")
    assert first.returncode == 0, first.stderr + first.stdout
    assert "2 cells (2 to run)" in first.stdout and first.stdout.count("done in") == 2

    cells = sorted((out / "cells").iterdir())
    assert [c.name for c in cells] == ["algorithm-fedavg__seed-0", "algorithm-s2fl__seed-0"]
    summaries = {c.name: json.loads((c / "summary.json").read_text()) for c in cells}
    assert all(s["finished"] and s["rounds"] == 2 for s in summaries.values())
    records = [json.loads((c / "cell.json").read_text()) for c in cells]
    assert all(r["status"] == "finished" and r["machine"]["cpus_usable"] >= 1 and r["machine"]["torch"]
               for r in records)   # each cell names the machine it ran on
    with open(out / "results.csv") as fh:
        rows = {r["cell_id"]: r for r in csv.DictReader(fh)}
    for name, summary in summaries.items():   # the table carries what the Fed Server measured
        assert float(rows[name]["final_accuracy"]) == summary["final_accuracy"]
        assert float(rows[name]["total_bytes"]) == summary["total_bytes"]
    report = (out / "report.md").read_text()
    assert "| fedavg | 1/1 |" in report and "| s2fl | 1/1 |" in report
    for png in ("accuracy_vs_round", "accuracy_vs_time", "accuracy_vs_bytes", "device_round_times"):
        assert (out / f"{png}.png").stat().st_size > 1000

    stamps = {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in cells}
    again = _run("run", str(spec), "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert "2 cells (0 to run)" in again.stdout and again.stdout.count("already finished, skipped") == 2
    assert {c.name: (c / "metrics.jsonl").stat().st_mtime_ns for c in cells} == stamps
    listing = _run("list", str(spec), "--out", str(out))
    assert listing.stdout.split() == ["finished", "algorithm-fedavg__seed-0", "finished", "algorithm-s2fl__seed-0"]


def test_a_bad_experiment_file_fails_before_anything_runs(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(TINY.replace("[fedavg, s2fl]", "[fedavg, no_such_algorithm]"))
    result = _run("run", str(spec), "--out", str(tmp_path / "out"))
    assert result.returncode == 2 and "algorithm=no_such_algorithm" in result.stderr
    assert not (tmp_path / "out").exists()
