"""The user's model for the image-folder example: a small CNN for grey 28x28 digits.

It is not one of the built-in models: the run names it by import path (``model: model:build`` in
run.yaml, with this folder on PYTHONPATH). The function returns an ``nn.Sequential`` whose named
children are the blocks the system may cut between. Four blocks give three candidate split points
(after ``conv1``, after ``conv2``, after ``fc``), so S2FL's sliding split can give a slow device
one block and a fast one three.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn


def build(num_classes: int, input_shape: tuple[int, ...], width: int = 16) -> nn.Sequential:
    """Two conv blocks, one hidden dense block, a linear head.

    ``num_classes`` and ``input_shape`` come from the run's ``data`` section; ``width`` (channels
    of the first conv block) comes from ``model_params`` in run.yaml.
    """
    if len(input_shape) != 3:  # a clear config error instead of a failed unpacking
        raise ValueError(f"this CNN takes images, data.input_shape [C, H, W]; got {list(input_shape)}")
    channels, height, width_px = input_shape
    flat = 2 * width * (height // 4) * (width_px // 4)  # two 2x2 max-pools
    return nn.Sequential(OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        conv2=nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        fc=nn.Sequential(nn.Flatten(), nn.Linear(flat, 64), nn.ReLU()),
        head=nn.Linear(64, num_classes),
    ))
