"""The Gaussian noise of client-level differential privacy: added to the sum of the devices'
clipped updates by the Fed Server (central noise), or in shares by the devices, each to its own
clipped update before masking it (distributed noise, under secure aggregation).

The generators are seeded from the operating system's randomness (``os.urandom``), never from the
run's ``seed``: noise that the configuration reproduces could be subtracted again. A test passes
its own generator."""
from __future__ import annotations

import os
from collections.abc import Mapping

import torch


def distributed_noise_std(noise_multiplier: float, clip_norm: float, threshold: int) -> float:
    """The standard deviation of the noise one device adds under ``privacy.noise: distributed``:
    ``z C / sqrt(t)``, so that the sum of any ``t`` (the secure aggregation threshold, the fewest
    survivors whose sum is released) or more devices' shares has at least the variance ``(z C)^2``
    that central noise would add."""
    return noise_multiplier * clip_norm / threshold ** 0.5


def fresh_generator() -> torch.Generator:
    """A CPU generator seeded with 64 bits from the operating system."""
    generator = torch.Generator()
    generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return generator


def add_noise(values: Mapping[str, torch.Tensor], std: float, generator: torch.Generator | None = None
              ) -> dict[str, torch.Tensor]:
    """``values`` with independent N(0, std^2) noise on every entry of each floating tensor (in
    float64; integer entries, a step counter, pass unchanged). ``generator``: None draws a fresh
    one (:func:`fresh_generator`)."""
    if std <= 0:
        return dict(values)
    generator = generator or fresh_generator()
    out = {}
    for key, value in values.items():
        if value.is_floating_point():
            noise = torch.randn(value.shape, dtype=torch.float64, generator=generator)
            out[key] = value.to(torch.float64) + noise.mul_(std)
        else:
            out[key] = value
    return out
