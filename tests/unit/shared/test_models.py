"""Unit tests for shared.models: the SplitModel contract, the zoo and the per-split cost profile."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from shared.models import (
    MODEL_NAMES,
    ModelProfile,
    Portion,
    SplitCost,
    SplitModel,
    build_model,
    build_model_layout,
    profile_model,
)
from shared.models.zoo import SPLIT_DEPTH_ZERO_MODELS

#: Models with real compute on both sides of every split point (logreg's cuts are placeholders).
SPLIT_MODELS = tuple(n for n in MODEL_NAMES if n not in SPLIT_DEPTH_ZERO_MODELS)

SHAPES = [(1, 28, 28), (3, 32, 32)]


@pytest.fixture(scope="module")
def model_cache():
    """Build each (name, shape) once per module: VGG-16 alone has 15M parameters to initialise."""
    cache: dict[tuple, SplitModel] = {}

    def get(name: str, shape: tuple[int, int, int] | None = None) -> SplitModel:
        key = (name, shape)
        if key not in cache:
            cache[key] = build_model(name, input_shape=shape, seed=0).eval()
        return cache[key]

    return get


@pytest.fixture(scope="module")
def profiles(model_cache):
    return {name: profile_model(model_cache(name), name) for name in MODEL_NAMES}


def _sample(model: SplitModel, n: int = 2, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *model.input_shape), generator=g)


# ------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_forward_shape_and_split_equivalence(model_cache, name, shape):
    model = model_cache(name, shape)
    assert model.input_shape == shape
    x = _sample(model)
    n = len(model.blocks)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, model.num_classes)
        for k in model.split_points:
            act = model.forward_blocks(x, 0, k)
            assert torch.allclose(model.forward_blocks(act, k, n), out, atol=1e-5, rtol=1e-4)
            # the portions compute the same thing as forward_blocks
            assert torch.allclose(model.portion(k, n)(model.portion(0, k)(x)), out, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_split_points_and_output_layer(model_cache, name):
    model = model_cache(name)
    ks = model.split_points
    assert len(ks) == 3
    assert all(a < b for a, b in zip(ks, ks[1:]))
    assert 1 <= ks[0] and ks[-1] < len(model.blocks)
    assert model.block_names() == list(model.blocks.keys())
    sd = model.state_dict()
    bias = sd[f"{model.output_layer}.bias"]
    assert bias.shape == (model.num_classes,)
    assert sd[f"{model.output_layer}.weight"].shape[0] == model.num_classes


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_num_classes_changes_the_head(name):
    model = build_model(name, num_classes=7, input_shape=(1, 28, 28))
    assert model.num_classes == 7
    assert model.state_dict()[f"{model.output_layer}.bias"].shape == (7,)
    with torch.no_grad():
        assert model.eval()(_sample(model)).shape == (2, 7)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_features_feed_the_head(model_cache, name):
    model = model_cache(name)
    x = _sample(model, n=3)
    with torch.no_grad():
        feats = model.features(x)
        logits = model(x)
        assert feats.dim() == 2 and feats.shape[0] == 3
        after = model.block_names().index(model.feature_block) + 1
        head_out = model.forward_blocks(feats, after, len(model.blocks))
    assert torch.allclose(head_out, logits, atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------ portions
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_portion_keys_match_state_dict(model_cache, name):
    model = model_cache(name)
    n = len(model.blocks)
    full_keys = list(model.state_dict().keys())
    for k in model.split_points:
        client, server = model.portion(0, k), model.portion(k, n)
        assert isinstance(client, Portion) and (client.start, client.end) == (0, k)
        ck, sk = list(client.state_dict().keys()), list(server.state_dict().keys())
        assert ck + sk == full_keys
        assert ck == model.portion_keys(0, k)
        assert sk == model.portion_keys(k, n)
    assert model.portion_keys(0, n) == full_keys
    # buffers are included (BatchNorm models)
    if any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        assert any(key.endswith("running_mean") for key in model.portion_keys(0, n))


def test_portion_shares_parameters():
    model = build_model("resnet8")
    k = model.split_points[1]
    server = model.portion(k, len(model.blocks))
    name = next(iter(server.state_dict()))
    assert server.blocks[model.block_names()[k]] is model.blocks[model.block_names()[k]]
    with torch.no_grad():
        next(server.parameters()).add_(1.0)
    assert torch.equal(server.state_dict()[name], model.state_dict()[name])
    # loading into a portion updates the full model too
    new = {key: torch.zeros_like(v) for key, v in server.state_dict().items()}
    server.load_state_dict(new)
    assert all(torch.count_nonzero(model.state_dict()[key]) == 0 for key in new)


def test_bad_ranges_and_construction():
    model = build_model("cnn")
    with pytest.raises(IndexError):
        model.portion(2, 1)
    with pytest.raises(IndexError):
        model.forward_blocks(_sample(model), 0, len(model.blocks) + 1)
    blocks = {"a": nn.Flatten(), "b": nn.Linear(784, 10)}
    with pytest.raises(ValueError):
        SplitModel(blocks, (1, 1), "a", "blocks.b", (1, 28, 28), 10)
    with pytest.raises(ValueError):
        SplitModel(blocks, (2,), "a", "blocks.b", (1, 28, 28), 10)
    with pytest.raises(ValueError):
        SplitModel(blocks, (1,), "nope", "blocks.b", (1, 28, 28), 10)
    with pytest.raises(ValueError):
        SplitModel(blocks, (1,), "a", "blocks.a", (1, 28, 28), 10)


# ------------------------------------------------------------------------------------ zoo
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_seeded_init_is_deterministic_and_leaves_global_rng(model_cache, name):
    reference = model_cache(name)  # seed 0, default shape
    rng_before = torch.get_rng_state()
    same = build_model(name, seed=0)
    other = build_model(name, seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)
    a, b, c = reference.state_dict(), same.state_dict(), other.state_dict()
    assert list(a) == list(b) == list(c)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert any(not torch.equal(a[key], c[key]) for key in a)


def test_models_built_on_several_threads_at_once_are_each_the_model_built_alone():
    # An agent's devices build on their own threads; each build seeds the process's one CPU
    # generator. Built at once, they seeded each other's builds (every build differed) and, on the
    # meta device, could deadlock in torch's generator lock.
    alone = {seed: build_model("cnn", seed=seed).state_dict() for seed in range(4)}
    differed: list[int] = []

    def build(seed: int) -> None:
        for _ in range(3):
            build_model_layout("cnn", seed=seed)
            state = build_model("cnn", seed=seed).state_dict()
            if not all(torch.equal(state[k], alone[seed][k]) for k in state):
                differed.append(seed)

    threads = [threading.Thread(target=build, args=(i % 4,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a build never finished"
    assert differed == []


def test_unknown_model_lists_valid_names():
    with pytest.raises(ValueError) as err:
        build_model("alexnet")
    for name in MODEL_NAMES:
        assert name in str(err.value)


def test_default_input_shapes():
    assert build_model("cnn").input_shape == (1, 28, 28)
    assert build_model("resnet8").input_shape == (3, 32, 32)


# ------------------------------------------------------------------------------------ profile
@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_profile_is_consistent(model_cache, profiles, name):
    model, prof = model_cache(name), profiles[name]
    assert isinstance(prof, ModelProfile) and prof.model == name
    assert tuple(s.k for s in prof.splits) == model.split_points
    n_float = sum(p.numel() for p in model.parameters())
    n_float += sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert prof.total_param_bytes == 4 * n_float
    x1 = torch.zeros((1, *model.input_shape))
    previous = -1.0
    for s in prof.splits:
        assert isinstance(s, SplitCost) and prof.cost(s.k) is s
        assert s.client_param_bytes + s.server_param_bytes == prof.total_param_bytes
        assert s.client_flops + s.server_flops == pytest.approx(prof.total_flops, rel=1e-9)
        assert s.client_flops > previous and s.client_flops > 0 and s.server_flops > 0
        previous = s.client_flops
        with torch.no_grad():
            assert s.activation_bytes == 4 * model.forward_blocks(x1, 0, s.k).numel()
    with pytest.raises(KeyError):
        prof.cost(0)


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_profile_counts_backward(model_cache, profiles, name):
    """Training FLOPs are forward + backward: between 2x and 3x the forward FLOPs.

    (The first layer computes no input gradient, so the total is a little under 3x; this also
    guards the depthwise-conv backward fix, which torch's built-in formula overcounts ~10x.)
    """
    model = model_cache(name)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.zeros((1, *model.input_shape)))
    forward = counter.get_total_flops()
    assert 2.0 * forward < profiles[name].total_flops <= 3.0 * forward


def test_profile_has_no_side_effects():
    model = build_model("resnet8").train()
    before = copy.deepcopy(model.state_dict())
    profile_model(model)
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[key], after[key]) for key in before)


@pytest.mark.parametrize("name", SPLIT_MODELS)
def test_split_training_step_matches_full_backward(name):
    """Client/server training through a detached activation gives the full model's gradients.

    This is how split learning runs (the server receives the activation as a leaf and returns its
    gradient); it also checks that no block modifies its input in place.
    """
    model = build_model(name, input_shape=(1, 28, 28)).eval()
    x, y = _sample(model), torch.tensor([1, 2])
    n = len(model.blocks)
    nn.functional.cross_entropy(model(x), y).backward()
    full_grads = {key: p.grad.clone() for key, p in model.named_parameters()}
    k = model.split_points[1]
    model.zero_grad(set_to_none=True)
    act = model.portion(0, k)(x)
    leaf = act.detach().requires_grad_()
    nn.functional.cross_entropy(model.portion(k, n)(leaf), y).backward()
    assert leaf.grad is not None and leaf.grad.shape == act.shape
    act.backward(leaf.grad)
    for key, p in model.named_parameters():
        assert torch.allclose(p.grad, full_grads[key], atol=1e-5, rtol=1e-3), key
