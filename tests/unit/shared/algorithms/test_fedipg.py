"""FedIPG: the checks of docs/algorithms/fedipg.md#tests that run in seconds (CPU, float64 where exact)."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, train_round
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext, parse_payload
from shared.algorithms.fedavg import FedAvg
from shared.algorithms.fedipg import (
    FedIPG, FedIPGLogic, FedIPGUploadExtras, fedipg_objective, invariance_statistic, penalty_parameters,
)
from shared.algorithms.registry import ALGORITHMS, build_selector
from shared.config import RunConfig
from shared.run_config import load_run_config
from shared.data import ArrayDataset
from shared.data.device_transforms import DEVICE_TRANSFORMS
from shared.errors import Invalid
from shared.data.domains import (
    color_dataset, color_transform, rotate_dataset, rotate_images, rotation_angle, rotation_transform,
)
from shared.models import build_model

SHAPE = (1, 8, 8)


def _uploaded(model) -> dict[str, torch.Tensor]:
    """A copy of what a device uploads after training (its portion's state_dict)."""
    return {k: v.detach().clone() for k, v in model.portion(0, len(model.blocks)).state_dict().items()}


def _config(**params) -> RunConfig:
    return load_run_config({"algorithm": "fedipg", "data": {"num_devices": 4}, "algorithm_params": params})


def _data(n: int = 40, seed: int = 0, classes: int = 3) -> ArrayDataset:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = 0.5 * torch.randn(n, *SHAPE, generator=gen)
    for c in range(classes):
        x[y == c, :, c, :] += 1.0
    return ArrayDataset(x=x, y=y, num_classes=classes)


# ------------------------------------------------------------------ 1. hand-computed penalty value / gradient
def _linear_penalty(detach_grad: bool = False, detach_w: bool = False):
    W = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64, requires_grad=True)
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0])
    risk = F.cross_entropy(x @ W.T, y)
    (g,) = torch.autograd.grad(risk, [W], create_graph=not detach_grad, retain_graph=True)
    s = (g * (W.detach() if detach_w else W)).sum()
    f = risk + 0.01 * s * s
    f.backward()
    return risk, s, f, W.grad


def test_hand_computed_penalty_and_gradient():
    W = nn.Linear(2, 2, bias=False).double()
    with torch.no_grad():
        W.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    x = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0])
    f, risk, s = fedipg_objective(W, x, y, lam=0.01, scope="all")
    risk, s = risk.detach(), s.detach()
    assert float(risk) == pytest.approx(0.3132617, abs=1e-7)
    assert float(s) == pytest.approx(-0.2689414, abs=1e-7)
    assert float(s * s) == pytest.approx(0.0723295, abs=1e-7)
    assert float(f.detach()) == pytest.approx(0.3139850, abs=1e-7)
    f.backward()
    expected = torch.tensor([[-0.2685524, 0.0], [0.2685524, 0.0]], dtype=torch.float64)
    assert torch.allclose(W.weight.grad, expected, atol=1e-7)
    # The two likely wrong implementations (docs/algorithms/fedipg.md#tests) give different gradients
    # (so the test can tell).
    assert torch.allclose(_linear_penalty(detach_grad=True)[3],
                          torch.tensor([[-0.2674948, 0.0], [0.2674948, 0.0]], dtype=torch.float64), atol=1e-7)
    assert torch.allclose(_linear_penalty(detach_w=True)[3],
                          torch.tensor([[-0.2699989, 0.0], [0.2699989, 0.0]], dtype=torch.float64), atol=1e-7)
    assert torch.allclose(_linear_penalty()[3], expected, atol=1e-7)


