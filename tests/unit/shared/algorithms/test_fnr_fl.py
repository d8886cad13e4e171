"""FNR-FL (the checks listed in docs/algorithms/fnr-fl.md#tests): hand-computed values, special cases, validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, train_round
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import DeviceLogic, RoundContext, parse_payload
from shared.algorithms.fnr_fl import (
    FNRFL, FNRFLFollowUp, FNRFLLogic, FNRFLReport, FNRFLUploadExtras, class_average_feature_norms, feature_norm_differences, penalty_term, public_set,
    refine_on_public, reference_norms, select_for_refinement,
)
from shared.algorithms.registry import ALGORITHMS, build_algorithm
from shared.config import RunConfig
from shared.run_config import load_run_config
from shared.data import ArrayDataset, DataSpec, device_shard, load_dataset, load_public_set
from shared.data.device_transforms import DEVICE_TRANSFORMS
from shared.data.feature_skew import device_noise_std, gaussian_noise
from shared.errors import Invalid
from shared.models import SplitModel, build_model

DATA = {"num_devices": 4, "partition": "iid", "seed": 1, "max_samples": 400, "public_samples": 70}


def _config(**params) -> RunConfig:
    return load_run_config({"algorithm": "fnr-fl", "model": "cnn", "data": DATA,
                                     "train": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 32},
                                     "algorithm_params": params})


def _report(wire: dict) -> FNRFLReport:
    """A report as the Fed Server stores it: the wire map, validated."""
    return parse_payload(FNRFLReport, wire, "report")


def _algorithm(model: str = "cnn", **params) -> FNRFL:
    algo = build_algorithm(_config(**params))
    assert isinstance(algo, FNRFL)
    algo.bind_model(build_model(model, 10, (1, 28, 28)))
    return algo


def _toy_model() -> SplitModel:
    """Features = the 2-d input itself; head = BatchNorm1d + Linear (BN to check eval mode)."""
    head = nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 3))
    with torch.no_grad():
        head[0].running_mean.fill_(0.5)
        head[0].running_var.fill_(2.0)
        head[1].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]))
        head[1].bias.zero_()
    return SplitModel({"feat": nn.Flatten(), "head": head}, (1,), "feat", "blocks.head.1", (1, 1, 2), 3)


def _toy_public() -> ArrayDataset:
    x = torch.tensor([[3.0, 4.0], [6.0, 8.0], [1.0, 0.0]])
    return ArrayDataset(x=x, y=torch.tensor([0, 0, 1]), num_classes=3)


# --- 1. Algorithm 1 --------------------------------------------------------------------------------

def _ce_finetune(model, data, lr: float, weight_decay: float, batch: int, epochs: int = 2) -> None:
    """Plain cross-entropy fine-tuning written out: fixed batch order, fresh SGD with momentum 0.9."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    for _ in range(epochs):
        for s in range(0, len(data), batch):
            loss = F.cross_entropy(model(data.x[s:s + batch]), data.y[s:s + batch])
            opt.zero_grad()
            loss.backward()
            opt.step()

def test_class_average_feature_norms_hand_example_eval_mode_no_side_effects():
    model = _toy_model()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    norms, accuracy = class_average_feature_norms(model, _toy_public(), "feat", batch_size=2)
    assert norms == {0: 7.5, 1: 1.0}  # (5 + 10) / 2 and 1; class 2 absent -> no key
    assert 2 not in norms
    with torch.no_grad():
        model.eval()
        expected = (model(_toy_public().x).argmax(1) == _toy_public().y).float().mean().item()
        model.train()
    assert accuracy == pytest.approx(expected)
    assert model.training  # mode restored
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # BN running stats untouched
    assert all(p.grad is None for p in model.parameters())


def test_feature_norms_on_whole_model_portion_equal_split_model():
    model = build_model("resnet8", 10, (1, 28, 28), seed=3)
    data = ArrayDataset(x=torch.randn(20, 1, 28, 28), y=torch.arange(20) % 4, num_classes=10)
    full = class_average_feature_norms(model, data, model.feature_block, 8)
    portion = class_average_feature_norms(model.portion(0, len(model.blocks)), data, model.feature_block, 8)
    assert full == portion
    assert sorted(full[0]) == [0, 1, 2, 3]
    with torch.no_grad():
        model.eval()
        u = model.features(data.x).norm(dim=1)
    assert full[0][2] == pytest.approx(float(u[data.y == 2].mean()), rel=1e-6)


