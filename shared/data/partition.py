"""Split a training set over federated devices: IID, Dirichlet label skew, or natural (by writer).

Every function is a pure function of its arguments and seed (numpy ``Generator(seed)``), so each
process (server or device agent) recomputes exactly the same shards from the ``DataSpec`` alone.
Each returns one sorted int64 index array per device; together they cover every sample once.
"""
from __future__ import annotations

import numpy as np

from shared.data.datasets import ArrayDataset
from shared.data.spec import DataSpec

__all__ = [
    "partition_iid",
    "partition_dirichlet",
    "partition_natural",
    "partition_dataset",
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


def partition_natural(writers: list[str], num_devices: int, seed: int) -> list[np.ndarray]:
    """Assign whole writers to devices (LEAF-style): writers shuffled, then dealt out in
    near-equal groups, so each device holds all samples of its writers and no one else's."""
    writers_arr = np.asarray(list(writers), dtype=object)
    unique, inverse = np.unique(writers_arr.astype(str), return_inverse=True)
    if int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"num_devices must be an integer >= 1, got {num_devices!r}")
    if unique.size < num_devices:
        raise ValueError(
            f"natural partition needs at least as many writers as devices: "
            f"{unique.size} writers < {num_devices} devices"
        )
    order = np.random.default_rng(seed).permutation(unique.size)  # writer ids, shuffled
    device_of_writer = np.empty(unique.size, dtype=np.int64)
    for d, group in enumerate(np.array_split(order, num_devices)):
        device_of_writer[group] = d
    device_of_sample = device_of_writer[inverse.reshape(-1)]
    return [np.flatnonzero(device_of_sample == d).astype(np.int64) for d in range(num_devices)]


def partition_dataset(spec: DataSpec, train: ArrayDataset) -> list[np.ndarray]:
    """Partition ``train`` as ``spec`` says (method, alpha, num_devices, seed)."""
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
    return _shard(spec, train, partition_dataset(spec, train), int(device_index))


def device_shards(spec: DataSpec, train: ArrayDataset) -> list[ArrayDataset]:
    """Every device's training data under ``spec``, partitioning once (``device_shard`` for each)."""
    parts = partition_dataset(spec, train)
    return [_shard(spec, train, parts, i) for i in range(len(parts))]


def _shard(spec: DataSpec, train: ArrayDataset, parts: list[np.ndarray], device_index: int) -> ArrayDataset:
    """Device ``device_index``'s part of ``train``, its per-device transform applied."""
    from shared.data.device_transforms import apply_device_transform

    return apply_device_transform(spec.device_transform, train.subset(parts[device_index]), device_index,
                                  spec.num_devices, spec.device_transform_params, spec.seed)