def test_gradient_matches_closed_form_eq29():
    # grad f = g + 2 lam s (g + H w), H w by a Hessian-vector product.
    torch.manual_seed(0)
    lin = nn.Linear(3, 4).double()
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 1])
    lam = 0.3
    f, _, _ = fedipg_objective(lin, x, y, lam)
    params = list(lin.parameters())
    grad_f = torch.autograd.grad(f, params)
    risk = F.cross_entropy(lin(x), y)
    g = torch.autograd.grad(risk, params, create_graph=True)
    s = sum((gk * pk).sum() for gk, pk in zip(g, params))
    hw = torch.autograd.grad(sum((gk * pk.detach()).sum() for gk, pk in zip(g, params)), params)
    for gf, gk, hk in zip(grad_f, g, hw):
        assert torch.allclose(gf, gk + 2 * lam * s * (gk + hk), atol=1e-12)


# ------------------------------------------------------------------ 2. radial-derivative identity
def _scaled_risk(model: nn.Module, x, y, factor: float) -> float:
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(factor)
        value = float(F.cross_entropy(model(x), y))
        for p, v in zip(model.parameters(), saved):
            p.copy_(v)
    return value


def test_s_is_the_radial_derivative_of_the_risk():
    model = build_model("cnn", num_classes=3, input_shape=SHAPE, seed=1).double()
    data = _data(12)
    x, y = data.x.double(), data.y
    s = invariance_statistic(F.cross_entropy(model(x), y), list(model.parameters()), create_graph=False)
    h = 1e-6
    fd = (_scaled_risk(model, x, y, 1 + h) - _scaled_risk(model, x, y, 1 - h)) / (2 * h)
    assert float(s.detach()) == pytest.approx(fd, rel=1e-6)


def test_bias_free_relu_mlp_closed_form():
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4, bias=False), nn.ReLU(), nn.Linear(4, 2, bias=False)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])
    z = net(x)
    s = invariance_statistic(F.cross_entropy(z, y), list(net.parameters()), create_graph=False).detach()
    z = z.detach()
    closed = 2 * ((torch.softmax(z, 1) - F.one_hot(y, 2).double()) * z).sum(1).mean()
    assert float(s) == pytest.approx(float(closed), abs=1e-9)


# ------------------------------------------------------------------ 3. IRMv1 equivalence (head scope)
def test_head_scope_equals_irmv1_dummy_classifier_gradient():
    model = build_model("cnn", num_classes=3, input_shape=SHAPE, seed=2).double()
    data = _data(10)
    x, y = data.x.double(), data.y
    head = penalty_parameters(model, "head", model.output_layer)
    assert len(head) == 2  # weight and bias of blocks.head
    s = invariance_statistic(F.cross_entropy(model(x), y), head, create_graph=False)
    c = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    (dc,) = torch.autograd.grad(F.cross_entropy(c * model(x), y), [c])
    assert float(s.detach()) == pytest.approx(float(dc), abs=1e-10)
    with pytest.raises(ValueError):
        penalty_parameters(model, "head", "")


# ------------------------------------------------------------------ 4. gradcheck with BatchNorm (double backward)
def test_gradcheck_through_batchnorm_cnn():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 3 * 3, 2)).double()
    net.train()
    x, y = torch.randn(4, 1, 5, 5, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    names = [n for n, _ in net.named_parameters()]

    def f(*flat):
        params = dict(zip(names, flat))
        risk = F.cross_entropy(torch.func.functional_call(net, params, (x,)), y)
        return risk + 0.5 * invariance_statistic(risk, flat, create_graph=True) ** 2

    inputs = tuple(p.detach().clone().requires_grad_(True) for p in net.parameters())
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-5)