# --- 2. selection and Algorithm 2 ----------------------------------------------------------------
NORMS = {"1": {0: 2.0, 1: 3.0}, "2": {0: 4.0, 1: 1.0}, "3": {0: 5.0, 1: 5.0}, "4": {0: 3.0, 1: 2.0}}
ACC = {"1": 0.5, "2": 0.9, "3": 0.7, "4": 0.6}


def test_selection_and_feature_norm_differences_hand_table():
    selected = select_for_refinement(ACC, 0.5)
    assert selected == ["1", "4"]
    ids = sorted(NORMS)
    assert feature_norm_differences("1", ids, selected, NORMS) == {0: 5.0, 1: 0.0}
    assert feature_norm_differences("4", ids, selected, NORMS) == {0: 3.0, 1: 2.0}
    assert feature_norm_differences("1", ids, selected, NORMS, "all_others") == {0: 6.0, 1: -1.0}
    assert reference_norms("1", ids, selected, NORMS) == {0: 4.5, 1: 3.0}


def test_plan_follow_ups_through_the_wire_format():
    algo = _algorithm(p=0.5)
    reports = {f"dev-{d}": _report({"public_accuracy": ACC[d], "feature_norms": {str(k): v for k, v in NORMS[d].items()},
                                    "num_samples": 10}) for d in NORMS}
    plan = {d: f.to_wire() for d, f in algo.plan_follow_ups(RoundContext(1, 1), reports).items()}
    assert plan["dev-1"] == {"refine": True, "delta": {"0": 5.0, "1": 0.0}}
    assert plan["dev-4"] == {"refine": True, "delta": {"0": 3.0, "1": 2.0}}
    assert plan["dev-2"] == {"refine": False} and plan["dev-3"] == {"refine": False}
    # what the device makes of them
    assert parse_payload(FNRFLFollowUp, plan["dev-1"], "follow-up").delta == {0: 5.0, 1: 0.0}
    metrics = algo.round_metrics(RoundContext(1, 1), {
        "dev-1": FNRFLUploadExtras(refined=True, refine_steps=3, refine_ce=1.0, refine_penalty=3.75, refine_loss=2.875),
        "dev-2": FNRFLUploadExtras(refined=False)})
    assert metrics["refine_selected"] == ["dev-1", "dev-4"] and metrics["refined"] == ["dev-1"]
    assert metrics["leaky"] is False and metrics["public_set"] == "holdout"
    assert metrics["delta"]["dev-4"] == {"0": 3.0, "1": 2.0}
    assert metrics["public_accuracy"]["dev-2"] == 0.9
    assert metrics["refine_stats"] == {"dev-1": {"refine_steps": 3, "refine_ce": 1.0, "refine_penalty": 3.75,
                                                 "refine_loss": 2.875}}


def test_ties_by_natural_device_id_and_n_re_rounding():
    acc = {"dev-10": 0.5, "dev-2": 0.5, "dev-3": 0.4, "dev-1": 0.9}
    assert select_for_refinement(acc, 0.5) == ["dev-3", "dev-2"]
    assert len(select_for_refinement({f"d{i}": 0.1 * i for i in range(10)}, 0.5)) == 5
    assert select_for_refinement({"a": 0.3, "b": 0.2, "c": 0.1}, 0.5) == ["c"]
    assert select_for_refinement(acc, 0.0) == []
    assert select_for_refinement(acc, 1.0) == ["dev-3", "dev-2", "dev-10", "dev-1"]


def test_p_one_refines_everyone_with_empty_delta_and_zero_penalty():
    algo = _algorithm(p=1.0)
    reports = {f"dev-{d}": _report({"public_accuracy": ACC[d], "feature_norms": {str(k): v for k, v in NORMS[d].items()},
                                    "num_samples": 10}) for d in NORMS}
    plan = algo.plan_follow_ups(RoundContext(1, 1), reports)
    assert all(i.to_wire() == {"refine": True, "delta": {}} for i in plan.values())
    assert penalty_term(torch.tensor([0, 1, 1]), {}) == 0.0


