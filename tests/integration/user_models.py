"""A user's own model, defined outside the zoo, for the integration tests (``user_models:mnist_net``).

It is what a user's package would hold: a function that returns ordered named blocks. The tests put
this folder on PYTHONPATH of the services they start, as a user would install their package.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
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


class TracedCNN(nn.Module):
    """A model written the usual PyTorch way, its own ``forward`` and no blocks: the project traces
    it and cuts it into conv1 (conv-BN-ReLU-pool), conv2 (conv-BN-ReLU-pool-flatten) and fc."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...], width: int = 4) -> None:
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width * 2, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(width * 2)
        self.fc = nn.Linear(width * 2 * (h // 4) * (w // 4), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(torch.flatten(x, 1))


def traced_cnn(num_classes: int, input_shape: tuple[int, ...], width: int = 4) -> nn.Module:
    """``user_models:traced_cnn``: a :class:`TracedCNN` (an ordinary module, cut by tracing)."""
    return TracedCNN(num_classes, input_shape, width)
