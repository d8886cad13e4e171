"""FedAdagrad, FedAdam and FedYogi end to end through the real services: the new global model in the
Fed Server's checkpoint is the initial one stepped by Algorithm 2 of Reddi et al. with the moments
that checkpoint holds, m_1 = (1 - β1) Δ and v_1 from v_{-1} = τ², Δ being the round's mean update."""
from __future__ import annotations

import pytest
import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config
from shared.algorithms.base import trainable_parameters
from shared.models import build_model
from shared.wire import decode_state
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

PARAMS = {"server_lr": 0.03, "beta1": 0.9, "tau": 1e-3}


def _v1(name: str, delta_sq: torch.Tensor, beta2: float, tau: float) -> torch.Tensor:
    v0 = torch.full_like(delta_sq, tau ** 2)
    if name == "fedadagrad":
        return v0 + delta_sq
    if name == "fedadam":
        return beta2 * v0 + (1 - beta2) * delta_sq
    return v0 - (1 - beta2) * delta_sq * torch.sign(v0 - delta_sq)


@pytest.mark.parametrize("name", ["fedadagrad", "fedadam", "fedyogi"])
def test_one_round_steps_the_global_model_by_algorithm_2(tmp_path, name):
    params = {**PARAMS, **({} if name == "fedadagrad" else {"beta2": 0.99})}
    config = small_config(algorithm=name, rounds=1, algorithm_params=params,
                          **{"data.num_devices": 3, "devices.profiles": []})
    with Testbed(config, tmp_path / name, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    metrics = read_metrics(tmp_path / name)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok"]
    assert len(metrics[0]["aggregated"]) == 3

    _, state, extra = RunDirectory(tmp_path / name).read_checkpoint()
    initial = build_model("cnn", 10, (1, 28, 28), seed=config.seed)
    parameters = trainable_parameters(initial)
    m = decode_state(extra["algorithm_state"]["m"], expect=parameters)
    v = decode_state(extra["algorithm_state"]["v"], expect=parameters)
    moved = 0.0
    for n, x0 in parameters.items():
        delta = m[n] / (1 - params["beta1"])          # m_0 = (1 - β1) Δ
        assert torch.allclose(v[n], _v1(name, delta * delta, params.get("beta2", 0.0), params["tau"]),
                              rtol=1e-4, atol=1e-12), n
        step = params["server_lr"] * m[n] / (v[n].sqrt() + params["tau"])
        assert torch.allclose(state[n], x0.detach() + step, atol=1e-6), n
        moved += float(step.abs().sum())
    assert moved > 1.0   # the devices trained and the server stepped: the check is not x0 == x0
