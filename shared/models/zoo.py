"""The model zoo: small, CPU-friendly versions of the architectures used in the S2FL experiments.

Every builder returns a :class:`SplitModel` with exactly three candidate split points; they are
built through :func:`shared.models.build_model` like any user model (docs/models.md). All models
accept both MNIST-like ``(1, 28, 28)`` and CIFAR-like ``(3, 32, 32)`` inputs: flatten sizes are
computed from ``input_shape`` and spatial reductions end in adaptive pooling (or ceil-mode pooling).
Initialisation is deterministic from the seed ``build_model`` sets around the builder call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shared.models.split_model import SplitModel

__all__ = ["MODEL_NAMES", "ZOO_BUILDERS", "DEFAULT_INPUT_SHAPES"]

MODEL_NAMES: tuple[str, ...] = ("cnn", "resnet8", "vgg16", "mobilenet", "logreg")

DEFAULT_INPUT_SHAPES: dict[str, tuple[int, int, int]] = {
    "cnn": (1, 28, 28),
    "resnet8": (3, 32, 32),
    "vgg16": (3, 32, 32),
    "mobilenet": (3, 32, 32),
    "logreg": (1, 1, 60),
}

#: Models whose split points are placeholders (no compute before the cut): they exist for
#: split-depth-zero algorithms only; S2FL/SFL with them would put the whole model on the server.
SPLIT_DEPTH_ZERO_MODELS: tuple[str, ...] = ("logreg",)


# ---------------------------------------------------------------------------------------- CNN
def _pool_out(size: int, times: int) -> int:
    """Spatial size after ``times`` floor-mode 2x2 max-pools."""
    for _ in range(times):
        size //= 2
    return size


def _cnn(num_classes: int, input_shape: tuple[int, int, int]) -> SplitModel:
    """The classic 2-conv MNIST CNN (FedAvg paper): conv5x5(32)-pool, conv5x5(64)-pool, fc512, head."""
    c, h, w = input_shape
    flat = 64 * _pool_out(h, 2) * _pool_out(w, 2)
    blocks = {
        "conv1": nn.Sequential(nn.Conv2d(c, 32, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        "conv2": nn.Sequential(nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(2)),
        "fc1": nn.Sequential(nn.Flatten(), nn.Linear(flat, 512), nn.ReLU(inplace=True)),
        "head": nn.Linear(512, num_classes),
    }
    return SplitModel(blocks, (1, 2, 3), "fc1", "blocks.head", input_shape, num_classes)


# ---------------------------------------------------------------------------------------- ResNet-8
class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv+BN, identity or 1x1-conv+BN projection shortcut, ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def _conv_bn_relu(in_ch: int, out_ch: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


def _pool_flatten() -> nn.Sequential:
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


def _resnet8(num_classes: int, input_shape: tuple[int, int, int]) -> SplitModel:
    """ResNet-8 (CIFAR-style): stem 16, three basic blocks 16/32/64 (stride 1/2/2), GAP, Linear."""
    blocks = {
        "stem": _conv_bn_relu(input_shape[0], 16),
        "stage1": BasicBlock(16, 16),
        "stage2": BasicBlock(16, 32, stride=2),
        "stage3": BasicBlock(32, 64, stride=2),
        "pool": _pool_flatten(),
        "head": nn.Linear(64, num_classes),
    }
    model = SplitModel(blocks, (1, 2, 3), "pool", "blocks.head", input_shape, num_classes)
    _kaiming_init(model)
    return model


# ---------------------------------------------------------------------------------------- VGG-16-BN
_VGG16_STAGES: tuple[tuple[int, ...], ...] = ((64, 64), (128, 128), (256, 256, 256), (512, 512, 512), (512, 512, 512))


def _vgg16(num_classes: int, input_shape: tuple[int, int, int]) -> SplitModel:
    """VGG-16-BN with the common CIFAR classifier (512 -> 512 -> classes).

    One block per conv stage (each ends with a 2x2 max-pool). The pools use ``ceil_mode`` so a
    28x28 input still reaches 1x1 after five pools (28-14-7-4-2-1), like 32x32 does (32-16-8-4-2-1).
    """
    blocks: dict[str, nn.Module] = {}
    in_ch = input_shape[0]
    for i, widths in enumerate(_VGG16_STAGES, start=1):
        layers: list[nn.Module] = []
        for out_ch in widths:
            layers += [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True)]
            in_ch = out_ch
        layers.append(nn.MaxPool2d(2, ceil_mode=True))
        blocks[f"stage{i}"] = nn.Sequential(*layers)
    blocks["fc"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 512), nn.ReLU(inplace=True))
    blocks["head"] = nn.Linear(512, num_classes)
    model = SplitModel(blocks, (1, 2, 3), "fc", "blocks.head", input_shape, num_classes)
    _kaiming_init(model)
    return model


# ---------------------------------------------------------------------------------------- MobileNet v1
MOBILENET_WIDTH = 0.5
"""Width multiplier of the zoo's MobileNet (channels 16..512 instead of 32..1024), for CPU training."""


