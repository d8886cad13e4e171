"""Users' models that normalise over the batch, for the integration tests: ``batchnorm_model:net``
on the Main Server's side of any cut, ``batchnorm_model:device_net`` on the device's side of SFL's.

``net`` is ``user_models:mnist_net`` with ``BatchNorm1d`` before its output ``Linear``, in the last
block: always on the Main Server's side of any cut. A training step of a single sample cannot pass
``BatchNorm1d`` (PyTorch raises "Expected more than 1 value per channel when training"), whatever
the values: a group whose step carries one sample in all fails to train it.
"""
from __future__ import annotations

from torch import nn

from user_models import mnist_net


def net(num_classes: int, input_shape: tuple[int, ...], width: int = 4, hidden: int = 16) -> nn.Sequential:
    """``mnist_net``'s four blocks (three split points), its head preceded by ``BatchNorm1d``."""
    blocks = mnist_net(num_classes, input_shape, width, hidden)
    blocks.head = nn.Sequential(nn.BatchNorm1d(hidden), blocks.head)
    return blocks


def device_net(num_classes: int, input_shape: tuple[int, ...], width: int = 4, hidden: int = 16) -> nn.Sequential:
    """``mnist_net``'s four blocks, its third (``fc``) ending in ``BatchNorm1d``: on the device's side
    of the cut after block 3, where SFL cuts (the largest client portion), and of every cut under FedAvg."""
    blocks = mnist_net(num_classes, input_shape, width, hidden)
    blocks.fc.append(nn.BatchNorm1d(hidden))
    return blocks
