"""A user's own model, defined outside the zoo, for the integration tests (``user_models:mnist_net``).

It is what a user's package would hold: a function that returns ordered named blocks. The tests put
this folder on PYTHONPATH of the services they start, as a user would install their package.
"""
from __future__ import annotations

from collections import OrderedDict

from torch import nn


def mnist_net(num_classes: int, input_shape: tuple[int, ...], width: int = 8, hidden: int = 32) -> nn.Sequential:
    """conv3x3(width)-pool, conv3x3(2*width)-pool, fc(hidden), head: four blocks, three split points,
    feature block and output layer inferred (the last two blocks)."""
    c, h, w = input_shape
    flat = 2 * width * (h // 4) * (w // 4)
    return nn.Sequential(OrderedDict(
        conv1=nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        conv2=nn.Sequential(nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
        fc=nn.Sequential(nn.Flatten(), nn.Linear(flat, hidden), nn.ReLU()),
        head=nn.Linear(hidden, num_classes),
    ))
