"""How alike two images are (SSIM, PSNR) and a grid of them as a PNG file, for the privacy
benchmark's reconstructions (benchmarks/privacy.py); torch, ``zlib`` and ``struct`` only (no
imaging library is a dependency of the project)."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch
from torch import nn

#: SSIM's constants and window (Wang et al., 2004): K1, K2, an 11x11 Gaussian of sigma 1.5.
K1, K2, WINDOW, SIGMA = 0.01, 0.03, 11, 1.5


def _gaussian_window(size: int, sigma: float, channels: int) -> torch.Tensor:
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    line = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    line = line / line.sum()
    return (line[:, None] * line[None, :]).expand(channels, 1, size, size).contiguous()


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """The structural similarity of each pair of images (batch x channels x height x width): the
    mean over the image, each channel apart, of Wang et al.'s SSIM in an 11x11 Gaussian window of
    sigma 1.5 (only where the window fits), with ``C1 = (K1 L)^2``, ``C2 = (K2 L)^2`` and ``L``
    the ``data_range``. One value per pair; 1 for identical images."""
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(f"SSIM takes two batches of images of one shape (N, C, H, W); got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    if min(a.shape[2:]) < WINDOW:
        raise ValueError(f"SSIM's window is {WINDOW} pixels; the images are {tuple(a.shape[2:])}")
    a, b = a.double(), b.double()
    channels = a.shape[1]
    window = _gaussian_window(WINDOW, SIGMA, channels)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.conv2d(x, window, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return index.flatten(1).mean(dim=1)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """The peak signal-to-noise ratio of each pair of images, in dB: ``10 log10(L^2 / MSE)``
    (infinite for identical images)."""
    if a.shape != b.shape:
        raise ValueError(f"PSNR takes two batches of one shape; got {tuple(a.shape)} and {tuple(b.shape)}")
    mse = (a.double() - b.double()).flatten(1).pow(2).mean(dim=1)
    return 10 * torch.log10(data_range ** 2 / mse)


def to_unit_range(images: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``images`` mapped from ``[low, high]`` (the data set's range) to ``[0, 1]``, clamped."""
    return ((images - low) / (high - low)).clamp(0.0, 1.0)


def grid(tiles: list[list[torch.Tensor | None]], gap: int = 2) -> torch.Tensor:
    """Rows of equally sized grey tiles (height x width, values in ``[0, 1]``; None: left white)
    as one image, ``gap`` white pixels between tiles."""
    shape = next(t.shape for row in tiles for t in row if t is not None)
    height, width = shape
    columns = max(len(row) for row in tiles)
    out = torch.ones(len(tiles) * (height + gap) + gap, columns * (width + gap) + gap, dtype=torch.float64)
    for r, row in enumerate(tiles):
        for c, tile in enumerate(row):
            if tile is not None:
                top, left = gap + r * (height + gap), gap + c * (width + gap)
                out[top:top + height, left:left + width] = tile.double()
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def write_png(image: torch.Tensor, path: Path) -> Path:
    """``image`` (height x width, values in ``[0, 1]``) as an 8-bit greyscale PNG at ``path``."""
    if image.dim() != 2:
        raise ValueError(f"a greyscale PNG takes one height x width image; got shape {tuple(image.shape)}")
    pixels = (image.double().clamp(0.0, 1.0) * 255).round().to(torch.uint8)
    height, width = pixels.shape
    raw = b"".join(b"\x00" + bytes(row.tolist()) for row in pixels)   # filter 0 (none) on every line
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)     # 8 bits, greyscale, no interlace
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9))
                     + _chunk(b"IEND", b""))
    return path
