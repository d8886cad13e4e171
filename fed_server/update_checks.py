"""Checks on a device's uploaded weights before they are accepted: the size of the update."""
from __future__ import annotations

import math
from collections.abc import Mapping

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
