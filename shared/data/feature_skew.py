"""Feature-skew transforms: Gaussian noise whose strength grows with the device index.

NIID-Bench's "noise-based feature imbalance", used by FNR-FL (Hu et al., arXiv 2312.06951, Eq. 2
and §6.1): the split itself is IID (or any partition), and device ``i`` of ``n`` adds zero-mean
Gaussian noise with standard deviation ``sigma_i = sigma * i / (n - 1)`` to every input element.
Device 0 stays clean, the last device gets the full ``sigma``.

Registered in ``shared.data.device_transforms.DEVICE_TRANSFORMS`` as ``"gaussian_noise"``; select
it with ``data.device_transform=gaussian_noise`` and ``data.device_transform_params={sigma: 0.5}``.

Choices and deviations (docs/algorithms/fnr-fl.md):

* **Fixed corruption, not per-load noise.** The official code samples fresh noise every time a
  sample is loaded (noise as augmentation). A device transform in this project maps a shard to a
  shard once, so each device's noise is drawn once, seeded by ``(seed, device_index)``: every
  process derives the same noisy shard, and the skew is a fixed property of the device's data
  (the paper's Eq. 2 reading).
* **Noise scale.** The project's images are normalised per channel (``(x - mean) / std``); the
  paper adds noise to ``[0, 1]`` pixels. By default ``sigma`` is in the units of the stored
  (normalised) tensors. Give ``pixel_std`` (the dataset's per-channel std, e.g. CIFAR-10
  ``[0.2470, 0.2435, 0.2616]``, MNIST ``0.3081``) to express ``sigma`` in pixel units as the paper
  does: the noise added to channel ``c`` then has std ``sigma_i / pixel_std[c]``.
* No clipping (as in the code), ``mean`` (Eq. 2's ``mu``) defaults to 0, the mask of Eq. 2 is all
  ones (the code's default ``noise_type=level``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from shared.data.datasets import ArrayDataset

__all__ = ["GaussianNoiseParams", "device_noise_std", "gaussian_noise"]

#: Tag mixed into the noise seed so this stream never coincides with other seeded draws.
_NOISE_STREAM = 0x464E52  # "FNR"


class GaussianNoiseParams(BaseModel):
    """``data.device_transform_params`` of the ``gaussian_noise`` transform."""

    model_config = ConfigDict(extra="forbid")

    sigma: float = Field(0.5, ge=0)
    """Noise std of the last device (device i gets ``sigma * i / (n - 1)``). Paper: 0.1-0.5."""
    mean: float = 0.0
    """Constant ``mu`` added to every noised element (Eq. 2); the paper's code uses 0."""
    pixel_std: float | list[float] | None = None
    """Per-channel std of the dataset's normalisation, to give ``sigma`` in [0, 1]-pixel units."""

    @field_validator("sigma", "mean")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError(f"must be finite, got {value}")
        return value

    @field_validator("pixel_std")
    @classmethod
    def _positive(cls, value: float | list[float] | None) -> float | list[float] | None:
        values = [value] if isinstance(value, (int, float)) else (value or [])
        if any(not math.isfinite(v) or v <= 0 for v in values):
            raise ValueError(f"pixel_std must be finite and > 0, got {value}")
        return value


def device_noise_std(sigma: float, device_index: int, num_devices: int) -> float:
    """``sigma * i / (n - 1)``: device 0 clean, the last device at full ``sigma`` (0 if n == 1)."""
    if not 0 <= device_index < num_devices:
        raise ValueError(f"device_index {device_index} out of range for {num_devices} devices")
    if num_devices == 1:
        return 0.0
    return float(sigma) * device_index / (num_devices - 1)


def _channel_scale(pixel_std: float | Sequence[float] | None, channels: int) -> torch.Tensor:
    """Per-channel factor turning pixel-unit noise into normalised-unit noise, shape [1, C, 1, 1]."""
    if pixel_std is None:
        return torch.ones(1, channels, 1, 1)
    stds = [float(pixel_std)] * channels if isinstance(pixel_std, (int, float)) else [float(s) for s in pixel_std]
    if len(stds) != channels:
        raise ValueError(f"pixel_std has {len(stds)} values but the images have {channels} channels")
    return 1.0 / torch.tensor(stds, dtype=torch.float32).view(1, channels, 1, 1)


def gaussian_noise(shard: ArrayDataset, device_index: int, num_devices: int, params: dict[str, Any],
                   seed: int) -> ArrayDataset:
    """Device ``device_index``'s shard plus its fixed Gaussian noise (a new dataset; input untouched)."""
    cfg = GaussianNoiseParams.model_validate(params)
    std = device_noise_std(cfg.sigma, int(device_index), int(num_devices))
    if std == 0.0 and cfg.mean == 0.0:
        return shard
    gen = torch.Generator().manual_seed(
        int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(device_index), _NOISE_STREAM]).generate_state(1)[0])
    )
    x = shard.x
    eps = torch.randn(x.shape, generator=gen, dtype=torch.float32)
    if x.dim() == 4:
        scale = _channel_scale(cfg.pixel_std, x.shape[1])
    elif cfg.pixel_std is None or isinstance(cfg.pixel_std, (int, float)):
        scale = torch.tensor(1.0 / float(cfg.pixel_std or 1.0))
    else:
        raise ValueError("a per-channel pixel_std needs image tensors [N, C, H, W]")
    # Eq. 2 in pixel units, x' = x + eps * sigma_i + mu, mapped into the normalised space.
    noisy = x + ((eps * std + cfg.mean) * scale).to(x.dtype)
    return ArrayDataset(x=noisy, y=shard.y, num_classes=shard.num_classes, writers=shard.writers)
