"""The user's model for the regression example: a small MLP with one output per target.

Named by import path in run.yaml (``model: model:build``, this folder on PYTHONPATH). For a
regression task ``num_classes`` is the number of targets (``data.num_classes: 1`` here), so the
head is a plain ``Linear`` with that many outputs and no activation: MSE compares its raw output
with the targets. With the default two widths, three blocks: S2FL can cut the model after the first or the second.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn


def build(num_classes: int, input_shape: tuple[int, ...], widths: tuple[int, ...] = (32, 32)) -> nn.Sequential:
    """One ReLU layer per entry of ``widths`` (``model_params.widths`` in run.yaml), then the head."""
    if len(input_shape) != 1:  # a clear config error instead of a failed unpacking
        raise ValueError(f"this MLP takes feature vectors, data.input_shape [D]; got {list(input_shape)}")
    blocks: OrderedDict[str, nn.Module] = OrderedDict()
    width = input_shape[0]
    for index, out in enumerate(widths, start=1):
        blocks[f"layer{index}"] = nn.Sequential(nn.Linear(width, out), nn.ReLU())
        width = out
    blocks["head"] = nn.Linear(width, num_classes)   # raw outputs: the loss compares them with the targets
    return nn.Sequential(blocks)
