"""FedBC end to end through the real services on Synthetic(0.5, 0.5) with logistic regression."""
from __future__ import annotations

import math

import pytest
import torch

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.models import build_model


def test_fedbc_two_rounds_on_synthetic(run_testbed):
    config = small_config(algorithm="fedbc", model="logreg", **{
        "data.dataset": "synthetic", "data.partition": "natural", "data.num_devices": 4, "data.max_samples": None,
        "devices_per_round": 3, "train.lr": 0.01, "train.momentum": 0.5, "train.batch_size": 20,
        "algorithm_params.dual_lr": 0.01,
    })
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2] and all(m["status"] == "ok" for m in metrics)
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in metrics)

    _, state, meta = RunDirectory(run_dir).read_checkpoint()
    initial = build_model("logreg", 10, (1, 1, 60), seed=config.seed).state_dict()
    assert any(not torch.equal(state[k], initial[k]) for k in initial)

    for m in metrics:
        fedbc = m["algorithm_metrics"]
        assert set(fedbc["lambda"]) == set(m["aggregated"]) and len(m["aggregated"]) == 3
        # round 1 starts from lambda = gamma = 0 and every device moves: lambda = dual_lr * d > 0
        assert all(lam > 0 for lam in fedbc["lambda"].values())
        assert all(math.isfinite(d) and d > 0 for d in fedbc["distance"].values())
        assert fedbc["fallback"] is False
        assert sum(fedbc["coef_lambda"].values()) == pytest.approx(1.0)
        assert 0.0 <= fedbc["local_acc_pooled"] <= 1.0 and 0.0 <= fedbc["local_acc_mean"] <= 1.0
    first = metrics[0]["algorithm_metrics"]
    assert all(first["lambda"][d] == pytest.approx(0.01 * first["distance"][d]) for d in first["lambda"])
    # the duals and tolerances are in the checkpoint, as the last round recorded them
    saved = meta["algorithm_state"]
    last = metrics[-1]["algorithm_metrics"]
    assert all(saved["lambda"][d] == last["lambda"][d] and saved["gamma"][d] == last["gamma"][d] for d in last["lambda"])