# ------------------------------------------------------------------ 5. lambda = 0 is FedAvg
def test_lambda_zero_gives_fedavg_models_bit_identically():
    config = _config(lam=0.0)
    fedipg, fedavg = FedIPG(config), FedAvg(config.model_copy(update={"algorithm": "fedavg", "algorithm_params": {}}))
    model_a = build_model("cnn", num_classes=3, input_shape=SHAPE, seed=0)
    model_b = build_model("cnn", num_classes=3, input_shape=SHAPE, seed=0)
    fedipg.bind_model(model_a)
    fedavg.bind_model(model_b)
    shards = [_data(24, seed=s) for s in range(3)]
    for round_id in range(1, 4):
        results = {}
        for label, algo, model in (("fedipg", fedipg, model_a), ("fedavg", fedavg, model_b)):
            start = {k: v.clone() for k, v in model.state_dict().items()}
            contribs, extras = {}, {}
            for i, shard in enumerate(shards):
                logic = type(algo).device_logic(algo.device_params())
                train_round(model, len(model.blocks), start, shard,
                            TrainSettings(0.1, 0.9, 0.0, 8, 1, 100 * round_id + i), TrainContext(RoundClock(None), logic=logic))
                contribs[f"dev-{i:03d}"] = Contribution(weight=len(shard), client_state=_uploaded(model))
                extras[f"dev-{i:03d}"] = logic.upload_extras(model, shard)
            new = algo.aggregate(RoundContext(round_id, round_id), start, contribs, extras)
            model.load_state_dict(new)
            results[label] = new
        for k in results["fedavg"]:
            assert torch.equal(results["fedavg"][k], results["fedipg"][k]), k


def test_positive_lambda_changes_the_update_and_trains_the_cnn():
    model = build_model("cnn", num_classes=3, input_shape=SHAPE, seed=0)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    shard = _data(24)
    out = {}
    for lam in (0.0, 0.5):
        logic = FedIPGLogic({"lam": lam, "penalty_scope": "all", "output_layer": model.output_layer})
        train_round(model, len(model.blocks), start, shard, TrainSettings(0.1, 0.0, 0.0, 8, 1, 7),
                    TrainContext(RoundClock(None), logic=logic))
        out[lam] = (_uploaded(model), logic.upload_extras(model, shard).to_wire())
    assert any(not torch.equal(out[0.0][0][k], out[0.5][0][k]) for k in start)
    extras = out[0.5][1]
    assert set(extras) == {"risk", "penalty_s2", "penalty_abs_s"}  # 8. a few floats, no extra tensors
    assert all(math.isfinite(v) and v >= 0 for v in extras.values())
    assert set(out[0.0][1]) == {"risk"}  # the wire keys: no penalty pair (not even as null) when lam = 0


@pytest.mark.parametrize("bad, message", [
    ({"risk": float("nan"), "penalty_s2": 0.0, "penalty_abs_s": 0.0}, "risk: Input should be a finite number"),
    ({"risk": 0.1, "penalty_s2": -1.0, "penalty_abs_s": 0.0}, "penalty_s2: Input should be greater than or equal to 0"),
    ({"risk": 0.1, "penalty_s2": 0.0}, "penalty_s2 and penalty_abs_s are sent together"),
    ({"risk": 0.1, "penalty_s2": 0.0, "penalty_abs_s": 0.0, "x": 1}, "x: Extra inputs are not permitted"),
    ({"penalty_s2": 0.0, "penalty_abs_s": 0.0}, "risk: Field required"),
    ({"risk": "0.1"}, "risk: Input should be a valid number"),
])
def test_malformed_upload_extras_are_refused_naming_the_field(bad, message):
    with pytest.raises(Invalid, match=f"^extras: .*{message}"):
        parse_payload(FedIPG.UploadExtras, bad, "extras")


