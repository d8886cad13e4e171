"""FedBC (docs/algorithms/fedbc.md#tests, plus input validation and the local split)."""
from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, train_round
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import DeviceLogic, RoundContext, parse_payload
from shared.algorithms.fedbc import (
    FedBC, FedBCLogic, FedBCTaskExtras, FedBCUploadExtras, dual_step, lambda_weighted_average, squared_distance,
)
from shared.algorithms.proximal import proximal_penalty
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.config import RunConfig
from shared.run_config import load_run_config
from shared.data import ArrayDataset, DataSpec, device_shard, load_dataset
from shared.errors import Invalid
from shared.models import build_model


def _config(**params) -> RunConfig:
    return load_run_config({"algorithm": "fedbc", "algorithm_params": params, "seed": 3})


class Scalar(nn.Module):
    """A one-parameter "model" for hand-computed aggregation checks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))


def _server(**params) -> FedBC:
    algo = build_algorithm(_config(**params))
    assert isinstance(algo, FedBC)
    algo.bind_model(Scalar())
    return algo


def _extras(n_train: int, correct: int = 0, total: int = 0) -> FedBCUploadExtras:
    return FedBCUploadExtras(d=0.0, local_correct=correct, local_total=total, train_samples=n_train)


def _task(**wire) -> FedBCTaskExtras:
    """Task extras as the device gets them: the wire map, validated."""
    return parse_payload(FedBCTaskExtras, wire, "task extras")


def _aggregate(algo: FedBC, xs: list[float], ns: list[int], round_id: int = 1, z: float = 0.0):
    global_state = {"w": torch.tensor([z])}
    devices = [f"dev-{i}" for i in range(len(xs))]
    contributions = {d: Contribution(weight=n, client_state={"w": torch.tensor([x])}) for d, x, n in zip(devices, xs, ns)}
    extras = {d: _extras(n) for d, n in zip(devices, ns)}
    return algo.aggregate(RoundContext(round_id, round_id), global_state, contributions, extras)["w"].item(), devices


def test_registered():
    assert ALGORITHMS["fedbc"] is FedBC
    assert build_algorithm(_config()).split_mode() == "zero"


# ----------------------------------------------------------------------------- 1. penalty gradient
def test_penalty_gradient_is_2_lambda_w_minus_z_and_ignores_buffers_and_gamma():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    frozen = model[3].bias
    frozen.requires_grad_(False)  # frozen parameters are excluded from the penalty
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    shift = {name: 0.1 * torch.randn_like(p) for name, p in model.named_parameters() if p.requires_grad}
    grads = {}
    for gamma in (0.0, 0.37):
        logic = FedBCLogic({"local_test_fraction": 0.0})
        data = ArrayDataset(x=x, y=y, num_classes=3)
        logic.begin_round(model, _task(**{"lambda": 0.7, "gamma": gamma, "split_seed": 1}), data)
        assert set(logic.reference) == {n for n, p in model.named_parameters() if p.requires_grad}
        with torch.no_grad():  # move w away from z
            for name, p in model.named_parameters():
                if name in shift:
                    p.add_(shift[name])
        model.zero_grad()
        logic.loss(model, x, y).backward()
        grads[gamma] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        model.zero_grad()
        (logic.loss(model, x, y) - F.cross_entropy(model(x), y)).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, 2 * 0.7 * (p.detach() - logic.reference[name]), rtol=1e-6, atol=1e-7)
        with torch.no_grad():  # back to z for the next gamma
            for name, p in model.named_parameters():
                if name in logic.reference:
                    p.copy_(logic.reference[name])
    assert frozen.grad is None
    for name in grads[0.0]:
        assert torch.equal(grads[0.0][name], grads[0.37][name])  # gamma changes no gradient


# ----------------------------------------------------------------------------- 2. closed form
def test_gd_on_quadratic_plus_penalty_reaches_closed_form():
    a = torch.tensor([1.0, -2.0, 0.5])
    model = Scalar()
    model.w = nn.Parameter(torch.zeros(3))
    reference = {"w": torch.zeros(3)}  # z = 0
    lam, lr = 1.0, 0.1
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(500):
        loss = 0.5 * ((model.w - a) ** 2).sum() + lam * proximal_penalty(model, reference)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.testing.assert_close(model.w.detach(), (a + 2 * lam * reference["w"]) / (1 + 2 * lam), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- 3. dual step
def test_dual_and_tolerance_step_hand_computed():
    lam, gam, _, _ = dual_step(0.2, 0.05, 0.3, 0.1, 0.1, adaptive=True)
    assert lam == pytest.approx(0.225) and gam == pytest.approx(0.07)
    lam, gam, _, _ = dual_step(0.002, 0.05, 0.01, 0.1, 0.1, adaptive=True)
    assert lam == 0.0 and gam == pytest.approx(0.05 + 0.1 * 0.002)  # projected; gamma uses the old lambda
    lam, gam, _, _ = dual_step(0.2, 0.05, 0.3, 0.1, 0.1, adaptive=False)
    assert lam == pytest.approx(0.225) and gam == 0.05  # fixed tolerance
    lam, _, _, _ = dual_step(0.2, 0.0, 10.0, 0.1, 0.1, adaptive=True, lambda_max=0.5)
    assert lam == 0.5  # upper projection
    # momentum: v = (d - gamma) + m * buf
    lam, gam, v, u = dual_step(0.2, 0.05, 0.3, 0.1, 0.1, adaptive=True, momentum=0.5, lam_buf=0.4, gamma_buf=0.2)
    assert v == pytest.approx(0.25 + 0.2) and lam == pytest.approx(0.2 + 0.1 * 0.45)
    assert u == pytest.approx(0.2 + 0.1) and gam == pytest.approx(0.05 + 0.1 * 0.3)


def test_server_updates_only_participants():
    algo = _server(dual_lr=0.1)
    algo.lam["dev-9"], algo.gamma["dev-9"] = 0.3, 0.2
    _aggregate(algo, [1.0, 3.0], [1, 3])
    assert algo.lam["dev-9"] == 0.3 and algo.gamma["dev-9"] == 0.2
    assert algo.task_extras("dev-9", RoundContext(2, 2)).lam == 0.3
    assert algo.task_extras("never-seen", RoundContext(2, 2)).lam == 0.0 and algo.task_extras("never-seen", RoundContext(2, 2)).gamma == 0.0


# ----------------------------------------------------------------------------- 4. aggregation
def test_first_round_hand_computed():
    algo = _server(dual_lr=0.1)
    z, devices = _aggregate(algo, [1.0, 3.0], [1, 3])  # from z = 0: d = [1, 9]
    assert [algo.lam[d] for d in devices] == pytest.approx([0.1, 0.9])
    assert [algo.gamma[d] for d in devices] == [0.0, 0.0]
    assert z == pytest.approx(2.8)  # (0.1 * 1 + 0.9 * 3) / 1.0
    metrics = algo.round_metrics(RoundContext(1, 1), {})
    assert metrics["fallback"] is False and metrics["coef_lambda"]["dev-1"] == pytest.approx(0.9)
    assert metrics["coef_data"]["dev-1"] == pytest.approx(0.75)
    json.dumps(metrics)


def test_all_zero_lambdas_fall_back_to_data_size_average(caplog):
    algo = _server(dual_lr=0.1, gamma_mode="fixed", gamma=100.0)  # d - gamma < 0 -> lambda projected to 0
    with caplog.at_level(logging.WARNING):
        z, devices = _aggregate(algo, [1.0, 3.0], [1, 3])
    assert [algo.lam[d] for d in devices] == [0.0, 0.0]
    assert z == pytest.approx(2.5) and np.isfinite(z)
    assert "FedAvg" in caplog.text
    metrics = algo.round_metrics(RoundContext(1, 1), {})
    assert metrics["fallback"] is True and metrics["fallback_rounds"] == 1
    assert all(v is None for v in metrics["coef_lambda"].values())
    json.dumps(metrics)


def test_lambda_weighted_average_over_every_floating_entry_and_max_for_integers():
    g = {"w": torch.zeros(2), "bn.running_mean": torch.zeros(2), "bn.num_batches_tracked": torch.tensor(0),
         "untouched": torch.ones(1)}
    s1 = {"w": torch.tensor([1.0, 2.0]), "bn.running_mean": torch.tensor([4.0, 0.0]), "bn.num_batches_tracked": torch.tensor(7)}
    s2 = {"w": torch.tensor([3.0, 6.0]), "bn.running_mean": torch.tensor([0.0, 8.0]), "bn.num_batches_tracked": torch.tensor(3)}
    out = lambda_weighted_average(g, [s1, s2], [0.25, 0.75])
    torch.testing.assert_close(out["w"], torch.tensor([2.5, 5.0]))
    torch.testing.assert_close(out["bn.running_mean"], torch.tensor([1.0, 6.0]))
    assert out["bn.num_batches_tracked"].item() == 7 and out["bn.num_batches_tracked"].dtype == torch.int64
    assert torch.equal(out["untouched"], torch.ones(1))
    # a zero weight excludes the device from the floating average
    torch.testing.assert_close(lambda_weighted_average(g, [s1, s2], [0.0, 2.0])["w"], s2["w"])
    for bad in ([0.0, 0.0], [-1.0, 2.0], [float("nan"), 1.0]):
        with pytest.raises(ValueError):
            lambda_weighted_average(g, [s1, s2], bad)
    with pytest.raises(ValueError):
        lambda_weighted_average(g, [{"nope": torch.zeros(1)}], [1.0])


# ----------------------------------------------------------------------------- 5. reductions
def _tiny_task():
    model = build_model("logreg", 10, (1, 1, 60), seed=0)
    spec = DataSpec(dataset="synthetic", partition="natural", num_devices=30, seed=1)
    data = device_shard(spec, load_dataset(spec)[0], 0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    return model, data, weights


def _train(model, weights, data, logic, extras):
    """Train one round; the weights the device would upload."""
    train_round(model, len(model.blocks), weights, data, TrainSettings(0.01, 0.5, 0.0, 20, 2, 5),
                TrainContext(RoundClock(None), logic=logic, extras=extras))
    return {k: v.detach().clone() for k, v in model.portion(0, len(model.blocks)).state_dict().items()}


class FedProxLogic(DeviceLogic):
    """Reference FedProx objective CE + (mu / 2) ||w - z||^2, written independently."""

    def __init__(self, mu: float) -> None:
        super().__init__({})
        self.mu = mu

    def begin_round(self, model, extras, data):
        self.z = [p.detach().clone() for p in model.parameters()]

    def loss(self, model, x, y):
        prox = torch.stack([((p - z) ** 2).sum() for p, z in zip(model.parameters(), self.z)]).sum()
        return F.cross_entropy(model(x), y) + self.mu / 2 * prox


def test_constant_lambda_is_fedprox_with_mu_2_lambda_and_uniform_average():
    model, data, weights = _tiny_task()
    params = {"local_test_fraction": 0.0}
    fedbc = _train(model, weights, data, FedBCLogic(params), _task(**{"lambda": 0.05, "gamma": 0.3, "split_seed": 0}))
    fedprox = _train(model, weights, data, FedProxLogic(mu=0.1), None)
    for key in fedbc:
        assert torch.equal(fedbc[key], fedprox[key]), key  # bit for bit
    assert any(not torch.equal(fedbc[k], weights[k]) for k in weights)
    # aggregation with eta_lambda = 0 and lambda == 0.05: the unweighted mean
    algo = _server(dual_lr=0.0, lambda_init=0.05, gamma_mode="fixed", gamma=0.3)
    z, devices = _aggregate(algo, [1.0, 2.0, 6.0], [10, 1, 100])
    assert z == pytest.approx(3.0) and all(algo.lam[d] == 0.05 for d in devices)


def test_zero_lambda_local_step_is_fedavg_bit_for_bit():
    model, data, weights = _tiny_task()
    fedbc = _train(model, weights, data, FedBCLogic({"local_test_fraction": 0.0}), _task(**{"lambda": 0.0, "gamma": 0.0}))
    fedavg = _train(model, weights, data, DeviceLogic({}), None)
    assert all(torch.equal(fedbc[k], fedavg[k]) for k in fedbc)


# ----------------------------------------------------------------------------- device side
def test_device_trains_on_80_percent_and_reports_local_accuracy_and_distance():
    model, data, weights = _tiny_task()
    logic = FedBCLogic({"local_test_fraction": 0.2, "eval_batch_size": 7})
    state = _train(model, weights, data, logic, _task(**{"lambda": 0.01, "gamma": 0.0, "split_seed": 9}))
    extras = logic.upload_extras(model, data)
    assert set(extras.to_wire()) == {"d", "local_correct", "local_total", "train_samples"}  # the wire keys
    assert parse_payload(FedBCUploadExtras, extras.to_wire(), "extras") == extras
    assert extras.train_samples + extras.local_total == len(data)
    assert extras.local_total == int(0.2 * len(data))
    test = data.subset(logic.test_idx)
    with torch.no_grad():
        expected = int((model.eval()(test.x).argmax(1) == test.y).sum())
    assert extras.local_correct == expected
    assert extras.d == pytest.approx(squared_distance(state, weights, ["blocks.head.weight", "blocks.head.bias"]))
    # the server accepts these extras and agrees on the distance
    algo = build_algorithm(_config())
    algo.bind_model(model)
    algo.accept_update("dev-0", RoundContext(1, 1), state, extras, len(data), weights)


def test_aggregate_uses_the_distance_computed_when_the_upload_was_accepted(monkeypatch):
    algo = _server()
    global_state = {"w": torch.tensor([0.0])}
    states = {"dev-0": {"w": torch.tensor([1.0])}, "dev-1": {"w": torch.tensor([3.0])}}
    for device, state in states.items():
        algo.accept_update(device, RoundContext(7, 7), state, _extras(4), 4, global_state)
    calls = []
    monkeypatch.setattr("shared.algorithms.fedbc.squared_distance", lambda *a: calls.append(a) or 0.0)
    contributions = {d: Contribution(weight=4, client_state=state) for d, state in states.items()}
    algo.aggregate(RoundContext(1, 1), global_state, contributions, {d: _extras(4) for d in states})
    assert calls == []  # nothing recomputed
    assert algo.round_metrics(RoundContext(1, 1), {})["distance"] == {"dev-0": 1.0, "dev-1": 9.0}
    # the next round's aggregate does not see this round's cached values
    algo.aggregate(RoundContext(2, 2), global_state, contributions, {d: _extras(4) for d in states})
    assert len(calls) == 2


@pytest.mark.parametrize("patch, field", [
    ({"d": float("nan")}, "d"), ({"d": -1.0}, "d"), ({"d": "x"}, "d"), ({"local_total": -1}, "local_total"),
    ({"train_samples": 0}, "train_samples"), ({"local_correct": True}, "local_correct"),
    ({"local_correct": 2.0}, "local_correct"), ({"surprise": 1}, "surprise"), ({"d": None}, "d"),
])
def test_malformed_upload_extras_are_refused_naming_the_field(patch, field):
    extras = {"d": 0.0, "local_correct": 1, "local_total": 4, "train_samples": 16, **patch}
    with pytest.raises(Invalid, match=rf"^extras: {field}\b"):
        parse_payload(FedBC.UploadExtras, extras, "extras")
    with pytest.raises(Invalid, match="train_samples: Field required"):
        parse_payload(FedBC.UploadExtras, {"d": 0.0, "local_correct": 1, "local_total": 4}, "extras")


def test_more_correct_than_tested_is_refused():
    with pytest.raises(Invalid, match="local_correct=5 exceeds local_total=4"):
        parse_payload(FedBC.UploadExtras, {"d": 0.0, "local_correct": 5, "local_total": 4, "train_samples": 16}, "x")


def test_split_sizes_that_do_not_add_up_to_the_upload_are_refused():
    model = build_model("logreg", 10, (1, 1, 60), seed=0)
    algo = build_algorithm(_config())
    algo.bind_model(model)
    state = model.state_dict()
    algo.accept_update("dev-0", RoundContext(1, 1), state, _extras(16, 1, 4), 20, state)
    with pytest.raises(ValueError, match="train_samples=3 \\+ local_total=4 must equal the shard's num_samples=20"):
        algo.accept_update("dev-0", RoundContext(1, 1), state, _extras(3, 1, 4), 20, state)


def test_missing_or_misshaped_weights_are_refused():
    model = build_model("logreg", 10, (1, 1, 60), seed=0)
    algo = build_algorithm(_config())
    algo.bind_model(model)
    state = dict(model.state_dict())
    extras = _extras(20)
    with pytest.raises(ValueError):
        algo.accept_update("dev-0", RoundContext(1, 1), {"blocks.head.bias": state["blocks.head.bias"]}, extras, 20, state)
    with pytest.raises(ValueError):
        algo.accept_update("dev-0", RoundContext(1, 1), {**state, "blocks.head.bias": torch.zeros(3)}, extras, 20, state)


def test_bad_task_extras_are_refused_on_the_device():
    """The device validates a task's extras against FedBC.TaskExtras (device.py does exactly this)."""
    for extras, message in (({"lambda": -0.1, "gamma": 0.0}, "lambda: Input should be greater than or equal to 0"),
                            ({"lambda": float("inf"), "gamma": 0.0}, "lambda: Input should be a finite number"),
                            ({"gamma": 0.0}, "lambda: Field required"),
                            ({"lambda": 0.1, "gamma": 0.0, "split_seed": True}, "split_seed: Input should be a valid integer")):
        with pytest.raises(Invalid, match=f"^task extras: {message}"):
            _task(**extras)
    # and what the server sends passes, under the same wire keys
    wire = _server(lambda_init=0.25).task_extras("dev-1", RoundContext(1, 1)).to_wire()
    assert set(wire) == {"lambda", "gamma", "split_seed"} and _task(**wire).lam == 0.25