# --- 3. regularisation term ----------------------------------------------------------------------
def test_penalty_term_hand_example():
    labels = torch.tensor([0, 0, 0, 1])
    assert penalty_term(labels, {0: 5.0, 1: 0.0}) == pytest.approx(3.75)
    assert penalty_term(labels, {0: 5.0}) == pytest.approx(3.75)  # absent label adds 0
    assert penalty_term(torch.tensor([2, 2]), {0: 5.0}) == 0.0
    # Phi = CE + lambda * J with lambda = 0.5
    model = _toy_model()
    public = ArrayDataset(x=torch.randn(4, 2), y=labels, num_classes=3)
    stats = refine_on_public(model, public, {0: 5.0, 1: 0.0}, lam=0.5, epochs=1, batch_size=4, lr=0.0, momentum=0.0,
                             weight_decay=0.0, feature_block="feat")
    assert stats["penalty"] == pytest.approx(3.75)
    assert stats["loss"] == pytest.approx(stats["ce"] + 1.875)


# --- 4. literal mode has no gradient; the differentiable opt-in does -----------------------------
def _refine(model, public, lam, **kw):
    return refine_on_public(model, public, {0: 5.0, 1: -2.0}, lam=lam, epochs=2, batch_size=4, lr=0.1,
                            momentum=0.9, weight_decay=1e-4, feature_block=model.feature_block, **kw)


def test_paper_penalty_is_exactly_cross_entropy_fine_tuning():
    gen = torch.Generator().manual_seed(0)
    public = ArrayDataset(x=torch.randn(10, 1, 28, 28, generator=gen), y=torch.tensor([0, 1] * 5), num_classes=10)
    models = [build_model("resnet8", 10, (1, 28, 28), seed=5) for _ in range(3)]
    _refine(models[0], public, 0.5)
    _refine(models[1], public, 0.0)
    # Plain CE fine-tuning, written out: same order, same fresh SGD.
    models[2].train()
    _ce_finetune(models[2], public, lr=0.1, weight_decay=1e-4, batch=4)
    states = [mm.state_dict() for mm in models]
    for key in states[0]:
        assert torch.equal(states[0][key], states[1][key]), key
        assert torch.equal(states[0][key], states[2][key]), key


def test_differentiable_penalty_has_gradient_and_is_zero_at_reference():
    from shared.algorithms.fnr_fl import _differentiable_penalty

    feats = torch.tensor([[3.0, 4.0], [6.0, 8.0], [1.0, 0.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 1])
    zero = _differentiable_penalty(feats, labels, {0: 7.5, 1: 1.0})
    assert float(zero.detach()) == 0.0
    j = _differentiable_penalty(feats, labels, {0: 8.5, 1: 1.0})
    assert float(j.detach()) == pytest.approx(2 / 3 * 1.0)  # rho_0 = 2/3, (8.5 - 7.5)^2 = 1
    j.backward()
    assert feats.grad is not None and feats.grad.abs().sum() > 0
    # Through a model: the feature extractor moves differently than with plain CE.
    gen = torch.Generator().manual_seed(1)
    public = ArrayDataset(x=torch.randn(8, 1, 28, 28, generator=gen), y=torch.tensor([0, 1] * 4), num_classes=10)
    a, b = build_model("cnn", 10, (1, 28, 28), seed=2), build_model("cnn", 10, (1, 28, 28), seed=2)
    _refine(a, public, 0.5, penalty="differentiable", reference={0: 100.0, 1: 100.0})
    _refine(b, public, 0.5)
    assert not torch.equal(a.state_dict()["blocks.conv1.0.weight"], b.state_dict()["blocks.conv1.0.weight"])


# --- 5./6. p = 0 is FedAvg bit for bit; refinement from w_j over D_pub ---------------------------
def _local_round(logic: DeviceLogic, spec: DataSpec, model_name: str = "resnet8"):
    train, _ = load_dataset(spec)
    shard = device_shard(spec, train, 1)
    model = build_model(model_name, 10, (1, 28, 28), seed=0)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    train_round(model, len(model.blocks), weights, shard, TrainSettings(0.05, 0.9, 0.0, 32, 1, 7),
                TrainContext(RoundClock(None), logic=logic))
    return model, shard


def test_p_zero_round_is_fedavg_bit_for_bit():
    algo = _algorithm("resnet8", p=0.0)
    spec = algo.config.data
    logic = ALGORITHMS["fnr-fl"].device_logic(algo.device_params())
    model, shard = _local_round(logic, spec)
    portion = model.portion(0, len(model.blocks))
    report = logic.report(portion, shard)
    instruction = algo.plan_follow_ups(RoundContext(1, 1), {"dev-001": report})["dev-001"]
    assert instruction.to_wire() == {"refine": False}
    logic.follow_up(portion, shard, instruction)
    assert logic.upload_extras(portion, shard).to_wire() == {"refined": False}
    fedavg_model, _ = _local_round(DeviceLogic({}), spec)
    a, b = portion.state_dict(), fedavg_model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)  # incl. BN running stats
    # Report size: K class norms + accuracy + sample count (docs/algorithms/fnr-fl.md#report-size).
    wire = report.to_wire()
    assert set(wire) == {"public_accuracy", "feature_norms", "num_samples"} and len(wire["feature_norms"]) <= 10
    assert _report(wire) == report  # and it survives the trip


