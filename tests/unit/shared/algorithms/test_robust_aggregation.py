"""Aggregation rules (shared/algorithms/robust_aggregation.py): each rule's math against
hand-computed values on Algorithm 1's mixed portions, the weight and update bounds, the default
rule against one harmful device, and the rule's configuration."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from shared.algorithms.aggregation import Contribution, layerwise_aggregate
from shared.algorithms.base import RoundContext
from shared.algorithms.registry import AGGREGATION_RULES, build_algorithm
from shared.algorithms.robust_aggregation import (
    DEFAULT_CLIP, DEFAULT_MAX_WEIGHT_RATIO, PAIRWISE_MAX, SLICE, BoundedMean, Krum, Mean, Median, MultiKrum, TrimmedMean,
    bounded_weights, ranks,
)
from shared.config import RunConfig
from shared.run_config import ConfigError, load_run_config, resolve_run_config

UNBOUNDED = {"clip": None, "max_weight_ratio": None}


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def contributions(*items: Contribution) -> dict[str, Contribution]:
    return {f"dev-{i}": c for i, c in enumerate(items)}


def scalars(values: list[float], weights: list[float]) -> dict[str, Contribution]:
    """One key ``w`` (global 0), each device supplying it from its client portion."""
    return contributions(*(Contribution(w, {"w": t(v)}) for v, w in zip(values, weights)))


def _mixed_round(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Contribution]]:
    """Five devices cut at different layers, two groups sharing server copies, float64 uploads,
    a key not everyone supplies and an integer buffer: Algorithm 1's general case."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.Linear(5, 3))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = list(global_state)
    copies = [{k: v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v + 3 for k, v in global_state.items()}
              for _ in range(2)]
    out = {}
    for i in range(5):
        state = {k: (v + 0.1 * torch.randn_like(v) if v.is_floating_point() else v + 7 * i) for k, v in global_state.items()}
        if i % 2:
            state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
        cut = 1 + (seed + i) % (len(keys) - 1)
        server = {k: copies[i % 2][k] for k in keys[cut:-1]} if i < 4 else None
        out[f"dev-{i}"] = Contribution(13.0 + 101.5 * i, {k: state[k] for k in keys[:cut]}, server)
    return global_state, out


# ------------------------------------------------------------------------------- mean = Algorithm 1
@pytest.mark.parametrize("seed", range(3))
def test_mean_is_algorithm_1_bit_for_bit(seed):
    global_state, contribs = _mixed_round(seed)
    expected = layerwise_aggregate(global_state, list(contribs.values()))
    for rule in (Mean({}), build_algorithm(RunConfig(aggregation={"rule": "mean"})).aggregation_rule):
        out = rule.aggregate(global_state, contribs)
        assert list(out.state) == list(expected) and not out.clipped and not out.capped
        assert all(torch.equal(out.state[k], expected[k]) and out.state[k].dtype == expected[k].dtype for k in expected)


@pytest.mark.parametrize("seed", range(3))
def test_bounded_mean_leaves_an_honest_round_bit_for_bit_as_algorithm_1(seed):
    # Similar updates and weights within 4x the median: neither bound binds.
    global_state, contribs = _mixed_round(seed)
    contribs = {d: Contribution(100.0 + 10 * i, c.client_state, c.server_state) for i, (d, c) in enumerate(contribs.items())}
    expected = layerwise_aggregate(global_state, list(contribs.values()))
    out = BoundedMean({}).aggregate(global_state, contribs)
    assert not out.clipped and not out.capped
    assert all(torch.equal(out.state[k], expected[k]) for k in expected)


# ------------------------------------------------------------------------------- the rules' math
def test_median_counts_a_group_copy_once_per_member():
    g = {"a": t(0), "b": t(0)}
    copy = {"b": t(5)}   # one group copy, standing for dev-0 and dev-1 on key b
    contribs = contributions(Contribution(1, {"a": t(1)}, copy), Contribution(1, {"a": t(2)}, copy),
                             Contribution(1, {"a": t(9), "b": t(-3)}))
    out = Median(UNBOUNDED).aggregate(g, contribs).state
    assert out["a"].item() == 2.0   # median of 1, 2, 9
    assert out["b"].item() == 5.0   # median of 5, 5, -3 (counted once it would be (5 - 3) / 2 = 1)


