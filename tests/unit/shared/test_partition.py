"""Partition tests: determinism, completeness/disjointness, skew vs alpha, whole writers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.data import (
    ArrayDataset,
    DataSpec,
    device_shard,
    load_dataset,
    partition_dataset,
    partition_dirichlet,
    partition_iid,
    partition_natural,
)
from shared.data.partition import release_loaded_data


def _assert_complete_disjoint(parts: list[np.ndarray], n: int) -> None:
    assert all(p.dtype == np.int64 for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(n))


def _labels(n_per_class: int = 100, classes: int = 10) -> np.ndarray:
    return np.repeat(np.arange(classes), n_per_class)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _mean_entropy(parts: list[np.ndarray], labels: np.ndarray, classes: int = 10) -> float:
    ents = []
    for p in parts:
        c = np.bincount(labels[p], minlength=classes).astype(float)
        q = c[c > 0] / c.sum()
        ents.append(-(q * np.log(q)).sum())
    return float(np.mean(ents))


def test_iid_complete_balanced_deterministic() -> None:
    parts = partition_iid(1003, 10, seed=1)
    _assert_complete_disjoint(parts, 1003)
    assert {len(p) for p in parts} <= {100, 101}
    assert _same(parts, partition_iid(1003, 10, seed=1))
    assert not _same(parts, partition_iid(1003, 10, seed=2))


def test_dirichlet_complete_deterministic_min_size() -> None:
    labels = _labels()
    parts = partition_dirichlet(labels, 10, alpha=0.5, seed=3, min_size=5)
    _assert_complete_disjoint(parts, labels.size)
    assert min(len(p) for p in parts) >= 5
    assert _same(parts, partition_dirichlet(labels, 10, alpha=0.5, seed=3, min_size=5))
    assert not _same(parts, partition_dirichlet(labels, 10, alpha=0.5, seed=4, min_size=5))


def test_dirichlet_small_alpha_more_skewed() -> None:
    labels = _labels()
    skewed = partition_dirichlet(labels, 10, alpha=0.1, seed=0)
    flat = partition_dirichlet(labels, 10, alpha=100.0, seed=0)
    _assert_complete_disjoint(skewed, labels.size)
    _assert_complete_disjoint(flat, labels.size)
    assert _mean_entropy(skewed, labels) < _mean_entropy(flat, labels) - 0.5
    assert _mean_entropy(flat, labels) > 0.9 * np.log(10)


def test_natural_keeps_writers_whole() -> None:
    rng = np.random.default_rng(0)
    writers = [f"w{int(i)}" for i in rng.integers(0, 23, size=500)]
    parts = partition_natural(writers, 5, seed=7)
    _assert_complete_disjoint(parts, len(writers))
    owner: dict[str, int] = {}
    for d, p in enumerate(parts):
        assert len(p) > 0
        for i in p:
            assert owner.setdefault(writers[i], d) == d  # no writer on two devices
    assert _same(parts, partition_natural(writers, 5, seed=7))
    assert not _same(parts, partition_natural(writers, 5, seed=8))


@pytest.mark.parametrize(
    "call",
    [
        lambda: partition_iid(5, 6, 0),
        lambda: partition_iid(5, 0, 0),
        lambda: partition_dirichlet(_labels(), 10, alpha=0.0, seed=0),
        lambda: partition_dirichlet(_labels(), 10, alpha=-1.0, seed=0),
        lambda: partition_dirichlet(np.zeros(5, np.int64), 6, alpha=1.0, seed=0),
        lambda: partition_dirichlet(_labels(), 10, alpha=1.0, seed=0, min_size=200),
        lambda: partition_natural(["a", "b", "a"], 3, 0),
    ],
)
def test_bad_arguments_raise_value_error(call) -> None:
    with pytest.raises(ValueError):
        call()


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        DataSpec(alpha=0)
    with pytest.raises(ValueError):
        DataSpec(num_devices=0)
    with pytest.raises(ValueError):
        DataSpec(dataset="mnist", partition="natural")
    with pytest.raises(ValueError):
        DataSpec(bogus=1)  # extra="forbid"


def _toy(n: int = 200, writers: bool = False) -> ArrayDataset:
    y = torch.arange(n) % 10
    return ArrayDataset(
        x=torch.randn(n, 1, 28, 28),
        y=y.long(),
        num_classes=10,
        writers=[f"u{i % 13}" for i in range(n)] if writers else None,
    )


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_partition_dataset_and_device_shard(partition: str) -> None:
    train = _toy()
    spec = DataSpec(partition=partition, num_devices=4, seed=1)
    parts = partition_dataset(spec, train)
    _assert_complete_disjoint(parts, len(train))
    shards = [device_shard(spec, train, i) for i in range(4)]
    assert sum(len(s) for s in shards) == len(train)
    for s, p in zip(shards, parts):
        assert torch.equal(s.y, train.y[torch.from_numpy(p)])
    for bad in (-1, 4):
        with pytest.raises(ValueError):
            device_shard(spec, train, bad)


def test_natural_partition_dataset_uses_writers() -> None:
    train = _toy(writers=True)
    spec = DataSpec(dataset="femnist", partition="natural", num_devices=3)
    shards = [device_shard(spec, train, i) for i in range(3)]
    assert sum(len(s) for s in shards) == len(train)
    sets = [set(s.writers or []) for s in shards]
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    with pytest.raises(ValueError):
        partition_dataset(spec, _toy(writers=False))


def test_released_data_is_loaded_afresh_and_its_partition_computed_again():
    # What the Fed Server does once its start-up needs of the training set are met.
    spec = DataSpec(dataset="synthetic", num_devices=12, partition="natural", seed=4)
    train, _ = load_dataset(spec)
    first = device_shard(spec, train, 3)
    assert load_dataset(spec)[0].x is train.x            # cached
    release_loaded_data()
    again, _ = load_dataset(spec)
    assert again.x is not train.x and torch.equal(again.x, train.x)
    assert torch.equal(device_shard(spec, again, 3).x, first.x)