def test_refinement_continues_from_local_model_over_public_set():
    algo = _algorithm(p=1.0, refine_epochs=2, lam=0.5)
    params = algo.device_params()
    logic = FNRFLLogic(params)
    model, shard = _local_round(logic, algo.config.data, "cnn")
    portion = model.portion(0, len(model.blocks))
    local = {k: v.clone() for k, v in portion.state_dict().items()}
    instruction = algo.plan_follow_ups(RoundContext(1, 1), {"dev-001": logic.report(portion, shard)})["dev-001"]
    assert instruction.refine is True
    logic.follow_up(portion, shard, instruction)
    extras = logic.upload_extras(portion, shard)
    public = public_set(algo.config.data)
    assert len(public) == 70
    assert np.array_equal(public.label_counts(), load_public_set(algo.config.data).label_counts())
    assert extras.refined is True and extras.refine_steps == 2 * math.ceil(70 / 32)
    # The same refinement written out from w_j (the local model) on D_pub gives the same weights.
    ref = build_model("cnn", 10, (1, 28, 28))
    ref.load_state_dict(local)
    _ce_finetune(ref, public, lr=0.05, weight_decay=1e-5, batch=32)
    assert all(torch.equal(ref.state_dict()[k], portion.state_dict()[k]) for k in local)
    algo.accept_update("dev-001", RoundContext(1, 1), portion.state_dict(), extras, len(shard), {})
    # A retried attempt (new attempt id) of the same logical round finds the same plan.
    algo.accept_update("dev-001", RoundContext(1, 2), portion.state_dict(), extras, len(shard), {})


# --- 7. aggregation ------------------------------------------------------------------------------
def test_aggregation_is_data_size_weighted_over_all_uploads():
    algo = _algorithm()
    g = {"w": torch.zeros(2), "n": torch.tensor(0)}
    contributions = {"a": Contribution(1, {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(2)}),
                     "b": Contribution(3, {"w": torch.tensor([5.0, -2.0]), "n": torch.tensor(6)})}
    refined = FNRFLUploadExtras(refined=True, refine_steps=1, refine_ce=0.0, refine_penalty=0.0, refine_loss=0.0)
    out = algo.aggregate(RoundContext(1, 1), g, contributions, {"a": refined, "b": FNRFLUploadExtras(refined=False)})
    assert torch.equal(out["w"], torch.tensor([4.0, -1.0]))
    assert int(out["n"]) == 5


# --- validation, leak flag, config ---------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ({"public_accuracy": float("nan")}, "public_accuracy: Input should be a finite number"),
    ({"public_accuracy": 1.5}, "public_accuracy: Input should be less than or equal to 1"),
    ({"feature_norms": {"0": -1.0}}, "feature_norms.0: Input should be greater than or equal to 0"),
    ({"feature_norms": {"03": 1.0}}, r"feature_norms.03.\[key\]: Input should be a valid integer"),
    ({"feature_norms": {}}, "feature_norms: Dictionary should have at least 1 item"),
    ({"num_samples": True}, "num_samples: Input should be a valid integer"),
    ({"extra": 1}, "extra: Extra inputs are not permitted"),
])
def test_malformed_reports_are_refused_naming_the_field(bad, message):
    with pytest.raises(Invalid, match=f"^report: {message}"):
        _report({"public_accuracy": 0.5, "feature_norms": {"0": 1.0}, "num_samples": 10, **bad})