@pytest.mark.parametrize("values, weights, expected", [
    ([0, 1, 10], [1, 1, 3], 10),         # cumulative 1, 2, 5: half (2.5) falls on 10
    ([0, 1, 10], [3, 1, 1], 0),
    ([0, 1, 10, 20], [1, 1, 1, 1], 5.5),  # half falls between 1 and 10: their mean, the usual median
    ([4, -2], [1, 1], 1),
    ([7], [2], 7),
])
def test_weighted_median_hand_computed(values, weights, expected):
    out = Median(UNBOUNDED).aggregate({"w": t(0)}, scalars(values, weights)).state
    assert out["w"].item() == pytest.approx(expected)


def test_median_is_taken_of_updates_coordinate_wise():
    g = {"w": t(10, 10)}
    contribs = contributions(Contribution(1, {"w": t(11, 7)}), Contribution(1, {"w": t(13, 8)}),
                             Contribution(1, {"w": t(12, 100)}))
    assert torch.equal(Median(UNBOUNDED).aggregate(g, contribs).state["w"], t(12, 8))


@pytest.mark.parametrize("params, expected", [
    ({"count": 1}, (1 * 1 + 2 * 1 + 3 * 3) / 5),         # -100 and 100 dropped, weights 1, 1, 3 kept
    ({"fraction": 0.2}, (1 * 1 + 2 * 1 + 3 * 3) / 5),    # floor(0.2 * 5) = 1 at each end
    ({"fraction": 0.1}, (-100 + 1 + 2 + 9 + 100) / 7),   # floor(0.5) = 0: the weighted mean
    ({}, (-100 + 1 + 2 + 9 + 100) / 7),                  # default fraction 0.1
    ({"count": 9}, 2.0),                                 # shrinks to (5 - 1) // 2 = 2: the middle one
])
def test_trimmed_mean_hand_computed(params, expected):
    out = TrimmedMean({**UNBOUNDED, **params}).aggregate({"w": t(0)}, scalars([-100, 1, 2, 3, 100], [1, 1, 1, 3, 1]))
    assert out.state["w"].item() == pytest.approx(expected)


@pytest.mark.parametrize("n", [1, 2, 7, PAIRWISE_MAX, PAIRWISE_MAX + 1, 300])
def test_ranks_are_a_stable_sorts_positions(n):
    # 300: past what one byte counts, which the pairwise count of a few candidates keeps its ranks in.
    # Few distinct values, so ties are everywhere: a tie keeps candidate order, as a stable sort does.
    torch.manual_seed(n)
    updates = torch.randint(-3, 4, (n, 500)).double()
    rank = ranks(updates)
    order = updates.sort(dim=0, stable=True).indices
    assert rank.dtype == torch.int64
    assert torch.equal(rank.gather(0, order), torch.arange(n).view(-1, 1).expand(n, 500))