def test_params_validation():
    for bad in ({"dual_lr": -1.0}, {"lambda_max": 0.1, "lambda_min": 0.2}, {"lambda_init": 2.0, "lambda_max": 1.0},
                {"gamma_mode": "sometimes"}, {"local_test_fraction": 1.0}, {"unknown": 1}):
        with pytest.raises(ValueError):
            _config(**bad)


# ----------------------------------------------------------------------------- 8. state and resume
def test_state_round_trips_through_json_and_resumes_identically():
    a = _server(dual_lr=0.1, dual_momentum=0.5)
    _aggregate(a, [1.0, 3.0], [1, 3], round_id=1)
    _aggregate(a, [0.5, 2.0], [1, 3], round_id=2, z=2.8)
    b = _server(dual_lr=0.1, dual_momentum=0.5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.lam == a.lam and b.gamma == a.gamma and b.lam_buf == a.lam_buf
    za, _ = _aggregate(a, [1.5, 2.5], [1, 3], round_id=3, z=1.0)
    zb, _ = _aggregate(b, [1.5, 2.5], [1, 3], round_id=3, z=1.0)
    assert za == zb and a.lam == b.lam and a.gamma == b.gamma
    with pytest.raises(ValueError):
        b.load_state_dict({"lambda": {"dev-0": -1.0}})


def test_local_accuracy_metrics_pooled_mean_and_latest():
    algo = _server(dual_lr=0.1)
    g = {"w": torch.tensor([0.0])}
    contributions = {"a": Contribution(4, {"w": torch.tensor([1.0])}), "b": Contribution(16, {"w": torch.tensor([2.0])})}
    extras = {"a": _extras(3, 1, 1), "b": _extras(12, 2, 4)}
    algo.aggregate(RoundContext(1, 1), g, contributions, extras)
    m = algo.round_metrics(RoundContext(1, 1), extras)
    assert m["local_acc_pooled"] == pytest.approx(3 / 5)
    assert m["local_acc_mean"] == pytest.approx((1.0 + 0.5) / 2)
    algo.aggregate(RoundContext(2, 2), g, {"a": contributions["a"]}, {"a": _extras(3, 0, 1)})
    m = algo.round_metrics(RoundContext(2, 2), {})
    assert m["local_acc_pooled"] == 0.0 and m["local_acc_pooled_latest"] == pytest.approx(2 / 5)
    assert m["min_user"]["device"] == "a"
