"""An ordinary nn.Module (its own forward, no blocks) from the user's package through the real
services: cut by tracing, trained under S2FL with the cut inside it, and exported under the user's
own key names into a fresh instance of their class."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config
from shared.models import build_model
from shared.models.export import load_trained
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

REF = "user_models:traced_cnn"
PARAMS = {"width": 4}
HERE = Path(__file__).resolve().parent


@pytest.fixture
def user_package(monkeypatch):
    """The user's package on PYTHONPATH, which the testbed's children inherit (service_env)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))


def test_a_traced_module_trains_under_s2fl_and_exports_under_the_users_keys(tmp_path, user_package):
    config = small_config(model=REF, model_params=PARAMS,
                          **{"data.num_devices": 3, "data.max_samples": 600, "deadlines.min_participants": 3})
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished" and status["registered"] == 3
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    # three traced blocks (conv1, conv2, fc): every device cut inside the user's module
    assert all(k in (1, 2) for m in metrics for k in m["split_points"].values())

    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(REF, 10, (1, 28, 28), seed=config.seed, params=PARAMS).state_dict()
    assert list(state) == list(initial) and list(state)[:2] == ["blocks.conv1.conv1.weight", "blocks.conv1.conv1.bias"]
    assert not torch.equal(state["blocks.conv2.conv2.weight"], initial["blocks.conv2.conv2.weight"])
    assert not torch.equal(state["blocks.conv1.bn1.running_mean"], initial["blocks.conv1.bn1.running_mean"])

    out = tmp_path / "export"
    done = subprocess.run([sys.executable, "-m", "fed_server", "export", str(run_dir), "--out", str(out),
                           "--format", "pt", "--format", "pt2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(HERE)})
    assert done.returncode == 0, done.stderr
    from user_models import TracedCNN

    net = TracedCNN(10, (1, 28, 28), **PARAMS)
    weights = torch.load(out / "model.pt", weights_only=True)
    assert list(weights) == list(net.state_dict())
    net.load_state_dict(weights, strict=True)
    trained = {key.split(".", 2)[2]: value for key, value in state.items()}   # blocks.<block>.<user's key>
    assert trained.keys() == net.state_dict().keys()
    assert all(torch.equal(value, trained[key]) for key, value in net.state_dict().items())
    loaded = load_trained(out)
    program = torch.export.load(str(out / "model.pt2")).module()
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        want = net.eval()(x)
        assert isinstance(loaded, TracedCNN) and torch.allclose(loaded(x), want, atol=1e-6)
        assert torch.allclose(program(x), want, atol=1e-5)