# ------------------------------------------------------------------ 6. exit strategy
def test_excluded_devices_are_never_selected_nor_aggregated():
    algo = FedIPG(_config(exit_policy="static", excluded=["dev-001"]))
    devices = [f"dev-{i:03d}" for i in range(4)]
    assert algo.eligible(devices) == ["dev-000", "dev-002", "dev-003"]
    rng = random.Random(0)
    for r in range(1, 30):
        picked = build_selector(algo.config).select(RoundContext(r, r), algo.eligible(devices), 4, rng)
        assert "dev-001" not in picked and len(picked) == 3
    g = {"w": torch.zeros(2)}
    ok = FedIPGUploadExtras(risk=0.1, penalty_s2=0.0, penalty_abs_s=0.0)
    with pytest.raises(ValueError, match="exited"):
        algo.accept_update("dev-001", RoundContext(1, 1), g, ok, 10, g)
    algo.accept_update("dev-000", RoundContext(1, 1), g, ok, 10, g)
    with pytest.raises(ValueError, match="exactly when lam > 0"):  # lam = 1e-3 here: the pair is due
        algo.accept_update("dev-000", RoundContext(1, 1), g, FedIPGUploadExtras(risk=0.1), 10, g)
    contributions = {"dev-000": Contribution(10, {"w": torch.tensor([1.0, 1.0])}),
                     "dev-001": Contribution(50, {"w": torch.tensor([100.0, 100.0])}),
                     "dev-002": Contribution(30, {"w": torch.tensor([3.0, 5.0])})}
    new = algo.aggregate(RoundContext(1, 1), g, contributions, {})
    assert torch.allclose(new["w"], torch.tensor([(10 * 1 + 30 * 3) / 40, (10 * 1 + 30 * 5) / 40]))
    assert algo.last_weights == {"dev-000": 0.25, "dev-002": 0.75}
    algo_u = FedIPG(_config(exit_policy="static", excluded=["dev-001"], weighting="uniform"))
    assert torch.allclose(algo_u.aggregate(RoundContext(1, 1), g, contributions, {})["w"], torch.tensor([2.0, 3.0]))
    metrics = algo.round_metrics(RoundContext(1, 1),
                                 {"dev-000": FedIPGUploadExtras(risk=0.2, penalty_s2=0.1, penalty_abs_s=0.3)})
    assert metrics["exited"] == ["dev-001"] and metrics["risk"] == pytest.approx(0.2)
    # Exit state goes into the (JSON-able) checkpoint and comes back.
    state = json.loads(json.dumps(algo.state_dict()))
    assert state["exited"] == {"dev-001": {"round": 0, "reason": "static"}}
    fresh = FedIPG(_config(exit_policy="static", excluded=["dev-001"]))
    fresh.load_state_dict(state)
    assert fresh.exited == algo.exited
    # The device never learns the exit list: only what its objective needs travels in tasks.
    assert set(algo.device_params()) == {"lam", "penalty_scope", "output_layer"}


def test_exit_configuration_is_validated():
    with pytest.raises(ValueError):
        _config(exit_policy="none", excluded=["dev-000"])
    with pytest.raises(ValueError):
        _config(exit_policy="static")
    with pytest.raises(ValueError):
        _config(exit_policy="static", excluded=["dev-000", "dev-000"])
    with pytest.raises(ValueError):
        _config(lam=-1.0)
    with pytest.raises(ValueError):
        FedIPG(_config(exit_policy="static", excluded=[f"dev-{i:03d}" for i in range(4)]))
    with pytest.raises(ValueError):
        FedIPG(_config(ood_color_env=3))  # colour needs data.transform=rgb32
    assert "fedipg" in ALGORITHMS


def test_contribution_exit_extension_removes_a_device_pulling_against_the_others():
    algo = FedIPG(_config(exit_policy="contribution", exit_warmup_rounds=1, exit_patience=2))
    algo.bind_model(nn.Linear(2, 1, bias=False))
    devices = [f"dev-{i:03d}" for i in range(4)]
    algo.eligible(devices)
    g = {"weight": torch.zeros(1, 2)}
    for r in range(1, 4):
        contributions = {d: Contribution(10, {"weight": torch.tensor([[-1.0, -1.0]])}) for d in devices[:3]}
        contributions["dev-003"] = Contribution(10, {"weight": torch.tensor([[2.0, 2.0]])})
        algo.aggregate(RoundContext(r, r), g, contributions, {})
        if r < 3:
            assert "dev-003" not in algo.exited
    assert algo.exited["dev-003"] == {"round": 3, "reason": "contribution"}
    assert algo.last_contribution["dev-000"] > 0 > algo.last_contribution["dev-003"]
    assert "dev-003" not in algo.eligible(devices)


