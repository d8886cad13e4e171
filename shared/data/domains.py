"""Domain (feature-shift) variants of image data: rotated and coloured digits.

FedIPG's out-of-distribution experiments (docs/algorithms/fedipg.md#paper-data) need data whose
*features* differ between clients while the labelling rule stays the same:

* **rotation** (RotatedMNIST-style, paper §VI-B): every device's shard is rotated by one angle; the
  held-out domain is the test set rotated by an angle no device trains on;
* **colour** (Coloured-MNIST-style, paper §VI-C; docs/algorithms/fedipg.md#colour): digits are
  coloured by a colour that is spuriously correlated with the label inside a device, differently
  across devices / at test.

Both are pure functions of their arguments and the seed (no global RNG), so every process derives
identical shards. They are registered as per-device transforms in
``shared.data.device_transforms.DEVICE_TRANSFORMS`` (``"rotation"``, ``"color"``) and are also used
by algorithms to build the matching test-time domains (``rotate_dataset`` / ``color_dataset``).
Plain torch (``affine_grid`` / ``grid_sample``), no torchvision.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from shared.data.datasets import MNIST_MEAN, MNIST_STD, ArrayDataset

__all__ = [
    "DEFAULT_ANGLES",
    "PALETTE",
    "rotate_images",
    "rotate_dataset",
    "rotation_angle",
    "rotation_transform",
    "color_dataset",
    "color_domain",
    "color_transform",
]

#: RotatedMNIST's six domains (DomainBed / paper §VI-B), in degrees.
DEFAULT_ANGLES: tuple[float, ...] = (0.0, 15.0, 30.0, 45.0, 60.0, 75.0)

#: Ten fixed, well separated RGB colours c_0..c_9 in [0, 1] (matplotlib's "tab10").
PALETTE: torch.Tensor = torch.tensor([
    [0.122, 0.467, 0.706], [1.000, 0.498, 0.055], [0.173, 0.627, 0.173], [0.839, 0.153, 0.157],
    [0.580, 0.404, 0.741], [0.549, 0.337, 0.294], [0.890, 0.467, 0.761], [0.498, 0.498, 0.498],
    [0.737, 0.741, 0.133], [0.090, 0.745, 0.812],
], dtype=torch.float32)

ColorRegion = Literal["foreground", "background", "both"]


# --------------------------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------------------------
def rotate_images(x: torch.Tensor, angle_deg: float) -> torch.Tensor:
    """Rotate a batch ``[N, C, H, W]`` counter-clockwise by ``angle_deg`` about the image centre.

    Bilinear interpolation; pixels that come from outside the image repeat the border
    (``padding_mode="border"``), which for digits is the background whatever the normalisation
    (zero-padding would paint normalised-MNIST corners grey). Angle 0 (mod 360) returns an
    unchanged copy, exactly. Deterministic: no randomness involved.
    """
    if x.ndim != 4:
        raise ValueError(f"rotate_images expects [N, C, H, W], got shape {tuple(x.shape)}")
    angle = float(angle_deg)
    if not math.isfinite(angle):
        raise ValueError(f"rotation angle must be finite, got {angle_deg!r}")
    if angle % 360.0 == 0.0 or x.shape[0] == 0:
        return x.clone()
    t = math.radians(angle)
    c, s = math.cos(t), math.sin(t)
    # affine_grid maps output coordinates to input coordinates (x right, y down); this theta
    # gives a counter-clockwise rotation as displayed, the same direction as torch.rot90(k=1).
    theta = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=x.dtype).unsqueeze(0).expand(x.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


def rotate_dataset(ds: ArrayDataset, angle_deg: float) -> ArrayDataset:
    """``ds`` with every image rotated by ``angle_deg`` (labels unchanged)."""
    return ArrayDataset(x=rotate_images(ds.x, angle_deg), y=ds.y, num_classes=ds.num_classes, writers=ds.writers)


def _angles(params: dict[str, Any]) -> list[float]:
    unknown = set(params) - {"angles"}
    if unknown:
        raise ValueError(f"rotation transform: unknown parameters {sorted(unknown)} (allowed: angles)")
    angles = params.get("angles", list(DEFAULT_ANGLES))
    if not isinstance(angles, Sequence) or isinstance(angles, str) or not angles:
        raise ValueError(f"rotation transform: 'angles' must be a non-empty list of degrees, got {angles!r}")
    out = []
    for a in angles:
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a):
            raise ValueError(f"rotation transform: angle {a!r} is not a finite number")
        out.append(float(a))
    return out


def rotation_angle(device_index: int, params: dict[str, Any]) -> float:
    """The angle of device ``device_index``: ``angles[device_index % len(angles)]``."""
    angles = _angles(params)
    return angles[int(device_index) % len(angles)]


def rotation_transform(shard: ArrayDataset, device_index: int, num_devices: int, params: dict[str, Any],
                       seed: int) -> ArrayDataset:
    """Device transform ``"rotation"``: device i's shard rotated by ``angles[i % len(angles)]``.

    ``params``: ``{"angles": [...]}`` in degrees (default 0, 15, ..., 75: RotatedMNIST). With an iid
    partition and ``num_devices`` a multiple of ``len(angles)`` every domain holds the same number
    of clients, each client one domain (paper §VI-B). ``seed`` is unused (rotation is deterministic).
    """
    return rotate_dataset(shard, rotation_angle(device_index, params))


# --------------------------------------------------------------------------------------------
# Colour (confounding)
# --------------------------------------------------------------------------------------------
_COLOR_KEYS = {"envs", "strengths", "region"}


def _color_params(params: dict[str, Any]) -> tuple[list[int], list[float], ColorRegion]:
    unknown = set(params) - _COLOR_KEYS
    if unknown:
        raise ValueError(f"color transform: unknown parameters {sorted(unknown)} (allowed: {sorted(_COLOR_KEYS)})")
    envs = params.get("envs", list(range(9)))
    strengths = params.get("strengths", [0.9])
    region = params.get("region", "foreground")
    if not isinstance(envs, Sequence) or isinstance(envs, str) or not envs \
            or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < 10 for e in envs):
        raise ValueError(f"color transform: 'envs' must be a non-empty list of integers in [0, 10), got {envs!r}")
    if not isinstance(strengths, Sequence) or isinstance(strengths, str) or not strengths or any(
            isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= float(p) <= 1.0 for p in strengths):
        raise ValueError(f"color transform: 'strengths' must be a non-empty list of probabilities in [0, 1], got {strengths!r}")
    if region not in ("foreground", "background", "both"):
        raise ValueError(f"color transform: 'region' must be foreground, background or both, got {region!r}")
    return [int(e) for e in envs], [float(p) for p in strengths], region


def color_domain(device_index: int, params: dict[str, Any]) -> tuple[int, float, ColorRegion]:
    """(environment, correlation strength, region) of device ``device_index`` (round-robin lists)."""
    envs, strengths, region = _color_params(params)
    i = int(device_index)
    return envs[i % len(envs)], strengths[i % len(strengths)], region


def _sub_seed(*parts: object) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little")


def color_dataset(ds: ArrayDataset, env: int, strength: float, region: ColorRegion, seed: int) -> ArrayDataset:
    """Colour grey digits so that colour is a spurious, environment-dependent label cue
    (docs/algorithms/fedipg.md#colour).

    Sample with label ``d`` gets colour index ``k = (d + env) mod 10`` with probability
    ``strength``, otherwise a uniformly random ``k`` (seeded by ``seed``). Region: ``foreground``
    paints the digit strokes with ``c_k`` on black; ``background`` keeps white strokes on a
    ``c_k`` background; ``both`` paints strokes ``c_k`` on background ``c_{(k+5) mod 10}`` (open
    choice: the paper does not say which two colours "both" uses; the same colour for both would
    erase the digit). Within one environment colour predicts the label; across environments only
    the shape does.

    Input: grey MNIST-normalised images, either ``[N,1,H,W]`` or ``[N,3,H,W]`` with identical
    channels (``data.transform="rgb32"``). Output: ``[N,3,H,W]``, renormalised with the MNIST
    mean/std, so ``rgb32`` data keeps the shape ``dataset_input_shape`` announces.
    """
    if ds.x.ndim != 4 or ds.x.shape[1] not in (1, 3):
        raise ValueError(f"color_dataset expects grey images [N,1|3,H,W], got {tuple(ds.x.shape)}")
    if ds.num_classes > 10 and len(ds) and int(ds.y.max()) >= 10:
        raise ValueError("color_dataset supports labels 0..9 (ten colours); got a label >= 10")
    n = len(ds)
    rng = np.random.default_rng(_sub_seed("color", seed, env, strength))
    correlated = rng.random(n) < strength
    random_k = rng.integers(0, 10, size=n)
    k = np.where(correlated, (ds.y.numpy() + env) % 10, random_k)
    k_t = torch.from_numpy(k.astype(np.int64))
    intensity = (ds.x[:, :1] * MNIST_STD + MNIST_MEAN).clamp(0.0, 1.0)  # [N,1,H,W] in [0, 1]
    fg = PALETTE[k_t].to(ds.x.dtype).view(n, 3, 1, 1)
    if region == "foreground":
        rgb = intensity * fg
    elif region == "background":
        rgb = intensity + (1.0 - intensity) * fg
    else:
        bg = PALETTE[(k_t + 5) % 10].to(ds.x.dtype).view(n, 3, 1, 1)
        rgb = intensity * fg + (1.0 - intensity) * bg
    x = (rgb - MNIST_MEAN) / MNIST_STD
    return ArrayDataset(x=x.contiguous(), y=ds.y, num_classes=ds.num_classes, writers=ds.writers)


def color_transform(shard: ArrayDataset, device_index: int, num_devices: int, params: dict[str, Any],
                    seed: int) -> ArrayDataset:
    """Device transform ``"color"``: device i's shard coloured in environment ``envs[i % len]`` with
    correlation strength ``strengths[i % len]`` (``params``: envs, strengths, region).

    Defaults: envs 0..8 (the tenth environment, 9, is left for testing,
    docs/algorithms/fedipg.md#paper-data), strength 0.9, region foreground. Needs 3-channel input,
    i.e. ``data.transform: rgb32`` (the model's input shape comes from ``dataset_input_shape``, which is 3x32x32 only with rgb32); 1-channel data
    would give the model the wrong number of channels, so it is refused here.
    """
    if shard.x.ndim != 4 or shard.x.shape[1] != 3:
        raise ValueError(
            "color transform needs 3-channel images so the model's input shape matches: set "
            "data.transform=rgb32 (grey digits padded to 3x32x32) when using device_transform=color"
        )
    env, strength, region = color_domain(device_index, params)
    return color_dataset(shard, env, strength, region, _sub_seed("device", seed, device_index))
