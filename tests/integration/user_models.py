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


class OneClassResNet(nn.Module):
    """A ResNet-style model written as one class, as much PyTorch code is: a conv-BN-ReLU stem, three
    residual stages written out in ``forward`` (each ``relu(shortcut + BN(conv(relu(BN(conv(x))))))``;
    the second and third halve the size and double the channels, their shortcut a strided 1x1 conv
    with BN), global average pooling and a linear head. The project traces it and cuts it only
    between the stages, never across a skip connection."""

    def __init__(self, num_classes: int, input_shape: tuple[int, ...], width: int = 4) -> None:
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Conv2d(c, width, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.a_conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.a_bn1 = nn.BatchNorm2d(width)
        self.a_conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.a_bn2 = nn.BatchNorm2d(width)
        self.b_conv1 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False)
        self.b_bn1 = nn.BatchNorm2d(2 * width)
        self.b_conv2 = nn.Conv2d(2 * width, 2 * width, 3, padding=1, bias=False)
        self.b_bn2 = nn.BatchNorm2d(2 * width)
        self.b_short = nn.Conv2d(width, 2 * width, 1, stride=2, bias=False)
        self.b_short_bn = nn.BatchNorm2d(2 * width)
        self.c_conv1 = nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1, bias=False)
        self.c_bn1 = nn.BatchNorm2d(4 * width)
        self.c_conv2 = nn.Conv2d(4 * width, 4 * width, 3, padding=1, bias=False)
        self.c_bn2 = nn.BatchNorm2d(4 * width)
        self.c_short = nn.Conv2d(2 * width, 4 * width, 1, stride=2, bias=False)
        self.c_short_bn = nn.BatchNorm2d(4 * width)
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(x)))
        x = F.relu(x + self.a_bn2(self.a_conv2(F.relu(self.a_bn1(self.a_conv1(x))))))
        x = F.relu(self.b_short_bn(self.b_short(x)) + self.b_bn2(self.b_conv2(F.relu(self.b_bn1(self.b_conv1(x))))))
        x = F.relu(self.c_short_bn(self.c_short(x)) + self.c_bn2(self.c_conv2(F.relu(self.c_bn1(self.c_conv1(x))))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def one_class_resnet(num_classes: int, input_shape: tuple[int, ...], width: int = 4) -> nn.Module:
    """``user_models:one_class_resnet``: a :class:`OneClassResNet` (one class, cut by tracing)."""
    return OneClassResNet(num_classes, input_shape, width)
