"""The partition is computed once per process: every device's shard is cut from one partition, the
same shards as computing it for each device, and a different training set is never given another's."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from shared.data import ArrayDataset, DataSpec, device_shard, load_dataset, partition_dataset
from shared.data import partition as partition_module

DEVICES = 12

SPECS = {
    "iid": DataSpec(partition="iid", num_devices=DEVICES, seed=3),
    "dirichlet": DataSpec(partition="dirichlet", alpha=0.5, num_devices=DEVICES, seed=3),
    "natural": DataSpec(dataset="femnist", partition="natural", num_devices=DEVICES, seed=3),
}
FUNCTIONS = {"iid": "partition_iid", "dirichlet": "partition_dirichlet", "natural": "partition_natural"}


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    partition_module._PARTITIONS.clear()
    yield
    partition_module._PARTITIONS.clear()


def _train(n: int = 600, seed: int = 0) -> ArrayDataset:
    rng = np.random.default_rng(seed)
    return ArrayDataset(x=torch.randn(n, 1, 2, 2), y=torch.from_numpy(rng.integers(0, 10, n)), num_classes=10,
                        writers=[f"w{int(i)}" for i in rng.integers(0, 40, n)])


def _copy(train: ArrayDataset) -> ArrayDataset:
    """What each ``load_dataset`` call hands a device: a new object around the same data."""
    return ArrayDataset(x=train.x, y=train.y, num_classes=train.num_classes, writers=train.writers)


def _count_calls(monkeypatch: pytest.MonkeyPatch, method: str) -> list[int]:
    calls: list[int] = []
    original: Callable[..., list[np.ndarray]] = getattr(partition_module, FUNCTIONS[method])

    def counted(*args: object, **kwargs: object) -> list[np.ndarray]:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(partition_module, FUNCTIONS[method], counted)
    return calls


def _natural_by_scan(writers: list[str], num_devices: int, seed: int) -> list[np.ndarray]:
    """The natural partition as docs/builtin-data.md states it, one scan over the samples per device."""
    ids = sorted(set(writers))
    order = np.random.default_rng(seed).permutation(len(ids))
    device_of = {ids[int(w)]: d for d, piece in enumerate(np.array_split(order, num_devices)) for w in piece}
    owner = np.asarray([device_of[w] for w in writers])
    return [np.flatnonzero(owner == d) for d in range(num_devices)]


def _expected(method: str, train: ArrayDataset) -> list[np.ndarray]:
    spec = SPECS[method]
    if method == "iid":
        return partition_module.partition_iid(len(train), DEVICES, spec.seed)
    if method == "dirichlet":
        return partition_module.partition_dirichlet(train.y.numpy(), DEVICES, spec.alpha, spec.seed)
    assert train.writers is not None
    return _natural_by_scan(train.writers, DEVICES, spec.seed)


@pytest.mark.parametrize("method", list(SPECS))
def test_one_partition_for_every_shard_with_the_same_indices(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    train = _train()
    expected = _expected(method, train)
    calls = _count_calls(monkeypatch, method)
    for d in range(DEVICES):
        shard = device_shard(SPECS[method], _copy(train), d)
        assert torch.equal(shard.y, train.y[torch.from_numpy(expected[d])])
        assert torch.equal(shard.x, train.x[torch.from_numpy(expected[d])])
    assert [p.tolist() for p in partition_dataset(SPECS[method], _copy(train))] == [e.tolist() for e in expected]
    assert len(calls) == 1


@pytest.mark.parametrize("method", list(SPECS))
def test_device_threads_starting_together_compute_it_once(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    train = _train()
    calls = _count_calls(monkeypatch, method)
    start = threading.Barrier(DEVICES)
    sizes: dict[int, int] = {}

    def device(d: int) -> None:
        start.wait()
        sizes[d] = len(device_shard(SPECS[method], _copy(train), d))

    threads = [threading.Thread(target=device, args=(d,)) for d in range(DEVICES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert [sizes[d] for d in range(DEVICES)] == [len(e) for e in _expected(method, train)]


def test_another_training_set_is_partitioned_afresh(monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = _train(seed=0), _train(seed=1)
    calls = _count_calls(monkeypatch, "natural")
    spec = SPECS["natural"]
    device_shard(spec, first, 0)
    assert torch.equal(device_shard(spec, second, 0).y, second.y[torch.from_numpy(_expected("natural", second)[0])])
    # An equal training set in other objects is another training set.
    twin = ArrayDataset(x=first.x, y=first.y.clone(), num_classes=10, writers=list(first.writers or []))
    device_shard(spec, twin, 0)
    assert len(calls) == 3
    # Other partition parameters are another partition.
    device_shard(spec.model_copy(update={"seed": 4}), first, 0)
    assert len(calls) == 4


def test_partition_dataset_hands_out_copies() -> None:
    train = _train()
    parts = partition_dataset(SPECS["iid"], train)
    kept = parts[0].copy()
    parts[0][:] = -1
    parts.clear()
    assert partition_dataset(SPECS["iid"], train)[0].tolist() == kept.tolist()
    assert len(device_shard(SPECS["iid"], train, 0)) == kept.size


def test_load_dataset_copies_share_one_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = DataSpec(dataset="synthetic", partition="natural", num_devices=30, seed=1)
    calls = _count_calls(monkeypatch, "natural")
    shards = [device_shard(spec, load_dataset(spec)[0], d) for d in range(30)]
    assert len(calls) == 1
    assert sum(len(s) for s in shards) == len(load_dataset(spec)[0])
