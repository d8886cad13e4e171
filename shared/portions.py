"""Model portions on the wire: blocks[start:end] of a model as an ordered name -> tensor map."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from shared.models import SplitModel
from shared.wire import decode_state


def portion_state(model: SplitModel, start: int, end: int) -> dict[str, torch.Tensor]:
    """The state of blocks[start:end], keyed by the full model's state_dict names."""
    state = model.state_dict()
    return {k: state[k] for k in model.portion_keys(start, end)}


def decode_portion(wire_state: Mapping[str, Any], model: SplitModel, start: int, end: int,
                   what: str = "weights") -> dict[str, torch.Tensor]:
    """Decode a received portion; names, order, shapes and dtypes must be exactly blocks[start:end]'s.

    Raises :class:`shared.wire.WireError` (a ValueError) naming the first problem.
    """
    return decode_state(wire_state, expect=portion_state(model, start, end), what=what)
