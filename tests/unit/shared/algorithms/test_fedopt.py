"""FedOpt (Reddi et al., ICLR 2021, Algorithm 2) against the paper's equations: FedAdagrad, FedAdam
and FedYogi step the global model with m_t, v_t, the server learning rate and τ over the round's
mean update Δ_t; buffers take the rule's value; the moments cross rounds in the checkpoint."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext
from shared.algorithms.fedopt import FedAdagrad, FedAdam, FedOpt, FedYogi
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.config import RunConfig
from shared.run_config import ConfigError, resolve_run_config
from shared.wire import packb, unpackb

VARIANTS = {"fedadagrad": FedAdagrad, "fedadam": FedAdam, "fedyogi": FedYogi}
PARAMS = {"server_lr": 0.05, "beta1": 0.8, "tau": 0.01}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def _algorithm(name: str, **params) -> FedOpt:
    params = {**PARAMS, **({"beta2": 0.9} if name != "fedadagrad" else {}), **params}
    algorithm = build_algorithm(RunConfig(algorithm=name, algorithm_params=params, aggregation={"rule": "mean"}))
    assert isinstance(algorithm, VARIANTS[name]) and ALGORITHMS[name] is VARIANTS[name]
    algorithm.bind_model(_model(0))
    return algorithm


def _v(name: str, v: torch.Tensor, d2: torch.Tensor) -> torch.Tensor:
    """The paper's second moment of each variant, written out."""
    if name == "fedadagrad":
        return v + d2
    if name == "fedadam":
        return 0.9 * v + 0.1 * d2
    return v - 0.1 * d2 * torch.sign(v - d2)


def _round(algorithm: FedOpt, x: dict, seeds: tuple[int, ...], index: int) -> dict:
    contributions = {f"dev-{s}": Contribution(weight=1.0, client_state=_model(s).state_dict()) for s in seeds}
    return algorithm.aggregate(RoundContext(index, index), x, contributions, {})


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_two_rounds_step_the_model_by_server_lr_m_over_root_v_plus_tau(name):
    algorithm = _algorithm(name)
    x = {k: v.clone() for k, v in _model(0).state_dict().items()}
    m = {n: torch.zeros_like(x[n]) for n in algorithm.m}
    v = {n: torch.full_like(x[n], 0.01 ** 2) for n in algorithm.m}     # v_{-1} = τ²
    for index, seeds in enumerate([(1, 2), (3, 4, 5)], start=1):
        new = _round(algorithm, x, seeds, index)
        for n in algorithm.m:   # Δ_t: the plain mean update (rule "mean", equal weights)
            delta = torch.stack([_model(s).state_dict()[n] for s in seeds]).mean(0) - x[n]
            m[n] = 0.8 * m[n] + 0.2 * delta
            v[n] = _v(name, v[n], delta * delta)
            expected = x[n] + 0.05 * m[n] / (v[n].sqrt() + 0.01)
            assert torch.allclose(algorithm.m[n], m[n], atol=1e-6) and torch.allclose(algorithm.v[n], v[n], atol=1e-7)
            assert torch.allclose(new[n], expected, atol=1e-6), (name, index, n)
        x = new


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_buffers_take_the_aggregation_rule_s_value(name):
    algorithm = _algorithm(name)
    assert set(algorithm.m) == {"0.weight", "0.bias", "1.weight", "1.bias"}   # parameters only
    x = _model(0).state_dict()
    new = _round(algorithm, x, (1, 2), 1)
    states = [_model(s).state_dict() for s in (1, 2)]
    assert torch.allclose(new["1.running_mean"], (states[0]["1.running_mean"] + states[1]["1.running_mean"]) / 2)


def test_yogi_s_second_moment_moves_towards_delta_squared_by_a_fixed_step_and_stays_positive():
    algorithm = _algorithm("fedyogi")
    v = torch.tensor([1.0, 0.25, 0.0001])
    d2 = torch.tensor([0.25, 1.0, 0.0001])
    assert torch.allclose(algorithm.second_moment(v, d2), torch.tensor([1.0 - 0.025, 0.25 + 0.1, 0.0001]))


def test_adam_and_adagrad_differ_in_the_second_moment_alone():
    adam, adagrad = _algorithm("fedadam", beta2=0.0), _algorithm("fedadagrad")
    v, d2 = torch.tensor([2.0]), torch.tensor([3.0])
    assert torch.equal(adam.second_moment(v, d2), d2) and torch.equal(adagrad.second_moment(v, d2), v + d2)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_the_moments_cross_a_restart_in_the_checkpoint(name):
    algorithm = _algorithm(name)
    x = _model(0).state_dict()
    _round(algorithm, x, (1, 2), 1)
    restored = _algorithm(name)
    restored.load_state_dict(unpackb(packb(algorithm.state_dict())))   # the checkpoint is msgpack
    assert all(torch.equal(restored.m[n], algorithm.m[n]) and torch.equal(restored.v[n], algorithm.v[n])
               for n in algorithm.m)
    new, again = _round(algorithm, x, (3,), 2), _round(restored, x, (3,), 2)
    assert all(torch.equal(new[n], again[n]) for n in x)


@pytest.mark.parametrize("override, message", [
    ("algorithm=fedadagrad algorithm_params.beta2=0.9", "algorithm_params.beta2: unknown key"),
    ("algorithm=fedadam algorithm_params.beta1=1", "algorithm_params.beta1: must be less than 1 (got 1)"),
    ("algorithm=fedyogi algorithm_params.tau=0", "algorithm_params.tau: must be greater than 0 (got 0)"),
    ("algorithm=fedadam split.sliding=false", "algorithm 'fedadam' trains the whole model on the device (split depth "
                                              "zero), so split.sliding does not apply: leave it unset"),
])
def test_what_fedopt_cannot_run_is_refused_at_the_configuration_check_in_one_line(override, message):
    with pytest.raises(ConfigError) as refused:
        resolve_run_config(overrides=override.split())
    assert len(refused.value.lines) == 1 and refused.value.lines[0].startswith(message), refused.value.lines