@pytest.mark.parametrize("bad, message", [
    ({"refined": "yes"}, "refined: Input should be a valid boolean"),
    ({"refined": True, "refine_steps": 1, "refine_ce": float("inf"), "refine_penalty": 0.0, "refine_loss": 0.0},
     "refine_ce: Input should be a finite number"),
    ({"refined": True, "refine_steps": 1}, "a refined upload needs refine_steps, refine_ce"),
    ({"refined": False, "refine_steps": 1}, "refine_\\* diagnostics are only sent with refined=true"),
    ({}, "refined: Field required"),
])
def test_malformed_upload_extras_are_refused_naming_the_field(bad, message):
    with pytest.raises(Invalid, match=f"^extras: .*{message}"):
        parse_payload(FNRFL.UploadExtras, bad, "extras")


def test_malformed_follow_ups_are_refused_on_the_device():
    with pytest.raises(Invalid, match="^follow-up: delta.x.\\[key\\]: Input should be a valid integer"):
        parse_payload(FNRFL.FollowUp, {"refine": True, "delta": {"x": 1.0}}, "follow-up")
    with pytest.raises(Invalid, match="^follow-up: reference_norms.2: Input should be greater than or equal to 0"):
        parse_payload(FNRFL.FollowUp, {"refine": True, "delta": {}, "reference_norms": {"2": -3.0}}, "follow-up")
    # a class the device's model does not have: refused by the logic, which knows num_classes
    algo = _algorithm(p=1.0)
    logic = FNRFLLogic(algo.device_params())
    with pytest.raises(ValueError, match=r"delta: class keys \[12\] are not class ids in \[0, 10\)"):
        logic.follow_up(build_model("cnn", 10, (1, 28, 28)), None, FNRFLFollowUp(refine=True, delta={12: 1.0}))


def test_reports_naming_unknown_classes_are_excluded_and_their_uploads_refused():
    algo = _algorithm(p=0.5)
    good = {"public_accuracy": 0.5, "feature_norms": {"0": 1.0}, "num_samples": 10}
    reports = {"dev-2": _report({**good, "feature_norms": {"12": 1.0}}),
               "dev-5": _report(good), "dev-6": _report({**good, "public_accuracy": 0.9})}
    plan = algo.plan_follow_ups(RoundContext(3, 3), reports)
    assert plan["dev-2"].refine is False and "[12]" in plan["dev-2"].excluded
    with pytest.raises(ValueError, match="rejected"):
        algo.accept_update("dev-2", RoundContext(3, 3), {}, FNRFLUploadExtras(refined=False), 10, {})
    assert plan["dev-5"].to_wire() == {"refine": True, "delta": {"0": 0.0}}
    assert plan["dev-6"].to_wire() == {"refine": False}
    with pytest.raises(ValueError, match="asked to refine"):
        algo.accept_update("dev-5", RoundContext(3, 3), {}, FNRFLUploadExtras(refined=False), 10, {})
    with pytest.raises(ValueError, match="round 4"):
        algo.accept_update("dev-6", RoundContext(4, 4), {}, FNRFLUploadExtras(refined=False), 10, {})
    algo.accept_update("dev-6", RoundContext(3, 3), {}, FNRFLUploadExtras(refined=False), 10, {})
    assert set(algo.round_metrics(RoundContext(3, 3), {})["invalid_reports"]) == {"dev-2"}


def test_config_checks_and_leaky_mode():
    with pytest.raises(ValueError, match="public_samples"):
        build_algorithm(load_run_config({"algorithm": "fnr-fl", "data": {"public_samples": 0}}))
    with pytest.raises(ValueError):
        load_run_config({"algorithm": "fnr-fl", "algorithm_params": {"p": 1.5}})
    with pytest.raises(ValueError):
        load_run_config({"algorithm": "fnr-fl", "algorithm_params": {"lam": float("nan")}})
    leaky = build_algorithm(load_run_config({"algorithm": "fnr-fl", "data": {"public_samples": 0},
                                                       "algorithm_params": {"public_set": "test_set_leaky"}}))
    leaky.bind_model(build_model("cnn", 10, (1, 28, 28)))
    assert leaky.round_metrics(RoundContext(1, 1), {})["leaky"] is True
    spec = DataSpec.model_validate(leaky.device_params()["data"])
    leaky_public, test = public_set(spec, "test_set_leaky"), load_dataset(spec)[1]
    assert torch.equal(leaky_public.y.sort().values, test.y.sort().values) and len(leaky_public) == len(test)


