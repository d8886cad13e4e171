"""Tests for S2FL Algorithm 1 (layer-wise aggregation across split points)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.algorithms.aggregation import Contribution, layerwise_aggregate


def t(*vals: float) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float32)


def toy_global() -> dict[str, torch.Tensor]:
    return {"a.weight": t(0, 0), "b.weight": t(0, 0), "c.weight": t(0, 0)}


def test_two_devices_two_splits_two_groups_hand_computed():
    # Device 1 (|D|=1) cut after layer a; its group-1 server copy holds b, c.
    # Device 2 (|D|=3) cut after layer b; its group-2 server copy holds b, c (b is ignored:
    # device 2's own client portion has b, and each device contributes once per layer).
    dev1 = Contribution(1.0, {"a.weight": t(1, 2)}, {"b.weight": t(10, 20), "c.weight": t(100, 200)})
    dev2 = Contribution(
        3.0,
        {"a.weight": t(5, 6), "b.weight": t(30, 40)},
        {"b.weight": t(-7, -7), "c.weight": t(300, 400)},
    )
    out = layerwise_aggregate(toy_global(), [dev1, dev2])
    assert list(out) == ["a.weight", "b.weight", "c.weight"]
    # a: (1*[1,2] + 3*[5,6]) / 4 = [16,20]/4 = [4,5]       (both from client portions)
    # b: (1*[10,20] + 3*[30,40]) / 4 = [100,140]/4 = [25,35] (dev1 via server copy, dev2 via client)
    # c: (1*[100,200] + 3*[300,400]) / 4 = [1000,1400]/4 = [250,350] (both via their group copies)
    torch.testing.assert_close(out["a.weight"], t(4, 5))
    torch.testing.assert_close(out["b.weight"], t(25, 35))
    torch.testing.assert_close(out["c.weight"], t(250, 350))
    assert all(v.dtype == torch.float32 for v in out.values())


def test_two_devices_two_splits_one_group_hand_computed():
    # Same split points, but both devices in ONE group: they share the server copy S = {b, c}.
    shared_server = {"b.weight": t(10, 20), "c.weight": t(100, 200)}
    dev1 = Contribution(1.0, {"a.weight": t(1, 2)}, shared_server)
    dev2 = Contribution(3.0, {"a.weight": t(5, 6), "b.weight": t(30, 40)}, shared_server)
    out = layerwise_aggregate(toy_global(), [dev1, dev2])
    torch.testing.assert_close(out["a.weight"], t(4, 5))
    # b: (1*S.b + 3*dev2.b)/4 = (1*[10,20] + 3*[30,40])/4 = [25,35]
    torch.testing.assert_close(out["b.weight"], t(25, 35))
    # c: (1*S.c + 3*S.c)/4 = S.c
    torch.testing.assert_close(out["c.weight"], t(100, 200))


def test_split_depth_zero_without_server_state():
    # A FedAvg-style device (whole model on device, server_state None) beside a split device.
    dev1 = Contribution(2.0, {"a.weight": t(2, 2), "b.weight": t(4, 4), "c.weight": t(6, 6)}, None)
    dev2 = Contribution(2.0, {"a.weight": t(0, 0)}, {"b.weight": t(0, 0), "c.weight": t(0, 0)})
    out = layerwise_aggregate(toy_global(), [dev1, dev2])
    torch.testing.assert_close(out["a.weight"], t(1, 1))
    torch.testing.assert_close(out["b.weight"], t(2, 2))
    torch.testing.assert_close(out["c.weight"], t(3, 3))


def test_key_nobody_supplies_keeps_global_value():
    g = toy_global()
    g["d.weight"] = t(7, 8)
    dev = Contribution(1.0, {"a.weight": t(1, 1)}, {"b.weight": t(2, 2)})
    out = layerwise_aggregate(g, [dev])
    torch.testing.assert_close(out["c.weight"], t(0, 0))
    torch.testing.assert_close(out["d.weight"], t(7, 8))
    assert out["d.weight"].data_ptr() != g["d.weight"].data_ptr()  # a copy, not an alias
    assert list(out) == list(g)


def test_integer_buffer_weighted_average_rounded():
    g = {"bn.num_batches_tracked": torch.tensor(0, dtype=torch.int64), "w": t(0)}
    # (1*10 + 3*15) / 4 = 55/4 = 13.75 -> 14
    out = layerwise_aggregate(
        g,
        [
            Contribution(1.0, {"bn.num_batches_tracked": torch.tensor(10), "w": t(1)}),
            Contribution(3.0, {"bn.num_batches_tracked": torch.tensor(15), "w": t(1)}),
        ],
    )
    assert out["bn.num_batches_tracked"].dtype == torch.int64
    assert int(out["bn.num_batches_tracked"]) == 14
    # (1*10 + 3*13) / 4 = 49/4 = 12.25 -> 12
    out = layerwise_aggregate(
        g,
        [
            Contribution(1.0, {"bn.num_batches_tracked": torch.tensor(10)}),
            Contribution(3.0, {"bn.num_batches_tracked": torch.tensor(13)}),
        ],
    )
    assert int(out["bn.num_batches_tracked"]) == 12


def test_float_accumulation_in_float64_and_dtype_kept():
    g = {"w": torch.zeros(1, dtype=torch.float16), "v": torch.zeros(1, dtype=torch.float64)}
    out = layerwise_aggregate(
        g,
        [
            Contribution(1.0, {"w": torch.tensor([1.0], dtype=torch.float16), "v": torch.tensor([0.1], dtype=torch.float64)}),
            Contribution(2.0, {"w": torch.tensor([4.0], dtype=torch.float16), "v": torch.tensor([0.4], dtype=torch.float64)}),
        ],
    )
    assert out["w"].dtype == torch.float16 and float(out["w"]) == 3.0  # (1 + 8)/3
    assert out["v"].dtype == torch.float64
    assert float(out["v"]) == pytest.approx((0.1 + 0.8) / 3, abs=1e-15)


def test_shape_mismatch_raises_naming_key():
    bad = Contribution(1.0, {"a.weight": t(1, 2, 3)})
    with pytest.raises(ValueError, match="a.weight"):
        layerwise_aggregate(toy_global(), [bad])
    bad_server = Contribution(1.0, {"a.weight": t(1, 2)}, {"c.weight": torch.zeros(2, 1)})
    with pytest.raises(ValueError, match="c.weight"):
        layerwise_aggregate(toy_global(), [bad_server])


@pytest.mark.parametrize("w", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_weight_raises(w):
    with pytest.raises(ValueError):
        layerwise_aggregate(toy_global(), [Contribution(w, {"a.weight": t(1, 2)})])


def test_no_contributions_and_unknown_key_raise():
    with pytest.raises(ValueError):
        layerwise_aggregate(toy_global(), [])
    with pytest.raises(ValueError, match="z.weight"):
        layerwise_aggregate(toy_global(), [Contribution(1.0, {"z.weight": t(1, 2)})])


def test_fedavg_special_case_equals_plain_weighted_average():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    weights = [2.0, 5.0, 3.0]
    states = []
    for i in range(3):
        s = {}
        for k, v in global_state.items():
            if v.is_floating_point():
                s[k] = v + torch.randn_like(v)
            else:
                s[k] = v + 10 * (i + 1)  # num_batches_tracked: 10, 20, 30
        states.append(s)
    out = layerwise_aggregate(global_state, [Contribution(w, s) for w, s in zip(weights, states)])
    assert list(out) == list(global_state)
    total = sum(weights)
    for k, g in global_state.items():
        if g.is_floating_point():
            expected = sum(w * s[k] for w, s in zip(weights, states)) / total
            torch.testing.assert_close(out[k], expected)
        else:
            # (2*10 + 5*20 + 3*30) / 10 = 210/10 = 21
            assert int(out[k]) == 21 and out[k].dtype == g.dtype
    # inputs untouched
    for k, g in model.state_dict().items():
        torch.testing.assert_close(global_state[k], g)


def test_identical_states_are_a_fixed_point():
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    st = model.state_dict()
    out = layerwise_aggregate(st, [Contribution(1.0, st), Contribution(4.0, st)])
    for k in st:
        torch.testing.assert_close(out[k], st[k])


def _reference(global_state, contributions):
    """Algorithm 1 written plainly, a fresh float64 product and sum per contribution: what the
    scratch-buffer implementation must equal bit for bit."""
    out = {}
    for key, g in global_state.items():
        acc, total = None, 0.0
        for c in contributions:
            value = c.client_state.get(key, (c.server_state or {}).get(key))
            if value is None:
                continue
            term = value.to(torch.float64) * float(c.weight)
            acc = term if acc is None else acc + term
            total += float(c.weight)
        if acc is None:
            out[key] = g.clone()
        else:
            mean = acc / total
            out[key] = mean.to(g.dtype) if g.is_floating_point() else torch.round(mean).to(g.dtype)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_equals_the_plain_formula_bit_for_bit_and_leaves_inputs_alone(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 6 * 6, 5), nn.Linear(5, 3))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    keys = list(global_state)
    contributions = []
    for i in range(5):
        state = {k: (v + torch.randn_like(v) if v.is_floating_point() else v + 7 * i) for k, v in global_state.items()}
        if i % 2:   # a float64 upload: the scratch buffers must copy it, never write into it
            state = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
        cut = 1 + (seed + i) % (len(keys) - 1)
        client = {k: state[k] for k in keys[:cut]}
        server = {k: state[k] for k in keys[cut:-1]} if i < 4 else None   # the last key: not everyone
        contributions.append(Contribution(13.0 + 101.5 * i, client, server))
    before = [{k: v.clone() for k, v in {**c.client_state, **(c.server_state or {})}.items()} for c in contributions]
    out = layerwise_aggregate(global_state, contributions)
    expected = _reference(global_state, contributions)
    assert list(out) == list(expected)
    for k in out:
        assert out[k].dtype == global_state[k].dtype and torch.equal(out[k], expected[k]), k
    for c, kept in zip(contributions, before):
        assert all(torch.equal(v, kept[k]) for k, v in {**c.client_state, **(c.server_state or {})}.items())
