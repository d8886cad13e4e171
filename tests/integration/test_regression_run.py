"""A regression task through the real services: the example's MLP (examples/regression) learns a
float target from per-device ``.csv`` files under FedAvg (the devices compute the MSE) and under
S2FL (the Main Server computes it, where the labels travel), and the global model's test MSE
falls well below the baseline of predicting the training mean."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics
from shared.models import build_model
from shared.run_config import load_run_config
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "regression"
ROUNDS = 6


@pytest.fixture
def example(monkeypatch):
    """The example's folder on PYTHONPATH (its model.py), which the testbed's children inherit,
    and its make_data module. This process imports model.py too (the config check builds the
    model), under its plain name: any other example's ``model`` module is put aside meanwhile."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.delitem(sys.modules, "model", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(EXAMPLE), os.environ.get("PYTHONPATH")) if p))
    spec = importlib.util.spec_from_file_location("regression_make_data", EXAMPLE / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algorithm", ["fedavg", "s2fl"])
def test_a_regression_model_learns_below_the_mean_baseline(algorithm, tmp_path, example):
    paths = example.write(tmp_path / "data")
    raw = yaml.safe_load((EXAMPLE / "run.yaml").read_text())
    raw.update(algorithm=algorithm, rounds=ROUNDS)
    raw["data"]["test_file"] = str(tmp_path / "data" / "test.npz")
    raw["deadlines"] = {"min_participants": 3, "round_s": 120, "join_s": 30, "step_s": 30}
    config = load_run_config(raw)
    assert config.train.task == "regression"
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, device_data=[str(p) for p in paths], warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    assert status["state"] == "finished" and status["registered"] == 3
    records = read_metrics(run_dir)
    assert [r["status"] for r in records] == ["ok"] * ROUNDS
    assert all(r["test_accuracy"] is None and r["test_mse"] is not None and r["test_mae"] is not None
               for r in records)
    if algorithm == "s2fl":   # cut inside the MLP: the Main Server computed the MSE on the targets
        assert all(0 < k < 3 for r in records for k in r["split_points"].values())
    else:
        assert all(k == 3 for r in records for k in r["split_points"].values())

    # The baseline: predict the mean target of every device's rows.
    train_y = np.concatenate([np.loadtxt(p, delimiter=",", skiprows=1)[:, -1] for p in paths])
    test = np.load(tmp_path / "data" / "test.npz")
    baseline = float(np.mean((test["y"] - train_y.mean()) ** 2))
    last = records[-1]
    assert last["test_mse"] < 0.4 * baseline, (last["test_mse"], baseline)
    assert last["test_mse"] < records[0]["test_mse"]

    # The recorded figures are the checkpoint's model's, computed here without the project's metrics.
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    model = build_model(config.model, 1, (8,), seed=config.seed, params=config.model_params)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        error = model(torch.from_numpy(test["x"])).squeeze(1).double() - torch.from_numpy(test["y"]).double()
    assert last["test_mse"] == pytest.approx(float(error.square().mean()), rel=1e-4)
    assert last["test_mae"] == pytest.approx(float(error.abs().mean()), rel=1e-4)
    assert last["test_loss"] == pytest.approx(last["test_mse"], rel=1e-6)   # the run's loss is the MSE
    summary = status["summary"]
    assert summary["final_mse"] == last["test_mse"] and summary["final_mae"] == last["test_mae"]
    assert summary["initial_mse"] > summary["final_mse"] and summary["final_accuracy"] is None
    if algorithm == "fedavg":   # one export is enough: it reads the run directory, whoever trained it
        _check_regression_export(run_dir, tmp_path / "export", last)


def _check_regression_export(run_dir: Path, out: Path, last: dict) -> None:
    """``python -m fed_server export`` of a regression run prints and writes the recorded MSE and
    MAE (it printed no figure, and model.json held test_accuracy: null), and nothing else of the
    exporters'."""
    done = subprocess.run([sys.executable, "-m", "fed_server", "export", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"global model of round {ROUNDS}, test mse {last['test_mse']:.4f}, test mae {last['test_mae']:.4f}:"
    assert "[torch.onnx]" not in done.stdout + done.stderr and "warning" not in done.stdout + done.stderr, done
    info = json.loads((out / "model.json").read_text())
    assert (info["task"], info["test_mse"], info["test_mae"]) == ("regression", last["test_mse"], last["test_mae"])
    assert "test_accuracy" not in info
