"""Per-device feature transforms: how a device's shard differs in *features* from the others.

Label skew comes from the partitioner; feature skew (noise levels, rotations, colours: FNR-FL's
and FedIPG's experiments) comes from a transform applied to one device's shard, chosen by name in
``DataSpec.device_transform``. Every process applies the same transform to the same shard, so the
skew is reproducible from the spec alone.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shared.data.datasets import ArrayDataset, dataset_input_shape, dataset_num_classes
from shared.data.domains import color_transform, rotation_transform
from shared.data.feature_skew import gaussian_noise
from shared.data.spec import DataSpec

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


def check_device_transform(spec: DataSpec) -> None:
    """Apply the spec's transform to two blank images for the first and the last device, so bad
    parameters fail when the configuration is read (``shared.run_config.validate_run_config``: on
    the Fed Server, in an experiment file) rather than later on each device as it loads its shard.
    ValueError names the problem. Here rather than in ``DataSpec``'s own validator so that
    ``shared.data.spec`` imports no transform (the two modules used to import each other)."""
    if spec.device_transform == "none":
        return
    blank = ArrayDataset(torch.zeros((2, *dataset_input_shape(spec))), torch.zeros(2, dtype=torch.int64),
                         dataset_num_classes(spec))
    for index in sorted({0, spec.num_devices - 1}):
        try:
            apply_device_transform(spec.device_transform, blank, index, spec.num_devices,
                                   dict(spec.device_transform_params), spec.seed)
        except (TypeError, KeyError, IndexError) as exc:   # a transform's own checks raise ValueError
            raise ValueError(f"device_transform {spec.device_transform!r}: bad parameters "
                             f"{spec.device_transform_params!r}: {exc}") from exc
