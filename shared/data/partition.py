"""Split a training set over federated devices: IID, Dirichlet label skew, or natural (by writer).

Every function is a pure function of its arguments and seed (numpy ``Generator(seed)``), so each
process (server or device agent) recomputes exactly the same shards from the ``DataSpec`` alone.
Each returns one sorted int64 index array per device; together they cover every sample once.
A partition is computed once per process and every device's shard is cut from it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from shared.data.datasets import ArrayDataset
from shared.data.spec import DataSpec

__all__ = [
    "partition_iid",
    "partition_dirichlet",
    "partition_natural",
    "partition_dataset",
    "partition_sizes",
    "device_shard",
    "device_shards",
]

_DIRICHLET_MAX_TRIES = 1000


def _check_devices(num_devices: int, num_samples: int) -> None:
    if int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if num_devices > num_samples:
        raise ValueError(
            f"cannot split {num_samples} samples over {num_devices} devices: more devices than samples"
        )


def partition_iid(num_samples: int, num_devices: int, seed: int) -> list[np.ndarray]:
    """Shuffle all samples and deal them out in equal-size (+-1) shards."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    _check_devices(num_devices, num_samples)
    perm = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(part).astype(np.int64) for part in np.array_split(perm, num_devices)]


def partition_dirichlet(
    labels: np.ndarray, num_devices: int, alpha: float, seed: int, min_size: int = 1
) -> list[np.ndarray]:
    """Label-skewed split (Hsu et al. 2019): each class is divided over devices in
    Dirichlet(alpha) proportions. Small alpha = each device sees few classes; large = near IID.

    Proportions are redrawn until every device holds at least ``min_size`` samples; after
    ``_DIRICHLET_MAX_TRIES`` draws a ValueError suggests a larger alpha or fewer devices.
    """
    labels = np.asarray(labels).reshape(-1)
    n = labels.shape[0]
    if not alpha > 0:
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha!r}")
    _check_devices(num_devices, n)
    if min_size < 0:
        raise ValueError(f"min_size must be >= 0, got {min_size}")
    if min_size * num_devices > n:
        raise ValueError(
            f"cannot give {num_devices} devices at least {min_size} samples each from {n} samples"
        )
    rng = np.random.default_rng(seed)
    # Shuffle within each class once; only the split proportions are redrawn on retries.
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    for _ in range(_DIRICHLET_MAX_TRIES):
        cuts = []
        sizes = np.zeros(num_devices, dtype=np.int64)
        for idx in by_class:
            p = rng.dirichlet(np.full(num_devices, float(alpha)))
            cut = (np.cumsum(p)[:-1] * idx.size).astype(np.int64)
            cuts.append(cut)
            sizes += np.diff(np.concatenate(([0], cut, [idx.size])))
        if sizes.min() >= min_size:
            shards: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
            for idx, cut in zip(by_class, cuts):
                for d, part in enumerate(np.split(idx, cut)):
                    shards[d].append(part)
            return [
                np.sort(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64)
                for parts in shards
            ]
    raise ValueError(
        f"Dirichlet partition: no draw in {_DIRICHLET_MAX_TRIES} tries gave every one of "
        f"{num_devices} devices >= {min_size} samples (alpha={alpha}); use a larger alpha or "
        f"fewer devices"
    )


def partition_natural(writers: Sequence[str], num_devices: int, seed: int) -> list[np.ndarray]:
    """Assign whole writers to devices (LEAF-style): writers shuffled, then dealt out in
    near-equal groups, so each device holds all samples of its writers and no one else's."""
    if int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    # Each sample's writer as a number (in order of first appearance), then as the writer's rank
    # among the ids sorted as strings. One small array per step: a training set of millions of
    # samples from few writers (Synthetic at 10,000 devices) is not copied into arrays of strings.
    codes: dict[str, int] = {}
    first_seen = np.fromiter((codes.setdefault(str(w), len(codes)) for w in writers), dtype=np.int32,
                             count=len(writers))
    names = list(codes)
    if len(names) < num_devices:
        raise ValueError(
            f"natural partition needs at least as many writers as devices: "
            f"{len(names)} writers < {num_devices} devices"
        )
    rank = np.empty(len(names), dtype=np.int64)
    rank[sorted(range(len(names)), key=names.__getitem__)] = np.arange(len(names))
    order = np.random.default_rng(seed).permutation(len(names))  # writer ids (by rank), shuffled
    device_of_writer = np.empty(len(names), dtype=np.int32)
    for d, group in enumerate(np.array_split(order, num_devices)):
        device_of_writer[group] = d
    device_of_sample = device_of_writer[rank[first_seen]]
    del first_seen
    # A stable sort keeps each device's samples ascending: one pass, not one scan per device.
    by_device = np.argsort(device_of_sample, kind="stable").astype(np.int64)
    ends = np.cumsum(np.bincount(device_of_sample, minlength=num_devices))[:-1]
    return np.split(by_device, ends)


