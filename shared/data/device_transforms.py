"""Per-device feature transforms: how a device's shard differs in *features* from the others.

Label skew comes from the partitioner; feature skew (noise levels, rotations, colours: FNR-FL's
and FedIPG's experiments) comes from a transform applied to one device's shard, chosen by name in
``DataSpec.device_transform``. Every process applies the same transform to the same shard, so the
skew is reproducible from the spec alone.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shared.data.datasets import ArrayDataset
from shared.data.domains import color_transform, rotation_transform
from shared.data.feature_skew import gaussian_noise

#: transform(shard, device_index, num_devices, params, seed) -> transformed shard
DeviceTransform = Callable[[ArrayDataset, int, int, dict[str, Any], int], ArrayDataset]


def _identity(shard: ArrayDataset, device_index: int, num_devices: int, params: dict[str, Any], seed: int) -> ArrayDataset:
    return shard


DEVICE_TRANSFORMS: dict[str, DeviceTransform] = {
    "none": _identity,
    "gaussian_noise": gaussian_noise,
    "rotation": rotation_transform,
    "color": color_transform,
}


def apply_device_transform(name: str, shard: ArrayDataset, device_index: int, num_devices: int,
                           params: dict[str, Any], seed: int) -> ArrayDataset:
    """Apply transform ``name`` to device ``device_index``'s shard."""
    try:
        transform = DEVICE_TRANSFORMS[name]
    except KeyError:
        raise ValueError(f"unknown device_transform {name!r}; choose one of {sorted(DEVICE_TRANSFORMS)}") from None
    return transform(shard, device_index, num_devices, params, seed)
