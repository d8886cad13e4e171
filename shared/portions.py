"""Model portions on the wire: blocks[start:end] of a model as an ordered name -> tensor map."""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

import torch

from shared.models import SplitModel
from shared.wire import decode_state


def portion_state(model: SplitModel, start: int, end: int) -> dict[str, torch.Tensor]:
    """The state of blocks[start:end], keyed by the full model's state_dict names."""
    state = model.state_dict()
    return {k: state[k] for k in model.portion_keys(start, end)}


def device_state(model: SplitModel, split_point: int, head_start: int) -> dict[str, torch.Tensor]:
    """What a device cut at ``split_point`` holds of ``model``: blocks ``[0, split_point)`` and, in
    U-shaped mode (``head_start`` before the end), the head ``[head_start, end)``, in that order."""
    state = portion_state(model, 0, split_point)
    if head_start < len(model.blocks):
        state.update(portion_state(model, head_start, len(model.blocks)))
    return state


def decode_device_portion(wire_state: Mapping[str, Any], model: SplitModel, split_point: int, head_start: int,
                          what: str = "weights") -> dict[str, torch.Tensor]:
    """Decode what a device cut at ``split_point`` holds (:func:`device_state`), checked as
    :func:`decode_portion` checks a portion."""
    return decode_state(wire_state, expect=device_state(model, split_point, head_start), what=what)


def decode_portion(wire_state: Mapping[str, Any], model: SplitModel, start: int, end: int,
                   what: str = "weights") -> dict[str, torch.Tensor]:
    """Decode a received portion; names, order, shapes and dtypes must be exactly blocks[start:end]'s.

    Raises :class:`shared.wire.WireError` (a ValueError) naming the first problem.
    """
    return decode_state(wire_state, expect=portion_state(model, start, end), what=what)


def load_portion(portion: torch.nn.Module, weights: Mapping[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Load ``weights`` (every parameter and buffer of ``portion``, names relative to it) into
    ``portion``, first allocating on ``device`` (default the CPU) whatever of it is still on the
    meta device: a model built per task has no memory until the weights it trains arrive."""
    if any(t.is_meta for t in itertools.chain(portion.parameters(), portion.buffers())):
        portion.to_empty(device=device or torch.device("cpu"))
    portion.load_state_dict(weights, strict=True)