def _sorted_reference(rule, global_value: torch.Tensor, values: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """The median or trimmed mean of a whole key from one stable sort (the rules' definitions)."""
    updates = torch.stack([v.double() for v in values]).reshape(len(values), -1) - global_value.double().reshape(-1)
    ordered, order = updates.sort(dim=0, stable=True)
    ordered_w = torch.tensor(weights, dtype=torch.float64)[order]
    n = len(values)
    if isinstance(rule, TrimmedMean):
        trim = min(rule.params.count, (n - 1) // 2)
        kept, kept_w = ordered[trim:n - trim], ordered_w[trim:n - trim]
        combined = (kept * kept_w).sum(dim=0) / kept_w.sum(dim=0)
    else:
        cumulative, half = ordered_w.cumsum(dim=0), sum(weights) / 2
        lower = (cumulative < half).sum(dim=0, keepdim=True).clamp(max=n - 1)
        upper = (cumulative <= half).sum(dim=0, keepdim=True).clamp(max=n - 1)
        combined = ((ordered.gather(0, lower) + ordered.gather(0, upper)) / 2).squeeze(0)
    return (global_value.double().reshape(-1) + combined).view(global_value.shape).float()


@pytest.mark.parametrize("rule", [Median(UNBOUNDED), TrimmedMean({**UNBOUNDED, "count": 2})], ids=["median", "trimmed_mean"])
def test_a_key_larger_than_a_slice_is_combined_as_a_whole(rule):
    # A key of 2.5 slices (the last one partial), with ties and unequal weights.
    torch.manual_seed(0)
    g = torch.randn(5, SLICE // 2)
    values = [g + torch.randint(-2, 3, g.shape) * 0.25 for _ in range(7)]
    weights = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0]
    out = rule.aggregate({"w": g}, contributions(*(Contribution(w, {"w": v}) for v, w in zip(values, weights))))
    assert torch.equal(out.state["w"], _sorted_reference(rule, g, values, weights))


@pytest.mark.parametrize("rule, expected", [(Krum({**UNBOUNDED, "f": 1}), [0.0, 0.0]),
                                            (MultiKrum({**UNBOUNDED, "f": 1, "m": 2}), [0.0, 50.0])],
                         ids=["krum", "multi_krum"])
def test_krum_scores_a_key_larger_than_a_slice_as_a_whole(rule, expected):
    # A key one slice and four coordinates long. Over the whole key, u0 and u1 are nearest
    # (they differ only in the last four coordinates: 4 x 100^2) and Krum keeps u0, Multi-Krum
    # u0 and u1. Scored a slice at a time, the first slice would keep u0 (u0 = u1 there) but the
    # last four coordinates u1 (u1 = u2 there): a mix of candidates no whole-key rule gives.
    size = SLICE + 4
    head, tail = torch.zeros(SLICE), torch.full((4,), 100.0)
    u0 = torch.zeros(size)
    u1 = torch.cat([head, tail])
    u2 = torch.cat([head + 1.0, tail])
    u3 = torch.full((size,), 50.0)
    out = rule.aggregate({"w": torch.zeros(size)}, contributions(*(Contribution(1.0, {"w": u}) for u in (u0, u1, u2, u3))))
    first, last = expected
    assert torch.equal(out.state["w"][:SLICE], torch.full((SLICE,), first))
    assert torch.equal(out.state["w"][SLICE:], torch.full((4,), last))


def test_krum_and_multi_krum_hand_computed():
    g = {"w": t(0, 0)}
    contribs = contributions(Contribution(1, {"w": t(0, 0)}), Contribution(1, {"w": t(1, 0)}),
                             Contribution(2, {"w": t(0, 1)}), Contribution(1, {"w": t(10, 10)}))
    # f=1, n=4: each scored by its one nearest neighbour: 1, 1, 1, 181 -> Krum keeps the first of the tie
    assert torch.equal(Krum({**UNBOUNDED, "f": 1}).aggregate(g, contribs).state["w"], t(0, 0))
    # Multi-Krum, m = n - f = 3: the three best, weighted 1, 1, 2
    expected = t(0.25, 0.5)
    assert torch.equal(MultiKrum({**UNBOUNDED, "f": 1}).aggregate(g, contribs).state["w"], expected)
    assert torch.equal(MultiKrum({**UNBOUNDED, "f": 1, "m": 3}).aggregate(g, contribs).state["w"], expected)
    # m = 4 takes everyone: the weighted mean
    everyone = MultiKrum({**UNBOUNDED, "f": 0, "m": 4}).aggregate(g, contribs).state["w"]
    torch.testing.assert_close(everyone, t(11 / 5, 12 / 5))


def test_krum_compares_a_group_copy_once():
    # Three members share an outlying copy; counted per member, its copies would be each other's
    # neighbours at distance 0 and Krum would pick it.
    g = {"w": t(0, 0)}
    outlier = {"w": t(50, 50)}
    contribs = contributions(*(Contribution(1, {}, outlier) for _ in range(3)),
                             Contribution(1, {"w": t(1, 0)}), Contribution(1, {"w": t(0, 1)}),
                             Contribution(1, {"w": t(1, 1)}))
    # Distinct: (50, 50) and the three honest ones, each honest at distance 1 from its nearest.
    assert torch.equal(Krum({**UNBOUNDED, "f": 1}).aggregate(g, contribs).state["w"], t(1, 0))


def test_multi_krum_weighs_a_group_copy_by_its_members_summed_weights():
    # One copy (0) shared by two members of weight 1 and 2, and one device's own value 3 of
    # weight 1; Multi-Krum keeping both candidates averages them as 3 : 1.
    g = {"w": t(0)}
    shared = {"w": t(0)}
    contribs = contributions(Contribution(1, {}, shared), Contribution(2, {}, shared), Contribution(1, {"w": t(3)}))
    out = MultiKrum({**UNBOUNDED, "f": 0, "m": 2}).aggregate(g, contribs)
    assert out.state["w"].item() == pytest.approx(3 / 4)
    assert shared["w"].item() == 0.0   # the copy itself is left as it was


def test_integer_buffers_are_the_bounded_weighted_mean_rounded_under_every_rule():
    g = {"n": torch.tensor(0), "w": t(0)}
    contribs = contributions(*(Contribution(w, {"n": torch.tensor(v), "w": t(1)}) for v, w in ((10, 1), (10, 1), (70, 100))))
    for name, rule in AGGREGATION_RULES.items():
        bounded = rule({}) if name != "mean" else rule({"max_weight_ratio": DEFAULT_MAX_WEIGHT_RATIO})
        # weight 100 clamped to 4 x the median weight (1): (10 + 10 + 4 * 70) / 6 = 50
        assert bounded.aggregate(g, contribs).state["n"].item() == 50, name
        assert bounded.aggregate(g, contribs).state["n"].dtype == torch.int64
    assert Mean({}).aggregate(g, contribs).state["n"].item() == 69   # (20 + 7000) / 102 = 68.8


def test_weight_bound_is_a_multiple_of_the_median_weight():
    weights, capped = bounded_weights({"a": 1.0, "b": 2.0, "c": 3.0, "d": 1e12}, 4.0)
    assert weights == {"a": 1.0, "b": 2.0, "c": 3.0, "d": 10.0} and capped == {"d": 10.0}   # median 2.5
    assert bounded_weights({"a": 1.0, "b": 3.0}, 4.0) == ({"a": 1.0, "b": 3.0}, {})
    assert bounded_weights({"a": 1.0, "b": 1e12}, None) == ({"a": 1.0, "b": 1e12}, {})


def test_clip_scales_an_update_onto_c_times_the_median_norm():
    g = {"w": t(1, 1)}
    contribs = contributions(Contribution(1, {"w": t(2, 1)}), Contribution(1, {"w": t(1, 2)}),
                             Contribution(1, {"w": t(1, 0)}), Contribution(1, {"w": t(-29, -39)}))
    out = Mean({"clip": 2.0}).aggregate(g, contribs)
    # norms 1, 1, 1, 50: median 1, bound 2; the last update (-30, -40) becomes (-1.2, -1.6)
    torch.testing.assert_close(out.state["w"], t(1 + (1 + 0 + 0 - 1.2) / 4, 1 + (0 + 1 - 1 - 1.6) / 4))
    assert out.clipped == {"dev-3": ["w"]}


def test_clip_acts_on_a_group_copy_once_and_reports_its_members():
    g = {"a": t(0), "b": t(0)}
    copy = {"b": t(100)}
    contribs = contributions(Contribution(1, {"a": t(1)}, copy), Contribution(1, {"a": t(1)}, copy),
                             *(Contribution(1, {"a": t(1), "b": t(1)}) for _ in range(3)))
    out = BoundedMean({"clip": 2.0}).aggregate(g, contribs)
    assert out.clipped == {"dev-0": ["b"], "dev-1": ["b"]}   # median of 100, 100, 1, 1, 1 is 1: bound 2
    torch.testing.assert_close(out.state["b"], t((2 + 2 + 3) / 5))
    assert contribs["dev-0"].server_state["b"].item() == 100   # inputs untouched


# ------------------------------------------------------------------------------- one harmful device
def _ten_devices(attack) -> tuple[dict[str, torch.Tensor], dict[str, Contribution], torch.Tensor]:
    """Nine honest updates (a common direction plus noise) and one attacker, with its honest
    update changed by ``attack``; returns the global state, contributions, honest weighted mean."""
    generator = torch.Generator().manual_seed(0)
    g = {"w": torch.randn(200, generator=generator), "n": torch.tensor(5)}
    direction = torch.randn(200, generator=generator)
    updates = [direction + 0.5 * torch.randn(200, generator=generator) for _ in range(10)]
    weights = [300.0 + 20 * i for i in range(10)]
    honest_mean = sum(w * u for w, u in zip(weights[1:], updates[1:])) / sum(weights[1:])
    update, weight = attack(updates[0], weights[0])
    contribs = {"dev-0": Contribution(weight, {"w": g["w"] + update, "n": torch.tensor(6)})}
    contribs.update({f"dev-{i}": Contribution(weights[i], {"w": g["w"] + updates[i], "n": torch.tensor(6)})
                     for i in range(1, 10)})
    return g, contribs, honest_mean


@pytest.mark.parametrize("attack", [
    pytest.param(lambda u, w: (u * 1e6, w), id="update x1e6"),
    pytest.param(lambda u, w: (-10 * u, w), id="sign flip x10"),
    pytest.param(lambda u, w: (torch.zeros_like(u), 1e12), id="zero update, 1e12 samples"),
])
def test_default_rule_bounds_how_far_one_harmful_device_of_ten_moves_the_model(attack):
    g, contribs, honest_mean = _ten_devices(attack)
    default = build_algorithm(RunConfig()).aggregation_rule
    assert isinstance(default, BoundedMean)

    def moved(rule) -> float:
        """Distance of the aggregate's update from the honest devices' mean update, relative to its size."""
        update = rule.aggregate(g, contribs).state["w"] - g["w"]
        return float((update - honest_mean).norm() / honest_mean.norm())

    # The attacker's weight is at most 4 median devices of 13 and its update at most 3 median
    # norms (each honest norm is about the honest mean's 1.1), so at most 4/13 * (3 * 1.1 + 1).
    assert moved(default) < 4 / 13 * (DEFAULT_CLIP * 1.1 + 1)
    assert moved(Mean({})) > 0.9   # the unbounded mean is at least as far off as a lost round


# ------------------------------------------------------------------------------- configuration
def test_default_and_every_registered_rule_build_from_the_config():
    assert RunConfig().aggregation.rule == "bounded_mean" and RunConfig().aggregation.params == {}
    for name, rule in AGGREGATION_RULES.items():
        config = resolve_run_config(overrides=[f"aggregation.rule={name}"])
        assert type(build_algorithm(config).aggregation_rule) is rule
    config = resolve_run_config(overrides=["aggregation.rule=trimmed_mean", "aggregation.params.count=2",
                                           "aggregation.params.clip=null"])
    assert config.aggregation.params == {"count": 2, "clip": None}
    assert build_algorithm(config).aggregation_rule.params.clip is None


@pytest.mark.parametrize("aggregation, line", [
    ({"rule": "average"}, f"unknown aggregation rule 'average'; choose one of {sorted(AGGREGATION_RULES)}"),
    ({"rule": "median", "params": {"clip": -1}}, "aggregation.params.clip: must be greater than 0 (got -1)"),
    ({"rule": "krum", "params": {"f": 1, "m": 2}},
     "aggregation.params.m: unknown key (valid keys: clip, max_weight_ratio, f)"),
    ({"rule": "trimmed_mean", "params": {"count": 1, "fraction": 0.1}}, "aggregation.params: set fraction or count, not both"),
    ({"params": {"max_weight_ratio": 0.5}}, "aggregation.params.max_weight_ratio: must be greater than or equal to 1 (got 0.5)"),
    ({"rule": "mean", "params": {"max_weight_ratio": 0.5}},
     "aggregation.params.max_weight_ratio: must be greater than or equal to 1 (got 0.5)"),
    ({"rule": "trimmed_mean", "params": {"fraction": 0.5}}, "aggregation.params.fraction: must be less than 0.5 (got 0.5)"),
])
def test_unknown_rule_or_bad_params_are_refused_when_the_config_is_loaded(aggregation, line):
    with pytest.raises(ConfigError) as info:
        load_run_config({"aggregation": aggregation})
    assert info.value.lines == [line]


# ------------------------------------------------------------------------------- the algorithms apply it
@pytest.mark.parametrize("algorithm", ["s2fl", "fedavg", "fedipg"])
def test_algorithms_aggregate_with_the_configured_rule_and_log_the_bounds(algorithm, caplog):
    algo = build_algorithm(RunConfig(algorithm=algorithm, aggregation={"rule": "median"}))
    algo.bind_model(nn.Linear(1, 1))
    g = {"w": t(0)}
    contribs = scalars([1, 2, 3, 4, 1000], [1, 1, 1, 1, 100])
    with caplog.at_level(logging.INFO, logger="shared.algorithms.base"):
        out = algo.aggregate(RoundContext(2, 7), g, contribs, {})
    # 100 clamped to 4 x 1; 999 clipped to 3 x the median norm (3): the weighted median of
    # 1, 2, 3, 4, 9 with weights 1, 1, 1, 1, 4 (cumulative 1, 2, 3, 4, 8; half 4) is (4 + 9) / 2
    assert out["w"].item() == 6.5
    assert "round 2 (attempt 7): aggregation weight bounded for dev-4 (100 -> 4)" in caplog.text
    assert "round 2 (attempt 7): update clipped to the round's norm bound for dev-4 on w" in caplog.text


# ------------------------------------------------------------------------------- trims and parameter bounds
def test_trimmed_mean_default_fraction_trims_one_of_ten_at_each_end():
    values = [-50.0, 1, 2, 3, 4, 5, 6, 7, 8, 90]   # floor(0.1 * 10) = 1: -50 and 90 dropped
    out = TrimmedMean(UNBOUNDED).aggregate({"w": t(0)}, scalars(values, [1] * 10))
    assert out.state["w"].item() == pytest.approx(36 / 8)


def test_trimmed_mean_of_an_even_count_keeps_the_middle_two():
    # count 5 of 4 candidates shrinks to (4 - 1) // 2 = 1 at each end: 2 and 3 stay, weights 1 and 3
    out = TrimmedMean({**UNBOUNDED, "count": 5}).aggregate({"w": t(0)}, scalars([1, 2, 3, 4], [1, 1, 3, 1]))
    assert out.state["w"].item() == pytest.approx((2 * 1 + 3 * 3) / 4)
    # count 3 of 6 shrinks to 2 at each end: 3 and 4 stay
    out = TrimmedMean({**UNBOUNDED, "count": 3}).aggregate({"w": t(0)}, scalars([1, 2, 3, 4, 5, 6], [1] * 6))
    assert out.state["w"].item() == pytest.approx(3.5)


@pytest.mark.parametrize("params, line", [
    ({"f": -1}, "aggregation.params.f: must be greater than or equal to 0 (got -1)"),
    ({"m": 0}, "aggregation.params.m: must be greater than or equal to 1 (got 0)"),
])
def test_multi_krum_refuses_a_negative_f_and_no_selection(params, line):
    with pytest.raises(ConfigError) as info:
        load_run_config({"aggregation": {"rule": "multi_krum", "params": params}})
    assert info.value.lines == [line]


def test_krum_scores_by_n_minus_f_minus_2_neighbours_with_f_1_by_default():
    # n = 5, f = 1: two nearest neighbours each (squared distances): 0 -> 1 + 4 = 5, 1 -> 1 + 1 = 2,
    # 2 -> 1 + 4 = 5, 10 -> 1 + 64 = 65, 11 -> 1 + 81 = 82: Krum keeps 1. (Three neighbours would
    # keep 2; f = 2, one neighbour, would tie all five at 1 and keep the first, 0.)
    out = Krum(UNBOUNDED).aggregate({"w": t(0)}, scalars([0, 1, 2, 10, 11], [1] * 5))
    assert out.state["w"].item() == 1.0


def test_krum_refuses_a_negative_f():
    with pytest.raises(ConfigError) as info:
        load_run_config({"aggregation": {"rule": "krum", "params": {"f": -1}}})
    assert info.value.lines == ["aggregation.params.f: must be greater than or equal to 0 (got -1)"]


def test_clip_goes_on_past_an_integer_key():
    # An integer buffer first, then the floating key: median update norm 1, bound 3 * 1, so the
    # 100 is clipped onto 3 and the mean is (1 + 1 + 3) / 3.
    g = {"n": torch.tensor(0), "w": t(0)}
    contribs = contributions(*(Contribution(1, {"n": torch.tensor(2), "w": t(v)}) for v in (1, 1, 100)))
    out = BoundedMean({"max_weight_ratio": None}).aggregate(g, contribs)
    assert out.state["w"].item() == pytest.approx(5 / 3)
    assert out.clipped == {"dev-2": ["w"]}


def test_clip_goes_on_past_a_key_nobody_supplies():
    # u is in the global state but in no upload; w's 100 is still clipped onto 3 * median 1.
    g = {"u": t(0), "w": t(0)}
    out = BoundedMean({"max_weight_ratio": None}).aggregate(g, scalars([1, 1, 100], [1, 1, 1]))
    assert out.state["w"].item() == pytest.approx(5 / 3) and out.state["u"].item() == 0.0
    assert out.clipped == {"dev-2": ["w"]}


def test_trimmed_mean_count_zero_is_the_weighted_mean():
    out = TrimmedMean({**UNBOUNDED, "count": 0}).aggregate({"w": t(0)}, scalars([-100, 1, 2, 3, 100], [1, 1, 1, 3, 1]))
    assert out.state["w"].item() == pytest.approx((-100 + 1 + 2 + 9 + 100) / 7)


def test_multi_krum_with_f_past_the_candidates_still_averages_the_best_one():
    # A round that lost devices may have n - f <= 0 candidates left: Multi-Krum still keeps one
    # (the best scored, as Krum), never none (a mean over no weight).
    out = MultiKrum({**UNBOUNDED, "f": 5}).aggregate({"w": t(0)}, scalars([0, 1, 7], [1, 1, 1]))
    assert out.state["w"].item() == 0.0


def test_clip_reports_only_updates_past_the_bound():
    # clip 1: the bound is the median norm itself (2 here); the median device's update is on the
    # bound, unchanged, and not reported clipped; the norm-3 update is.
    out = Mean({"clip": 1.0}).aggregate({"w": t(0)}, scalars([1, 2, -3], [1, 1, 1]))
    assert out.clipped == {"dev-2": ["w"]}
    assert out.state["w"].item() == pytest.approx((1 + 2 - 2) / 3)


def test_krum_scores_by_at_least_one_neighbour():
    # n = 3, f = 1: n - f - 2 = 0, raised to one neighbour: 0 -> 1, 1 -> 1, 5 -> 16; Krum keeps 0,
    # the first of the tie. (No neighbour at all would score every candidate 0.)
    out = Krum(UNBOUNDED).aggregate({"w": t(0)}, scalars([5, 0, 1], [1, 1, 1]))
    assert out.state["w"].item() == 0.0


def test_a_rule_takes_the_candidates_after_a_device_without_the_key():
    # dev-0 supplies only a; the median of w is over dev-1..3: 1, 2, 30 -> 2.
    g = {"a": t(0), "w": t(0)}
    contribs = contributions(Contribution(1, {"a": t(1)}), *(Contribution(1, {"w": t(v)}) for v in (1, 2, 30)))
    assert Median(UNBOUNDED).aggregate(g, contribs).state["w"].item() == 2.0


def test_every_unknown_key_is_named():
    with pytest.raises(ConfigError) as info:
        load_run_config({"aggregation": {"rule": "krum", "params": {"aa": 1, "bb": 2}}})
    valid = "(valid keys: clip, max_weight_ratio, f)"
    assert info.value.lines == [f"aggregation.params.aa: unknown key {valid}; aggregation.params.bb: unknown key {valid}"]