# ------------------------------------------------------------------ data: rotated / coloured domains
def test_rotations_are_deterministic_and_correct():
    x = torch.randn(3, 1, 28, 28)
    assert torch.equal(rotate_images(x, 30), rotate_images(x, 30))
    assert torch.equal(rotate_images(x, 0), x) and torch.equal(rotate_images(x, 360), x)
    assert torch.allclose(rotate_images(x, 90), torch.rot90(x, 1, (2, 3)), atol=1e-5)
    assert torch.allclose(rotate_images(x, 180), torch.rot90(x, 2, (2, 3)), atol=1e-5)
    rotated = rotate_images(x, 45)
    assert not torch.allclose(rotated, x) and rotated.shape == x.shape and torch.isfinite(rotated).all()


def test_rotation_device_transform_uses_one_angle_per_device():
    shard = _data(6)
    params = {"angles": [0, 15, 30]}
    assert [rotation_angle(i, params) for i in range(5)] == [0, 15, 30, 0, 15]
    assert DEVICE_TRANSFORMS["rotation"] is rotation_transform and DEVICE_TRANSFORMS["color"] is color_transform
    out = rotation_transform(shard, 4, 6, params, seed=0)
    assert torch.equal(out.x, rotate_dataset(shard, 15).x) and torch.equal(out.y, shard.y)
    assert torch.equal(rotation_transform(shard, 0, 6, params, 0).x, shard.x)
    with pytest.raises(ValueError):
        rotation_transform(shard, 0, 6, {"angle": [1]}, 0)
    with pytest.raises(ValueError):
        rotation_transform(shard, 0, 6, {"angles": []}, 0)


def test_color_transform_correlates_colour_with_label():
    n = 2000
    y = torch.arange(n) % 10
    grey = torch.full((n, 3, 32, 32), -0.4242)
    grey[:, :, 10:20, 14:18] = 2.8  # a bright "stroke"
    ds = ArrayDataset(x=grey, y=y, num_classes=10)
    out = color_dataset(ds, env=2, strength=0.8, region="foreground", seed=0)
    assert out.x.shape == (n, 3, 32, 32)
    assert torch.equal(out.x, color_dataset(ds, 2, 0.8, "foreground", 0).x)  # deterministic
    from shared.data.datasets import MNIST_MEAN, MNIST_STD
    from shared.data.domains import PALETTE
    stroke = out.x[:, :, 15, 15] * MNIST_STD + MNIST_MEAN
    k = torch.cdist(stroke, PALETTE).argmin(1)
    agree = float(((y + 2) % 10 == k).float().mean())
    assert 0.8 < agree < 0.86  # 0.8 + 0.2/10 expected
    assert torch.allclose(out.x[:, :, 0, 0], torch.full((n, 3), -MNIST_MEAN / MNIST_STD), atol=1e-4)  # black bg
    with pytest.raises(ValueError, match="rgb32"):
        color_transform(_data(4), 0, 4, {}, 0)  # 1-channel data would not fit the model
    dev = color_transform(ds.subset(list(range(20))), 1, 4, {"envs": [0, 5], "strengths": [1.0]}, 0)
    dk = torch.cdist(dev.x[:, :, 15, 15] * MNIST_STD + MNIST_MEAN, PALETTE).argmin(1)
    assert torch.equal(dk, (dev.y + 5) % 10)


def test_evaluate_reports_id_and_ood_accuracy():
    config = load_run_config({
        "algorithm": "fedipg", "data": {"num_devices": 3, "device_transform": "rotation",
                                        "device_transform_params": {"angles": [0, 30]}},
        "algorithm_params": {"ood_angle": 90}})
    algo = FedIPG(config)
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    algo.bind_model(model)
    out = algo.evaluate(model)
    assert set(out["domain_accuracy"]) == {"rot0", "rot30", "ood:rot90"}
    assert out["id_accuracy"] == pytest.approx((out["domain_accuracy"]["rot0"] + out["domain_accuracy"]["rot30"]) / 2)
    assert out["ood_accuracy"] == out["domain_accuracy"]["ood:rot90"]
    json.dumps(out)