def _dw_separable(in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
    """Depthwise 3x3 conv + BN + ReLU, then pointwise 1x1 conv + BN + ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=1, groups=in_ch, bias=False),
        nn.BatchNorm2d(in_ch),
        nn.ReLU(inplace=True),
        nn.Conv2d(in_ch, out_ch, 1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


def _mobilenet(num_classes: int, input_shape: tuple[int, int, int], width: float = MOBILENET_WIDTH) -> SplitModel:
    """MobileNet v1 for 32x32 inputs (first conv stride 1, as in common CIFAR ports).

    Layers (full width): conv3x3 32, dw 64, dw 128/s2, dw 128, dw 256/s2, dw 256, dw 512/s2,
    5x dw 512, dw 1024/s2, dw 1024, global average pool, Linear. 32x32 ends at 2x2 before the pool.
    """
    if not 0 < width <= 1.0:
        raise ValueError(f"width multiplier must be in (0, 1], got {width}")

    def ch(n: int) -> int:
        return max(8, int(n * width))

    stages: list[tuple[str, list[tuple[int, int]]]] = [  # (block name, [(out_channels, stride), ...])
        ("stem", [(64, 1)]),
        ("stage1", [(128, 2), (128, 1)]),
        ("stage2", [(256, 2), (256, 1)]),
        ("stage3", [(512, 2)] + [(512, 1)] * 5),
        ("stage4", [(1024, 2), (1024, 1)]),
    ]
    blocks: dict[str, nn.Module] = {}
    in_ch = ch(32)
    for name, cfg in stages:
        layers: list[nn.Module] = [_conv_bn_relu(input_shape[0], in_ch)] if name == "stem" else []
        for out, stride in cfg:
            layers.append(_dw_separable(in_ch, ch(out), stride))
            in_ch = ch(out)
        blocks[name] = nn.Sequential(*layers)
    blocks["pool"] = _pool_flatten()
    blocks["head"] = nn.Linear(in_ch, num_classes)
    model = SplitModel(blocks, (1, 2, 3), "pool", "blocks.head", input_shape, num_classes)
    _kaiming_init(model)
    return model


# ---------------------------------------------------------------------------------------- logistic regression
def _logreg(num_classes: int, input_shape: tuple[int, int, int]) -> SplitModel:
    """Multinomial logistic regression ``Linear(C*H*W -> classes)`` (FedBC's Synthetic model:
    60 -> 10, PyTorch default init), trained with cross-entropy = softmax regression.

    The zoo's contract asks for K = 3 strictly increasing split points < len(blocks), which one
    Linear cannot give, so the flatten is followed by two parameter-free identity blocks ("input",
    "features") before the "head". The split points (1, 2, 3) cut between them and carry no compute
    on the client side: meaningful only for split depth zero (FedBC, FedAvg), which never cuts.
    The penultimate features are the (flattened) input itself.
    """
    c, h, w = input_shape
    blocks = {
        "flatten": nn.Flatten(),
        "input": nn.Identity(),
        "features": nn.Identity(),
        "head": nn.Linear(c * h * w, num_classes),
    }
    return SplitModel(blocks, (1, 2, 3), "features", "blocks.head", input_shape, num_classes)


# ---------------------------------------------------------------------------------------- helpers
def _kaiming_init(model: nn.Module) -> None:
    """He init for convs (fan_out, as torchvision's ResNet/VGG/MobileNet), BN to identity."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


#: The built-in models: name -> builder ``(num_classes, input_shape, **params) -> SplitModel``. They are
#: the built-in entries of :func:`shared.models.build_model` (``shared/models/loading.py``).
ZOO_BUILDERS: dict[str, Callable[..., SplitModel]] = {
    "cnn": _cnn,
    "resnet8": _resnet8,
    "vgg16": _vgg16,
    "mobilenet": _mobilenet,
    "logreg": _logreg,
}