#: Partitions kept by ``_shared_partition``: (key, (the objects the key names, the shards)).
_PARTITIONS: OrderedDict[tuple[Any, ...], tuple[tuple[object, ...], list[np.ndarray]]] = OrderedDict()
_PARTITIONS_KEPT = 4
_PARTITIONS_LOCK = threading.Lock()


def partition_dataset(spec: DataSpec, train: ArrayDataset) -> list[np.ndarray]:
    """Partition ``train`` as ``spec`` says (method, alpha, num_devices, seed): the caller's own
    copy of the partition :func:`_shared_partition` computes once per process."""
    return [shard.copy() for shard in _shared_partition(spec, train)]


def partition_sizes(spec: DataSpec, train: ArrayDataset) -> list[int]:
    """How many samples each shard of ``train``'s partition under ``spec`` holds (no copies)."""
    return [len(shard) for shard in _shared_partition(spec, train)]


def _shared_partition(spec: DataSpec, train: ArrayDataset) -> list[np.ndarray]:
    """``train``'s partition under ``spec``, computed once per process for each (partition
    parameters, training set), as read-only arrays shared between callers (the list is the caller's).

    An agent's device threads each ask for their own shard of the same partition, and computing it
    for each made starting N devices cost O(N^2). The training set is recognised by the identity of
    what a partition reads, its label tensor and its writer list (the copies ``load_dataset``
    returns share them), and by its length; the cache holds those objects, so while an entry lives
    no other training set can take their ids, and a different training set object (even an equal
    one) is partitioned afresh. The last four partitions are kept; concurrent first calls compute
    once. Treat the training set as read-only (as ``load_dataset``'s are): a partition is not
    recomputed when its labels are changed in place.
    """
    held: tuple[object, ...] = (train.y, train.writers)
    key = (spec.partition, spec.num_devices, spec.seed, float(spec.alpha), len(train), *map(id, held))
    with _PARTITIONS_LOCK:
        entry = _PARTITIONS.get(key)
        if entry is None:
            shards = _partition(spec, train)
            for shard in shards:
                shard.flags.writeable = False
            entry = _PARTITIONS[key] = (held, shards)
            while len(_PARTITIONS) > _PARTITIONS_KEPT:
                _PARTITIONS.popitem(last=False)
        _PARTITIONS.move_to_end(key)
        return list(entry[1])


def release_loaded_data() -> None:
    """Drop this process's cached data sets (``load_dataset``) and partitions. A process that
    needs the whole training set only at start-up (the Fed Server: its shard sizes and the
    fingerprint's shard vectors) lets it go; a later ``load_dataset`` loads or generates it again.
    Data sets a caller still holds stay as they are."""
    from shared.data.datasets import forget_loaded_data

    forget_loaded_data()
    with _PARTITIONS_LOCK:
        _PARTITIONS.clear()


def _partition(spec: DataSpec, train: ArrayDataset) -> list[np.ndarray]:
    """``partition_dataset`` computed anew."""
    if spec.partition == "iid":
        return partition_iid(len(train), spec.num_devices, spec.seed)
    if spec.partition == "dirichlet":
        return partition_dirichlet(train.y.numpy(), spec.num_devices, spec.alpha, spec.seed)
    if spec.partition == "natural":
        if train.writers is None:
            raise ValueError("partition='natural' needs per-sample writer ids (FEMNIST only)")
        return partition_natural(train.writers, spec.num_devices, spec.seed)
    raise ValueError(f"unknown partition {spec.partition!r}")


def device_shard(spec: DataSpec, train: ArrayDataset, device_index: int) -> ArrayDataset:
    """The training data of device ``device_index`` (0-based) under ``spec``'s partition."""
    if isinstance(device_index, bool) or int(device_index) != device_index or not (
        0 <= device_index < spec.num_devices
    ):
        raise ValueError(
            f"device_index {device_index!r} out of range: must be in [0, {spec.num_devices})"
        )
    return _shard(spec, train, _shared_partition(spec, train), int(device_index))


def device_shards(spec: DataSpec, train: ArrayDataset) -> Iterator[ArrayDataset]:
    """Every device's training data under ``spec`` (``device_shard`` for each), one at a time: a
    caller that looks at each in turn never holds a second copy of the whole training set."""
    parts = _shared_partition(spec, train)
    return (_shard(spec, train, parts, i) for i in range(len(parts)))


def _shard(spec: DataSpec, train: ArrayDataset, parts: list[np.ndarray], device_index: int) -> ArrayDataset:
    """Device ``device_index``'s part of ``train``, its per-device transform applied."""
    from shared.data.device_transforms import apply_device_transform

    shard = train.subset(parts[device_index].copy())   # its own indices: the cached partition stays as it is
    return apply_device_transform(spec.device_transform, shard, device_index, spec.num_devices,
                                  spec.device_transform_params, spec.seed)
