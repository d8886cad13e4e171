"""FedProx: the proximal term's value and gradient, its parameters, and FedAvg's server side."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.algorithms.base import Payload
from shared.algorithms.fedprox import FedProx, FedProxLogic
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.config import RunConfig
from shared.run_config import ConfigError, resolve_run_config


def _logic(mu: float, model: nn.Module) -> FedProxLogic:
    logic = FedProx.device_logic({"mu": mu})
    assert isinstance(logic, FedProxLogic)
    logic.begin_round(model, Payload(), data=None)   # type: ignore[arg-type]  # FedProx reads no data
    return logic


def test_the_loss_is_cross_entropy_plus_half_mu_times_the_squared_distance_to_the_round_start():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    logic = _logic(0.5, model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    loss = logic.loss(model, x, y)
    distance = sum(((p - start[n]) ** 2).sum() for n, p in model.named_parameters())
    assert loss.item() == pytest.approx((F.cross_entropy(model(x), y) + 0.25 * distance).item(), rel=1e-6)
    # Its gradient adds mu (w - w^t) to cross-entropy's.
    loss.backward()
    proximal = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for n, p in model.named_parameters():
        assert torch.allclose(proximal[n] - p.grad, 0.5 * (p.detach() - start[n]), atol=1e-6)


def test_mu_zero_is_fedavg_and_the_server_side_is_fedavgs():
    model = nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.arange(8) % 3
    assert torch.equal(_logic(0.0, model).loss(model, x, y), F.cross_entropy(model(x), y))
    algorithm = build_algorithm(RunConfig(algorithm="fedprox", algorithm_params={"mu": 0.1}))
    assert ALGORITHMS["fedprox"] is FedProx and algorithm.split_mode() == "zero"
    assert algorithm.device_params() == {"mu": 0.1}   # what every task carries to the devices


def test_a_negative_or_unknown_parameter_is_a_config_error():
    with pytest.raises(ConfigError, match="algorithm_params.mu"):
        resolve_run_config(overrides=["algorithm=fedprox", "algorithm_params.mu=-1"])
    with pytest.raises(ConfigError, match="algorithm_params"):
        resolve_run_config(overrides=["algorithm=fedprox", "algorithm_params.nu=1"])