def test_public_set_order_is_seeded_and_mixes_classes():
    # Stored index order groups the embedded MNIST by class; one-class refinement batches would
    # wreck the fine-tuning, so D_pub gets one seeded random order, the same in every process.
    spec = DataSpec.model_validate({**DATA, "public_samples": 200})
    a = public_set(spec)
    fnr_cache = public_set.__globals__["_public_set_cached"]
    fnr_cache.cache_clear()
    b = public_set(spec)
    assert a is not b and torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert all(len(torch.unique(a.y[s:s + 32])) >= 5 for s in range(0, 200, 32))
    assert not torch.equal(a.y, public_set(spec.model_copy(update={"seed": 2})).y)


def test_public_set_is_disjoint_from_shards_and_evaluation_set():
    spec = DataSpec.model_validate(DATA)
    public = load_public_set(spec)
    train, test = load_dataset(spec)

    def rows(ds: ArrayDataset) -> set[bytes]:
        return {r.numpy().tobytes() for r in ds.x.reshape(len(ds), -1)}

    pub = rows(public)
    assert not pub & rows(test)
    for i in range(spec.num_devices):
        assert not pub & rows(device_shard(spec, train, i))


# --- 9. feature-skew noise transform -------------------------------------------------------------
def test_gaussian_noise_std_grows_with_device_index_and_is_deterministic():
    assert "gaussian_noise" in DEVICE_TRANSFORMS
    assert [device_noise_std(0.5, i, 5) for i in range(5)] == [0.0, 0.125, 0.25, 0.375, 0.5]
    assert device_noise_std(0.5, 0, 1) == 0.0
    shard = ArrayDataset(x=torch.zeros(400, 3, 8, 8), y=torch.zeros(400, dtype=torch.long), num_classes=10)
    assert gaussian_noise(shard, 0, 5, {"sigma": 0.5}, 0) is shard  # device 0 clean
    last = gaussian_noise(shard, 4, 5, {"sigma": 0.5}, 0)
    assert torch.equal(last.x, gaussian_noise(shard, 4, 5, {"sigma": 0.5}, 0).x)  # deterministic
    assert not torch.equal(last.x, gaussian_noise(shard, 4, 5, {"sigma": 0.5}, 1).x)  # seed matters
    assert not torch.equal(last.x, gaussian_noise(shard, 3, 5, {"sigma": 0.5 * 4 / 3}, 0).x)  # device matters
    assert torch.equal(shard.x, torch.zeros_like(shard.x)) and torch.equal(last.y, shard.y)  # input untouched
    assert float(last.x.std()) == pytest.approx(0.5, rel=0.02)
    mid = gaussian_noise(shard, 2, 5, {"sigma": 0.5}, 0)
    assert float(mid.x.std()) == pytest.approx(0.25, rel=0.02)
    # pixel units: noise on channel c has std sigma_i / pixel_std[c]
    pix = gaussian_noise(shard, 4, 5, {"sigma": 0.5, "pixel_std": [0.25, 0.5, 1.0]}, 0)
    stds = pix.x.transpose(0, 1).reshape(3, -1).std(dim=1)
    assert np.allclose(stds.numpy(), [2.0, 1.0, 0.5], rtol=0.03)
    with pytest.raises(ValueError):
        gaussian_noise(shard, 4, 5, {"sigma": -1.0}, 0)
    with pytest.raises(ValueError):
        gaussian_noise(shard, 4, 5, {"sigma": 0.5, "pixel_std": [0.2, 0.2]}, 0)


def test_noise_transform_through_device_shard():
    spec = DataSpec.model_validate({**DATA, "device_transform": "gaussian_noise",
                                    "device_transform_params": {"sigma": 0.3}})
    clean = DataSpec.model_validate(DATA)
    train, _ = load_dataset(spec)
    assert torch.equal(device_shard(spec, train, 0).x, device_shard(clean, train, 0).x)
    noisy = device_shard(spec, train, 3).x - device_shard(clean, train, 3).x
    assert float(noisy.std()) == pytest.approx(0.3, rel=0.05)
    assert torch.equal(device_shard(spec, train, 3).x, device_shard(spec, train, 3).x)
