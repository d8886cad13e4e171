"""The projects under examples/ run through their one command (``run.sh``), as a user runs them.

Each test runs the example's ``run.sh`` as a subprocess with two rounds, its data written into the
test's folder (``DATA_DIR``): the script writes the data, starts the Fed Server, the Main Server
and one device agent per device folder or file, and prints the round lines. The tests check what a
user sees (round lines, the final line) and the run directory (metrics.jsonl, summary.json).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import yaml

from integration_support import read_metrics

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
ROUNDS = 2


def run_example(name: str, tmp_path: Path, *args: str, timeout_s: float = 240.0) -> tuple[str, Path]:
    """``examples/<name>/run.sh --rounds 2 --run-dir ...``; returns its output and the run directory.

    The testbed's own ``--timeout`` makes it stop its services and fail by itself; the outer
    timeout only backs that up, with SIGTERM so the testbed still stops the services it started.
    """
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHON": sys.executable, "DATA_DIR": str(tmp_path / "data")}
    command = ["bash", str(EXAMPLES / name / "run.sh"), "--rounds", str(ROUNDS), "--run-dir", str(run_dir),
               "--timeout", str(timeout_s - 30), *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    logs = "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log"))) \
        if (run_dir / "logs").is_dir() else ""
    assert process.returncode == 0, f"{name}/run.sh exited with {process.returncode}:\n{output}{logs}"
    return output, run_dir


def check_run(output: str, run_dir: Path, devices: int) -> tuple[list[dict], dict]:
    """The round lines, the final line and the run directory of a finished ``ROUNDS``-round run."""
    printed = [int(m.group(1)) for m in re.finditer(rf"^round\s+(\d+)/{ROUNDS}\s", output, flags=re.M)]
    assert printed == list(range(1, ROUNDS + 1)), output
    assert f"done: {ROUNDS} rounds" in output, output
    records = [r for r in read_metrics(run_dir) if r["status"] == "ok"]
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    for record in records:
        assert len(record["aggregated"]) == devices, record
        assert record["test_accuracy"] is not None and 0.0 <= record["test_accuracy"] <= 1.0, record
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS and summary["finished"] and summary["stop_reason"] == "completed"
    return records, summary


def test_image_folders_example_runs_s2fl_on_three_devices_own_folders(tmp_path: Path) -> None:
    output, run_dir = run_example("image_folders", tmp_path)
    folders = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert folders == ["device-0", "device-1", "device-2"]
    for folder in folders:  # one sub-folder per class, PNGs inside
        classes = sorted((tmp_path / "data" / folder).iterdir())
        assert [c.name for c in classes] == [str(c) for c in range(10)]
        assert all(any(c.glob("*.png")) for c in classes)
    records, summary = check_run(output, run_dir, devices=3)
    # S2FL with the user's 4-block CNN: every device trains a client portion of 1 to 3 blocks.
    for record in records:
        assert set(record["split_points"].values()) <= {1, 2, 3}, record["split_points"]
        assert record["groups"], record
        # Federated evaluation: the accuracy is over the three devices' held-out images.
        assert record["evaluated_devices"] == 3 and record["evaluated_samples"] > 0, record
    assert summary["model"] == "model:build"
    # Digits, 10 classes: well above chance after two rounds, measured on the devices' held-out images.
    assert summary["final_accuracy"] > 0.3, summary


def test_tabular_example_runs_fedavg_on_three_npz_files(tmp_path: Path) -> None:
    output, run_dir = run_example("tabular", tmp_path)
    data = tmp_path / "data"
    assert sorted(p.name for p in (data / "devices").iterdir()) == ["device-0.npz", "device-1.npz", "device-2.npz"]
    records, summary = check_run(output, run_dir, devices=3)
    for record in records:  # FedAvg: the whole 3-block MLP on every device, nothing for the Main Server
        assert set(record["split_points"].values()) == {3} and not record["groups"], record
    assert summary["model"] == "model:build"
    # Three wine cultivars, evaluated by the Fed Server on data/test.npz.
    assert summary["final_accuracy"] > 0.6, summary


def test_tabular_example_transform_is_the_statistics_of_its_data() -> None:
    """run.yaml's per-feature mean and std are what make_data.py computes from the devices' rows:
    the committed numbers cannot drift from the data the example writes."""
    printed = subprocess.run([sys.executable, str(EXAMPLES / "tabular" / "make_data.py"), "--print-transform"],
                             capture_output=True, text=True, check=True).stdout
    computed = yaml.safe_load(printed)["input_transform"]
    declared = yaml.safe_load((EXAMPLES / "tabular" / "run.yaml").read_text())["data"]["input_transform"]
    for key in ("mean", "std"):
        assert len(declared[key]) == 13
        np.testing.assert_allclose(declared[key], computed[key], rtol=1e-5)


def test_image_folders_example_gives_each_device_its_own_images_with_a_label_skew() -> None:
    """make_data.py's split: no image on two devices, every class on every device, and each
    device rich in its home classes (what S2FL's label-balanced grouping has to balance)."""
    spec = importlib.util.spec_from_file_location("image_make_data", EXAMPLES / "image_folders" / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    labels = np.repeat(np.arange(10), 100)
    parts = make_data.device_indices(labels, devices=3, major=60, minor=6, seed=0)
    assert sum(len(p) for p in parts) == len(set(np.concatenate(parts).tolist()))
    for d, part in enumerate(parts):
        counts = np.bincount(labels[part], minlength=10)
        assert counts.tolist() == [60 if c % 3 == d else 6 for c in range(10)]
