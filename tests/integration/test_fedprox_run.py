"""FedProx end to end through the real services: the proximal weight the Fed Server sends reaches
the devices' local objective, and keeps the new global model nearer the one the round began with."""
from __future__ import annotations

import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config
from shared.models import build_model
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def _moved(run_dir, mu: float) -> tuple[float, float]:
    """How far one FedProx round moved the global model from the initial one (L2 over every entry),
    and the new model's test accuracy."""
    config = small_config(algorithm="fedprox", rounds=1, **{"algorithm_params.mu": mu, "train.local_epochs": 2,
                                                            "devices.profiles": []})
    with Testbed(config, run_dir, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok"]
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model("cnn", 10, (1, 28, 28), seed=config.seed).state_dict()
    moved = sum(float((state[k].double() - initial[k].double()).pow(2).sum()) for k in initial) ** 0.5
    return moved, metrics[0]["test_accuracy"]


def test_a_large_proximal_weight_keeps_the_round_near_the_global_model(tmp_path):
    (free, accuracy), (held, _) = _moved(tmp_path / "mu0", 0.0), _moved(tmp_path / "mu5", 5.0)
    assert accuracy > 0.2   # mu 0 is FedAvg: it trained (chance: 0.1)
    assert held < 0.8 * free, (held, free)
