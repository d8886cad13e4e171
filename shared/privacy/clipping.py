"""The size of an update (a portion's change over the round) and its clipping into a norm ball:
what a device does to its update before it leaves and the Fed Server checks again (privacy), what
the Fed Server applies to an update it sees (``updates.max_norm``), and the adaptive
clip bound of Andrew et al. (2021)."""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch


def update_norm(state: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``state - global_state`` over the floating-point entries ``state`` holds."""
    total = 0.0
    for key, value in state.items():
        if value.is_floating_point():
            total += float((value.double() - global_state[key].double()).pow(2).sum())
    return math.sqrt(total)


def clip_update(state: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                max_norm: float, norm: float | None = None) -> dict[str, torch.Tensor]:
    """``global + (state - global) * min(1, max_norm / norm)``: the update scaled into the norm ball.
    ``norm``: the update's norm when the caller has already computed it."""
    norm = update_norm(state, global_state) if norm is None else norm
    if norm <= max_norm:
        return dict(state)
    scale = max_norm / norm
    return {key: (global_state[key] + (value - global_state[key]) * scale).to(value.dtype)
            if value.is_floating_point() else value for key, value in state.items()}


@dataclass
class AdaptiveClip:
    """Adaptive clipping (Andrew et al. 2021, "Differentially private learning with adaptive
    clipping", Algorithm 1 with the geometric update): after each round the bound moves towards
    the ``quantile`` of the devices' update norms, ``C <- C exp(-lr (b - quantile))``, where ``b`` is
    the noised fraction of devices whose update was inside the bound.

    The count of those devices is released with Gaussian noise of ``count_stddev``, which spends part
    of the budget: the updates' noise multiplier becomes :meth:`update_noise_multiplier` of the
    run's, so the two together cost what the run's multiplier alone would (the paper's Theorem 1)."""

    clip_norm: float
    quantile: float
    lr: float
    count_stddev: float

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """``(z^-2 - (2 sigma_b)^-2)^(-1/2)``: the updates' share of the run's multiplier ``z``.
        ValueError when the count's noise alone would spend more than ``z`` allows."""
        rest = noise_multiplier ** -2 - (2 * self.count_stddev) ** -2
        if rest <= 0:
            raise ValueError(f"privacy.clipped_count_stddev {self.count_stddev:g} is too small for noise multiplier "
                             f"{noise_multiplier:g}: it must exceed half of it ({noise_multiplier / 2:g})")
        return rest ** -0.5

    def observe(self, unclipped_fraction: float) -> None:
        """The round's noised fraction of devices whose update was inside the bound: the next bound."""
        self.clip_norm *= math.exp(-self.lr * (unclipped_fraction - self.quantile))
