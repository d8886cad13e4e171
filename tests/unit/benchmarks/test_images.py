"""SSIM, PSNR and the PNG writer of the privacy benchmark (benchmarks/images.py), against known
values and an independent computation, and the PNG read back byte by byte."""
from __future__ import annotations

import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter

from benchmarks.images import K1, K2, grid, psnr, ssim, to_unit_range, write_png


def _reference_ssim(a: np.ndarray, b: np.ndarray, data_range: float = 1.0) -> float:
    """Wang et al.'s SSIM with scipy's Gaussian filter (sigma 1.5, truncated at 3.5 sigma: the 11x11
    window), the border where the window does not fit left out, as scikit-image computes it."""
    def blur(x: np.ndarray) -> np.ndarray:
        return gaussian_filter(x, sigma=1.5, truncate=3.5, mode="reflect")

    mu_a, mu_b = blur(a), blur(b)
    var_a, var_b, cov = blur(a * a) - mu_a ** 2, blur(b * b) - mu_b ** 2, blur(a * b) - mu_a * mu_b
    c1, c2 = (K1 * data_range) ** 2, (K2 * data_range) ** 2
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return float(index[5:-5, 5:-5].mean())


def test_ssim_of_an_image_with_itself_is_one_and_of_constants_is_the_luminance_term() -> None:
    image = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ssim(image, image), torch.ones(3, dtype=torch.float64))
    a, b = (torch.full((1, 1, 16, 16), v, dtype=torch.float64) for v in (0.2, 0.6))
    c1 = (K1 * 1.0) ** 2
    assert ssim(a, b).item() == pytest.approx((2 * 0.2 * 0.6 + c1) / (0.2 ** 2 + 0.6 ** 2 + c1), rel=1e-9)


def test_ssim_matches_an_independent_gaussian_filter_computation() -> None:
    generator = torch.Generator().manual_seed(1)
    clean = torch.rand(1, 1, 28, 28, generator=generator)
    for noisy in (clean + 0.1 * torch.randn(clean.shape, generator=generator),
                  torch.rand(1, 1, 28, 28, generator=generator), 1 - clean):
        expected = _reference_ssim(clean[0, 0].double().numpy(), noisy[0, 0].double().numpy())
        assert ssim(clean, noisy).item() == pytest.approx(expected, abs=1e-9)
    # Noise lowers it, an inverted image makes it negative.
    assert 0 < ssim(clean, clean + 0.3 * torch.randn(clean.shape, generator=generator)).item() < 0.9
    assert ssim(clean, 1 - clean).item() < 0


def test_ssim_refuses_images_smaller_than_its_window_or_of_two_shapes() -> None:
    with pytest.raises(ValueError, match="window"):
        ssim(torch.zeros(1, 1, 8, 8), torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="one shape"):
        ssim(torch.zeros(1, 1, 16, 16), torch.zeros(1, 1, 16, 17))


def test_psnr_known_values() -> None:
    a = torch.zeros(2, 1, 4, 4)
    b = torch.full((2, 1, 4, 4), 0.1)   # MSE 0.01 in a range of 1: 20 dB
    assert torch.allclose(psnr(a, b), torch.full((2,), 20.0, dtype=torch.float64))
    assert psnr(a, b, data_range=10.0)[0].item() == pytest.approx(40.0)
    assert math.isinf(psnr(a, a)[0].item())


def test_to_unit_range_maps_and_clamps() -> None:
    x = torch.tensor([-1.0, 0.0, 1.0, 3.0])
    assert to_unit_range(x, -1.0, 1.0).tolist() == [0.0, 0.5, 1.0, 1.0]


def _read_png(path: Path) -> np.ndarray:
    """An 8-bit greyscale PNG of unfiltered lines, parsed and its checksums checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    offset, chunks = 8, {}
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks[kind] = chunks.get(kind, b"") + body
        offset += 12 + length
    width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
    assert (depth, colour, interlace) == (8, 0, 0) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    lines = [raw[y * (width + 1):(y + 1) * (width + 1)] for y in range(height)]
    assert all(line[0] == 0 for line in lines)
    return np.array([list(line[1:]) for line in lines], dtype=np.uint8)


def test_a_png_reads_back_pixel_for_pixel(tmp_path: Path) -> None:
    image = torch.rand(13, 21, generator=torch.Generator().manual_seed(2))
    image[0, 0], image[0, 1] = -0.5, 1.5   # clamped
    pixels = _read_png(write_png(image, tmp_path / "sub" / "a.png"))
    expected = (image.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    assert pixels.shape == (13, 21) and (pixels == expected).all()
    assert pixels[0, 0] == 0 and pixels[0, 1] == 255
    with pytest.raises(ValueError, match="height x width"):
        write_png(torch.zeros(1, 2, 2), tmp_path / "b.png")


def test_a_grid_places_tiles_with_white_gaps() -> None:
    black = torch.zeros(2, 3)
    out = grid([[black, None], [black]], gap=1)
    assert out.shape == (1 + 2 * 3, 1 + 2 * 4)
    assert out[1:3, 1:4].sum() == 0 and out[1:3, 5:8].min() == 1   # the None left white
    assert out[4:6, 1:4].sum() == 0 and out[0].min() == 1
