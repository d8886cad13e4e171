"""A ResNet-style model written as one class (skip connections and BatchNorm in its own forward),
from the user's package through the real services: traced and cut between its residual stages, it
trains under S2FL, with every device cut inside it, and under FedAvg, whole on the devices."""
from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.models import build_model

REF = "user_models:one_class_resnet"
HERE = Path(__file__).resolve().parent


@pytest.fixture
def user_package(monkeypatch):
    """The user's package on PYTHONPATH, which the testbed's children inherit (service_env)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))


@pytest.mark.parametrize("algorithm", ["s2fl", "fedavg"])
def test_a_one_class_resnet_trains_through_the_services(run_testbed, user_package, algorithm):
    config = small_config(algorithm=algorithm, model=REF,
                          **{"data.num_devices": 3, "data.max_samples": 600, "deadlines.min_participants": 3})
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished" and status["registered"] == 3
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    splits = [k for m in metrics for k in m["split_points"].values()]
    if algorithm == "s2fl":   # cut between residual stages, inside the user's module
        assert len(splits) == 6 and all(k in (1, 2, 3, 4) for k in splits)
    else:                     # all five blocks on the device, no Main Server group
        assert splits == [5] * 6 and all(not m["groups"] for m in metrics)

    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(REF, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert list(state) == list(initial)
    for key in ("blocks.stem.stem.weight", "blocks.b_short.b_conv2.weight", "blocks.fc.fc.weight"):
        assert not torch.equal(state[key], initial[key]), key   # trained on both sides of every cut
    # BatchNorm statistics of a residual stage and of a shortcut are trained and aggregated too
    for key in ("blocks.a_conv1.a_bn2.running_mean", "blocks.c_short.c_short_bn.running_var"):
        assert not torch.equal(state[key], initial[key]), key
    assert all(torch.isfinite(v.float()).all() for v in state.values())
    assert all(math.isfinite(m["train_loss"]) and math.isfinite(m["test_loss"]) for m in metrics)
