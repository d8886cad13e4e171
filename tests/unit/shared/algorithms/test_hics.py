"""HiCS-FL selection (the checks listed in docs/algorithms/hics.md#tests): hand-computed values and behaviour."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest
import torch

from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, train_round
from shared.algorithms.aggregation import Contribution
from shared.algorithms.base import RoundContext
from shared.algorithms.hics import (
    HiCSSelector, annealed_gamma, cluster_probabilities, distance_matrix, draw_without_replacement,
    estimate_entropy, ward_clusters,
)
from shared.algorithms.registry import build_algorithm
from shared.algorithms.registry import SELECTORS, build_selector
from shared.config import RunConfig
from shared.run_config import load_run_config
from shared.data import ArrayDataset
from shared.models import build_model

HEAD = "blocks.head"


def _config(num_devices: int = 6, per_round: int = 2, rounds: int = 10, **params) -> RunConfig:
    return load_run_config({
        "algorithm": "fedavg", "rounds": rounds, "devices_per_round": per_round,
        "data": {"num_devices": num_devices}, "selection": "hics", "selection_params": params,
    })


def _selector(**kw) -> HiCSSelector:
    selector = build_selector(_config(**kw))
    assert isinstance(selector, HiCSSelector)
    selector.output_layer = HEAD
    return selector


def _observe(selector: HiCSSelector, device: str, delta, weight: float = 100.0, split: bool = False) -> None:
    old = {f"{HEAD}.bias": torch.zeros(len(delta)), f"{HEAD}.weight": torch.zeros(len(delta), 4)}
    new = {k: v + (torch.tensor(delta, dtype=torch.float32)[:, None] if v.dim() == 2 else
                   torch.tensor(delta, dtype=torch.float32)) for k, v in old.items()}
    if split:  # the output layer is in the group's server copy, not in the device's upload
        contribution = Contribution(weight, {"blocks.conv.weight": torch.zeros(2)}, new)
    else:
        contribution = Contribution(weight, new)
    selector.observe(device, contribution, old)


# --- 1. entropy estimate ----------------------------------------------------------------------------
def test_entropy_hand_computed():
    assert estimate_entropy(np.array([0.002, -0.001, -0.001]), 0.001) == pytest.approx(0.366594, abs=1e-6)
    assert estimate_entropy(np.zeros(10), 0.0025) == pytest.approx(math.log(10), abs=1e-9)
    # Δb/T ≈ 1000 must not overflow: a one-hot softmax, entropy 0.
    big = estimate_entropy(np.array([2.5, 0.0, -2.5]), 0.0025)
    assert math.isfinite(big) and big == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError):
        estimate_entropy(np.array([np.nan, 1.0]), 0.001)


# --- 2./3. exact bias update at a zero head, through the device training code -------------------------
@pytest.mark.parametrize("labels,expected", [
    ([0, 0, 0, 0, 0, 0], 0.975328), ([0, 0, 0, 1, 1, 1], 1.074368), ([0, 0, 1, 1, 2, 2], math.log(3)),
])
def test_zero_head_one_sgd_step_gives_exact_entropy(labels, expected):
    lr = 0.01
    model = build_model("cnn", 3, (1, 28, 28), seed=0)
    with torch.no_grad():
        model.blocks.head.weight.zero_()
        model.blocks.head.bias.zero_()
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    data = ArrayDataset(torch.randn(6, 1, 28, 28), torch.tensor(labels), 3)
    train_round(model, len(model.blocks), global_state, data, TrainSettings(lr, 0.0, 0.0, 6, 1, 0),
                TrainContext(RoundClock(None)))
    uploaded = model.portion(0, len(model.blocks)).state_dict()  # what the device uploads
    assert model.output_layer == HEAD
    hist = np.bincount(labels, minlength=3) / len(labels)
    delta = (uploaded[f"{HEAD}.bias"] - global_state[f"{HEAD}.bias"]).double().numpy()
    np.testing.assert_allclose(delta, lr * (hist - 1 / 3), atol=1e-8)  # Δb = η (D - 1/C) exactly

    selector = _selector(temperature=lr)
    selector.observe("d0", Contribution(6.0, uploaded), global_state)
    assert selector.entropy("d0") == pytest.approx(expected, abs=1e-5)

    if labels == [0] * 6:  # sign guard: old - new (swapped states) makes a one-class device look more balanced
        swapped = _selector(temperature=lr)
        swapped.observe("d0", Contribution(6.0, global_state), uploaded)
        assert swapped.entropy("d0") == pytest.approx(estimate_entropy(-delta, lr))
        assert swapped.entropy("d0") > expected + 0.04  # 1.017357 vs 0.975328: test 2 would fail


# --- 4. distance ----------------------------------------------------------------------------------
def test_distance_hand_computed():
    deltas = np.array([[0.002, -0.001, -0.001], [0.001, 0.001, -0.002]])
    h = np.array([estimate_entropy(v, 0.001) for v in deltas])
    assert h[1] == pytest.approx(0.790603, abs=1e-6)
    d = distance_matrix(deltas, h, 10.0)
    assert d[0, 1] == pytest.approx(1.047198 + 10 * 0.424009, abs=1e-5)
    assert d[0, 1] == pytest.approx(5.287284, abs=1e-5)
    assert np.allclose(d, d.T) and np.all(np.diag(d) == 0.0)
    # Parallel vectors whose cosine rounds above 1: no NaN.
    v = np.array([[0.1, 0.2, 0.3], [0.1 * (1 + 1e-16), 0.2, 0.3], [1e-9, 2e-9, 3e-9]])
    d2 = distance_matrix(v, np.zeros(3), 10.0)
    assert np.all(np.isfinite(d2)) and np.allclose(d2, 0.0, atol=1e-6)


# --- 5. annealed cluster probabilities -----------------------------------------------------------------
def test_cluster_probabilities_and_annealing():
    h = [2.0, 1.0, 0.5]
    assert annealed_gamma(4.0, 10, 100) == pytest.approx(3.6)
    np.testing.assert_allclose(cluster_probabilities(h, annealed_gamma(4.0, 10, 100)),
                               [0.969142, 0.026481, 0.004377], atol=1e-6)
    np.testing.assert_allclose(cluster_probabilities(h, annealed_gamma(4.0, 50, 100)),
                               [0.843795, 0.114195, 0.042010], atol=1e-6)
    np.testing.assert_allclose(cluster_probabilities(h, annealed_gamma(4.0, 100, 100)), [1 / 3] * 3, atol=1e-12)
    assert annealed_gamma(4.0, 150, 100) == 0.0 and annealed_gamma(4.0, 150, 100, "constant") == 4.0


# --- Ward linkage -----------------------------------------------------------------------------------
def test_ward_obvious_cases_match_hand_reasoning():
    # Points on a line: {0, 1}, {10, 11, 12}, {30}. Ward merges the closest pairs first (cost
    # 2·1·1/2·d² = 0.5 for unit gaps), then {10,11}+12 (2·1/3·1.5² = 1.5); the 3-cluster cut is
    # the three groups, the 2-cluster cut joins the two left groups ({0,1}+{10,11,12} costs
    # 2·2·3/5·10.5² = 264.6 < {10,11,12}+{30}: 2·3/4·19² = 541.5).
    x = np.array([[0.0], [1.0], [10.0], [11.0], [12.0], [30.0]])
    assert ward_clusters(x, 3) == [0, 0, 1, 1, 1, 2]
    assert ward_clusters(x, 2) == [0, 0, 0, 0, 0, 1]
    assert ward_clusters(x, 6) == [0, 1, 2, 3, 4, 5]
    assert ward_clusters(x, 1) == [0] * 6
    assert ward_clusters(x, 99) == [0, 1, 2, 3, 4, 5]
    # Labels follow the first row of each cluster, not the input order of the groups.
    assert ward_clusters(x[::-1], 3) == [0, 1, 1, 1, 2, 2]


def test_ward_lance_williams_equals_brute_force_ward():
    # Brute force: merge the pair whose union raises the within-cluster sum of squares least.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(12, 4))
    clusters = [[i] for i in range(len(x))]
    sse = lambda idx: float(((x[idx] - x[idx].mean(0)) ** 2).sum())
    while len(clusters) > 4:
        best = min(((a, b) for a in range(len(clusters)) for b in range(a + 1, len(clusters))),
                   key=lambda p: sse(clusters[p[0]] + clusters[p[1]]) - sse(clusters[p[0]]) - sse(clusters[p[1]]))
        clusters[best[0]] = clusters[best[0]] + clusters.pop(best[1])
    expected = sorted(sorted(c) for c in clusters)
    labels = ward_clusters(x, 4)
    got = sorted(sorted(i for i, l in enumerate(labels) if l == c) for c in set(labels))
    assert got == expected


# --- 6. clustering separates balance levels (distance rows + Ward, as the official code) -------------
def test_clustering_separates_balanced_from_one_class():
    rng = np.random.default_rng(0)
    one_class = [0.02 * np.eye(10)[c] - 0.002 * (1 - np.eye(10)[c]) for c in range(3)]
    balanced = [rng.uniform(-1e-4, 1e-4, 10) for _ in range(3)]
    deltas = np.array(one_class + balanced)
    h = np.array([estimate_entropy(v, 0.0025) for v in deltas])
    assert np.all(h[:3] < 0.05) and np.all(h[3:] > 2.2)
    labels = ward_clusters(distance_matrix(deltas, h, 10.0), 2)
    assert labels == [0, 0, 0, 1, 1, 1]

    pairs = []
    for c in range(3):
        base = 0.02 * np.eye(10)[c] - 0.002 * (1 - np.eye(10)[c])
        pairs += [base, base + rng.normal(0, 1e-4, 10)]
    deltas = np.array(pairs)
    h = np.array([estimate_entropy(v, 0.0025) for v in deltas])
    assert ward_clusters(distance_matrix(deltas, h, 0.0), 3) == [0, 0, 1, 1, 2, 2]


# --- 7. sampling procedure --------------------------------------------------------------------------------
def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_cluster_then_data_size_probabilities():
    # 3 clusters (π from test 5 at t = 50), sizes inside clusters 1:3 | 1 | 2:2.
    labels = np.array([0, 0, 1, 2, 2])
    pi = cluster_probabilities([2.0, 1.0, 0.5], 2.0)
    sizes = np.array([1.0, 3.0, 5.0, 2.0, 2.0])
    within = np.array([0.25, 0.75, 1.0, 0.5, 0.5])
    weights = pi[labels] * within
    rng = random.Random(0)
    first = np.zeros(5)
    for _ in range(100_000):
        picks = draw_without_replacement(weights, 3, rng)
        assert len(set(picks)) == 3
        first[picks[0]] += 1
    # χ² critical values at p = 0.01: df 2 -> 9.21, df 4 -> 13.28.
    cluster_counts = np.array([first[labels == c].sum() for c in range(3)])
    assert _chi2(cluster_counts, pi) < 9.21
    assert _chi2(first, weights) < 13.28
    # One cluster (M = 1): data-size-proportional sampling without replacement.
    first = np.zeros(5)
    for _ in range(50_000):
        first[draw_without_replacement(sizes / sizes.sum(), 2, rng)[0]] += 1
    assert _chi2(first, sizes / sizes.sum()) < 13.28
    # Zero / underflowed weights never crash and still give distinct picks.
    assert sorted(draw_without_replacement(np.array([1.0, 0.0, 0.0]), 3, rng)) == [0, 1, 2]


def test_selector_prefers_balanced_cluster_early_and_gives_k_distinct():
    sel = _selector(num_devices=6, per_round=2, rounds=100, temperature=0.0025)
    for c in range(4):
        _observe(sel, f"d{c}", list(0.02 * np.eye(10)[c] - 0.002 * (1 - np.eye(10)[c])))
    _observe(sel, "d4", list(np.random.default_rng(1).uniform(-1e-4, 1e-4, 10)))
    _observe(sel, "d5", list(np.random.default_rng(2).uniform(-1e-4, 1e-4, 10)))
    rng = random.Random(0)
    hits = 0
    for _ in range(200):
        picks = sel.select(RoundContext(2, 2), [f"d{i}" for i in range(6)], 2, rng)
        assert len(set(picks)) == 2
        hits += ("d4" in picks) + ("d5" in picks)
    assert hits / 400 > 0.45  # balanced devices are 1/3 of the population
    m = sel.metrics()
    assert m["hics_warmup"] == 0 and m["hics_clusters"] == 2 and m["hics_gamma"] == pytest.approx(3.92)


# --- 8. warm-up -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,fill", [(50, 5, False), (52, 5, False), (52, 5, True)])
def test_warmup_visits_every_device_once(n, k, fill):
    sel = _selector(num_devices=n, per_round=k, rounds=100, warmup_fill=fill)
    devices = [f"dev{i:02d}" for i in range(n)]
    rng = random.Random(1)
    seen: list[str] = []
    rounds = math.ceil(n / k)
    for t in range(1, rounds + 1):
        picks = sel.select(RoundContext(t, t), devices, k, rng)
        assert sel.metrics()["hics_warmup"] == 1
        new = [d for d in picks if d not in seen]
        expected_len = k if (t < rounds or fill or n % k == 0) else n % k
        assert len(picks) == expected_len
        assert len(new) == min(k, n - len(seen))
        seen += new
        for d in picks:
            _observe(sel, d, list(np.random.default_rng(len(seen)).normal(0, 1e-3, 10)))
    assert sorted(seen) == devices
    picks = sel.select(RoundContext(rounds + 1, rounds + 1), devices, k, rng)
    assert len(picks) == k and sel.metrics()["hics_warmup"] == 0


def test_unobserved_device_after_warmup_comes_first():
    sel = _selector(num_devices=6, per_round=2)
    for i in range(5):
        _observe(sel, f"d{i}", list(np.random.default_rng(i).normal(0, 1e-3, 10)))
    picks = sel.select(RoundContext(7, 7), [f"d{i}" for i in range(6)], 2, random.Random(0))
    assert "d5" in picks and len(picks) == 2
    assert sel.metrics()["hics_warmup"] == 1 and sel.metrics()["hics_forced"] == 1


# --- split mode, validation ---------------------------------------------------------------------------
def test_split_mode_uses_group_server_copy_and_bad_uploads_are_skipped():
    sel = _selector()
    _observe(sel, "a", [0.002, -0.001, -0.001], split=True)
    assert sel.estimates["a"]["source"] == "server"
    assert sel.entropy("a") == pytest.approx(estimate_entropy(np.array([0.002, -0.001, -0.001]), 0.0025))
    _observe(sel, "b", [0.002, -0.001, -0.001])
    assert sel.estimates["b"]["source"] == "client"
    # No output layer anywhere / wrong length / bad weight: not observed, counted, no exception.
    sel.observe("c", Contribution(5.0, {"blocks.conv.weight": torch.zeros(2)}), {})
    _observe(sel, "d", [0.1, 0.2])
    _observe(sel, "e", [0.1, 0.2, 0.3], weight=float("nan"))
    assert set(sel.estimates) == {"a", "b"} and sel.metrics()["hics_skipped"] == 3


def test_weight_row_mean_signal_and_first_only_refresh():
    sel = _selector(signal="weight_row_mean", refresh="first_only")
    _observe(sel, "a", [0.002, -0.001, -0.001])
    np.testing.assert_allclose(sel.estimates["a"]["delta"], [0.002, -0.001, -0.001], rtol=1e-5)
    _observe(sel, "a", [0.0, 0.0, 0.0])
    assert sel.estimates["a"]["delta"][0] == pytest.approx(0.002)


def test_params_are_validated():
    with pytest.raises(ValueError):
        _config(temperature=0.0)
    with pytest.raises(ValueError):
        _config(unknown=1)
    assert SELECTORS["hics"] is HiCSSelector


# --- 9. determinism and state/resume ------------------------------------------------------------------
def _simulate(sel: HiCSSelector, rng: random.Random, start: int, stop: int, devices: list[str]) -> list[list[str]]:
    out = []
    for t in range(start, stop):
        picks = sel.select(RoundContext(t, t), devices, 3, rng)
        out.append(picks)
        for d in picks:  # deterministic fake updates depending on device and round
            i = int(d[1:])
            delta = 0.01 * np.eye(10)[i % 10] * (i % 3) + np.random.default_rng(100 * t + i).normal(0, 1e-3, 10)
            _observe(sel, d, list(delta), weight=50 + 10 * i)
        sel.metrics()
    return out


def test_deterministic_and_resumable_from_state_dict():
    devices = [f"d{i}" for i in range(12)]
    kw = dict(num_devices=12, per_round=3, rounds=20, temperature=0.01)
    a = _simulate(_selector(**kw), random.Random(5), 1, 16, devices)
    b = _simulate(_selector(**kw), random.Random(5), 1, 16, devices)
    assert a == b
    assert len({d for picks in a[:4] for d in picks}) == 12  # warm-up: 4 rounds, 12 distinct devices

    first = _selector(**kw)
    rng = random.Random(5)
    head = _simulate(first, rng, 1, 8, devices)
    state = json.loads(json.dumps(first.state_dict()))  # JSON-able
    resumed = _selector(**kw)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == first.state_dict()
    assert head + _simulate(resumed, rng, 8, 16, devices) == a

    bad = json.loads(json.dumps(state))
    bad["estimates"]["d0"]["delta"][0] = float("inf")
    with pytest.raises(ValueError):
        _selector(**kw).load_state_dict(bad)


def test_works_under_fedavg_and_s2fl_algorithms():
    for algorithm in ("fedavg", "s2fl"):
        config = load_run_config({"algorithm": algorithm, "selection": "hics", "rounds": 5,
                                           "data": {"num_devices": 4}, "devices_per_round": 2})
        algo = build_algorithm(config)
        algo.bind_model(build_model("cnn"))
        selector = build_selector(config, output_layer=algo.output_layer)
        assert isinstance(selector, HiCSSelector) and selector.output_layer == HEAD
        picks = selector.select(RoundContext(1, 1), algo.eligible(["a", "b", "c", "d"]), 2, random.Random(0))
        assert len(picks) == 2 and "estimates" in json.loads(json.dumps(selector.state_dict()))
