"""The user's model for the tabular example: a small MLP over the 13 wine features.

Named by import path in run.yaml (``model: model:build``, this folder on PYTHONPATH). The
function returns an ``nn.Sequential`` of named blocks; the last block is a ``Linear`` with a bias,
which the system takes as the output layer (and the block before it as the feature block), so
algorithms and selection policies that need them (FedIPG, FNR-FL, HiCS-FL) work without more
declarations.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn


def build(num_classes: int, input_shape: tuple[int, ...], hidden: int = 32) -> nn.Sequential:
    """Two hidden layers of ``hidden`` units (``model_params.hidden`` in run.yaml), then the head."""
    if len(input_shape) != 1:  # a clear config error instead of a failed unpacking
        raise ValueError(f"this MLP takes feature vectors, data.input_shape [D]; got {list(input_shape)}")
    (features,) = input_shape
    return nn.Sequential(OrderedDict(
        layer1=nn.Sequential(nn.Linear(features, hidden), nn.ReLU()),
        layer2=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
        head=nn.Linear(hidden, num_classes),
    ))
