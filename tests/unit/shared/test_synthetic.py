"""Synthetic(alpha, beta) generator (docs/algorithms/fedbc.md#synthetic-generator check values), its wiring as
``DataSpec.dataset="synthetic"``, and the ``logreg`` zoo model."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from shared.run_config import resolve_run_config
from shared.data import DataSpec, dataset_input_shape, dataset_num_classes, device_shard, load_dataset
from shared.data.synthetic import generate_raw, generate_synthetic
from shared.models import build_model

ROOT = Path(__file__).resolve().parents[3]

PAPER_SIZES = [1456, 66, 68, 56, 358, 50, 1839, 61, 153, 83, 1066, 50, 78, 75, 577, 56, 88, 59, 109, 225, 56, 588,
               381, 199, 380, 63, 92, 58, 81, 207]
PAPER_LABELS = [494, 716, 2779, 580, 149, 404, 1125, 1398, 450, 583]


# ------------------------------------------------------------------------------------ generator
def test_check_values_seed_1():
    gen = generate_synthetic(30, 0.5, 0.5, False, 1)
    assert gen.samples_per_device.tolist() == PAPER_SIZES
    assert int(gen.samples_per_device.sum()) == 8678
    labels = np.concatenate(gen.y_train + gen.y_test)
    assert np.bincount(labels, minlength=10).tolist() == PAPER_LABELS
    assert [len(y) for y in gen.y_train][:4] == [1164, 52, 54, 44]
    assert sum(len(y) for y in gen.y_train) == 6929 and sum(len(y) for y in gen.y_test) == 1749
    for x, y, n in zip(gen.x_train, gen.y_train, PAPER_SIZES):
        assert x.shape == (len(y), 60) and len(y) == int(0.8 * n)


def test_labels_are_the_teachers_argmax_and_split_is_a_shuffle():
    xs, ys, sizes, teachers = generate_raw(5, 0.5, 0.5, False, 3)
    for x, y, (w, b) in zip(xs, ys, teachers):
        assert np.array_equal(y, np.argmax(x @ w + b, axis=1))
    gen = generate_synthetic(5, 0.5, 0.5, False, 3)
    for i in range(5):
        both = np.concatenate([gen.x_train[i], gen.x_test[i]])
        assert sorted(map(tuple, both.tolist())) == sorted(map(tuple, xs[i].tolist()))  # same rows, shuffled


def test_iid_shares_one_teacher_and_non_iid_does_not():
    _, _, _, teachers = generate_raw(6, 0.5, 0.5, True, 1)
    assert all(np.array_equal(w, teachers[0][0]) and np.array_equal(b, teachers[0][1]) for w, b in teachers)
    _, _, _, teachers = generate_raw(6, 0.5, 0.5, False, 1)
    assert not np.array_equal(teachers[0][0], teachers[1][0])


def test_generator_leaves_global_rngs_alone_and_validates():
    import random

    np.random.seed(5)
    random.seed(5)
    before_np, before_py = np.random.get_state()[1].copy(), random.getstate()
    generate_synthetic(7, 0.5, 0.5, False, 11)
    assert np.array_equal(np.random.get_state()[1], before_np) and random.getstate() == before_py
    with pytest.raises(ValueError):
        generate_synthetic(0)
    with pytest.raises(ValueError):
        generate_synthetic(3, alpha=-1.0)


def _shard_digest(num_devices: int, index: int) -> str:
    spec = DataSpec(dataset="synthetic", partition="natural", num_devices=num_devices, seed=1)
    shard = device_shard(spec, load_dataset(spec)[0], index)
    return hashlib.sha256(shard.x.numpy().tobytes() + shard.y.numpy().tobytes()).hexdigest()


def test_two_processes_derive_identical_shards():
    code = ("import sys; sys.path.insert(0, %r); from tests.unit.shared.test_synthetic import _shard_digest; "
            "print(_shard_digest(30, 4))" % str(ROOT))
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert other.stdout.strip() == _shard_digest(30, 4)


# ------------------------------------------------------------------------------------ DataSpec wiring
def test_dataset_wiring_natural_partition_gives_each_shard_one_generated_device():
    spec = DataSpec(dataset="synthetic", partition="natural", num_devices=30, seed=1)
    assert dataset_num_classes(spec) == 10 and dataset_input_shape(spec) == (1, 1, 60)
    train, test = load_dataset(spec)
    assert train.x.shape == (6929, 1, 1, 60) and test.x.shape == (1749, 1, 1, 60)
    assert train.x.dtype == torch.float32 and train.y.dtype == torch.int64
    assert set(train.writers) == {str(i) for i in range(30)}
    gen = generate_synthetic(30, 0.5, 0.5, False, 1)
    seen = set()
    for index in range(30):
        shard = device_shard(spec, train, index)
        writer = int(set(shard.writers).pop())
        assert set(shard.writers) == {str(writer)}
        assert torch.equal(shard.y, torch.from_numpy(gen.y_train[writer]))
        assert torch.allclose(shard.x.reshape(-1, 60), torch.from_numpy(gen.x_train[writer]).float())
        seen.add(writer)
    assert seen == set(range(30))


def test_spec_fields_and_validation():
    DataSpec(dataset="synthetic", partition="natural")  # allowed now
    with pytest.raises(ValueError):
        DataSpec(dataset="mnist", partition="natural")
    spec = DataSpec(dataset="synthetic", partition="iid", num_devices=4, synthetic_alpha=1.0, synthetic_beta=0.0,
                    synthetic_iid=True, seed=2)
    train, _ = load_dataset(spec)
    assert len(train) == sum(int(0.8 * n) for n in generate_synthetic(4, 1.0, 0.0, True, 2).samples_per_device)
    with pytest.raises(ValueError, match="transform"):
        load_dataset(DataSpec(dataset="synthetic", transform="rgb32"))
    with pytest.raises(ValueError):
        DataSpec(dataset="synthetic", synthetic_alpha=-0.1)
    small = load_dataset(DataSpec(dataset="synthetic", num_devices=5, max_samples=100, seed=1))[0]
    assert len(small) == 100 and small.writers is not None


def test_run_config_accepts_the_paper_setup():
    config = resolve_run_config(overrides=["algorithm=fedbc", "model=logreg", "data.dataset=synthetic",
                                           "data.partition=natural", "data.num_devices=30", "devices_per_round=10"])
    assert config.model == "logreg" and config.data.dataset == "synthetic"


# ------------------------------------------------------------------------------------ logreg
def test_logreg_is_multinomial_logistic_regression():
    model = build_model("logreg", 10, (1, 1, 60), seed=0)
    assert model.input_shape == (1, 1, 60) and len(model.split_points) == 3
    params = dict(model.named_parameters())
    assert set(params) == {"blocks.head.weight", "blocks.head.bias"}
    assert params["blocks.head.weight"].shape == (10, 60) and params["blocks.head.bias"].shape == (10,)
    assert list(model.buffers()) == []
    # PyTorch's default Linear init, seeded like every zoo model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        reference = nn.Linear(60, 10)
    assert torch.equal(params["blocks.head.weight"], reference.weight)
    assert torch.equal(params["blocks.head.bias"], reference.bias)
    x = torch.randn(5, 1, 1, 60)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x.reshape(5, 60)))
        assert torch.equal(model.features(x), x.reshape(5, 60))
        for k in model.split_points:  # placeholder cuts: everything before the head is the identity
            assert torch.equal(model.forward_blocks(x, 0, k), x.reshape(5, 60))
    assert model.output_layer == "blocks.head"


def test_logreg_builds_for_image_shapes_too():
    model = build_model("logreg", 10, (1, 28, 28))
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert build_model("logreg").input_shape == (1, 1, 60)
