"""``python -m shared.models.describe``: the page docs/builtin-models.md, generated from the zoo.

For every built-in model it lists the blocks (layers, parameters, output shape) and, at every
candidate split point, the activation shape a device sends, the parameter bytes on each side and
the FLOPs ``shared.models.profile.profile_model`` measures, for the input shapes the built-in data
sets give it. A device written in another language needs exactly these shapes (the Main Server
refuses a step whose activation has another). The page is generated, not written, so it cannot
drift from the code: ``tests/unit/shared/test_models_describe.py`` regenerates it and compares.

    python -m shared.models.describe            # print the page
    python -m shared.models.describe --write    # rewrite docs/builtin-models.md
    python -m shared.models.describe --check    # exit 1 if the committed page is out of date
    python -m shared.models.describe --keys cnn # cnn's state-dict keys, shapes and dtypes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

from shared.models import build_model, profile_model

PAGE = Path(__file__).resolve().parents[2] / "docs" / "builtin-models.md"
NUM_CLASSES = 10

#: model -> (what it is, the input shapes described: the default first, then the other one the
#: built-in data sets give it, each with the data that produces it).
MODELS: dict[str, tuple[str, list[tuple[tuple[int, int, int], str]]]] = {
    "cnn": ("The two-convolution MNIST CNN of the FedAvg paper.",
            [((1, 28, 28), "MNIST, FEMNIST"), ((3, 32, 32), "CIFAR-10/100, MNIST with `data.transform: rgb32`")]),
    "resnet8": ("ResNet-8 (CIFAR style): a stem, three residual basic blocks, global average pooling.",
                [((3, 32, 32), "CIFAR-10/100, MNIST with `data.transform: rgb32`"), ((1, 28, 28), "MNIST, FEMNIST")]),
    "vgg16": ("VGG-16 with batch norm, one block per convolution stage, and the common CIFAR classifier "
              "(512 -> 512 -> classes). Pools use ceil mode, so 28x28 also reaches 1x1.",
              [((3, 32, 32), "CIFAR-10/100, MNIST with `data.transform: rgb32`"), ((1, 28, 28), "MNIST, FEMNIST")]),
    "mobilenet": ("MobileNet v1 at width 0.5 (channels 16..512), first convolution with stride 1 as in "
                  "CIFAR ports; each `dwsep` is a depthwise 3x3 conv, BN, ReLU, pointwise 1x1 conv, BN, ReLU.",
                  [((3, 32, 32), "CIFAR-10/100, MNIST with `data.transform: rgb32`"), ((1, 28, 28), "MNIST, FEMNIST")]),
    "logreg": ("Multinomial logistic regression (FedBC's Synthetic model). The split points cut between "
               "parameter-free blocks: it is meant for split-depth-zero algorithms (FedAvg, FedBC), which "
               "never cut.",
               [((1, 1, 60), "Synthetic"), ((1, 28, 28), "MNIST, FEMNIST")]),
}


def _layer(module: nn.Module) -> str:
    """One leaf layer in a few characters: ``conv5x5 1->32 p2``, ``BN``, ``linear 3136->512``."""
    if isinstance(module, nn.Conv2d):
        k = "x".join(map(str, module.kernel_size))
        text = f"conv{k} {module.in_channels}->{module.out_channels}"
        if module.groups > 1:
            text += " depthwise" if module.groups == module.in_channels else f" groups={module.groups}"
        if module.stride != (1, 1):
            text += f" s{module.stride[0]}"
        if module.padding not in ((0, 0), 0):
            text += f" p{module.padding[0]}"
        return text
    if isinstance(module, nn.Linear):
        return f"linear {module.in_features}->{module.out_features}"
    if isinstance(module, nn.MaxPool2d):
        return f"maxpool{module.kernel_size}" + (" ceil" if module.ceil_mode else "")
    names = {nn.BatchNorm2d: "BN", nn.ReLU: "ReLU", nn.AdaptiveAvgPool2d: "global avgpool", nn.Flatten: "flatten",
             nn.Identity: "identity"}
    return names.get(type(module), type(module).__name__)


def _dwsep(module: nn.Module) -> str | None:
    """``dwsep 32->64 s2`` for MobileNet's depthwise-separable unit (depthwise 3x3 conv, BN, ReLU,
    pointwise 1x1 conv, BN, ReLU); None for anything else."""
    layers = list(module.children())
    if len(layers) != 6:
        return None
    depthwise, pointwise = layers[0], layers[3]
    if not isinstance(depthwise, nn.Conv2d) or not isinstance(pointwise, nn.Conv2d):
        return None
    if depthwise.groups != depthwise.in_channels or pointwise.kernel_size != (1, 1):
        return None
    stride = f" s{depthwise.stride[0]}" if depthwise.stride != (1, 1) else ""
    return f"dwsep {depthwise.in_channels}->{pointwise.out_channels}{stride}"


def _part(module: nn.Module) -> str:
    """A block's child: a leaf layer, a MobileNet unit, or a nested group in parentheses."""
    unit = _dwsep(module)
    if unit is not None:
        return unit
    return f"({describe_block(module)})" if list(module.children()) else _layer(module)


def describe_block(module: nn.Module) -> str:
    """A block as its layers in order, runs of identical layers written once with a count; a
    residual block (one with a ``shortcut``) as its main path plus the shortcut."""
    children = dict(module.named_children())
    if not children:
        return _layer(module)
    if "shortcut" in children:   # zoo.BasicBlock: relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))
        main = [_layer(m) for name, m in children.items() if name not in ("shortcut", "relu")]
        main.insert(2, "ReLU")
        return f"residual[{', '.join(main)}] + shortcut[{describe_block(children['shortcut'])}], ReLU"
    runs: list[tuple[str, int]] = []
    for part in map(_part, children.values()):
        if runs and runs[-1][0] == part:
            runs[-1] = (part, runs[-1][1] + 1)
        else:
            runs.append((part, 1))
    return ", ".join(part if n == 1 else f"{n}x {part}" for part, n in runs)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _count(value: float) -> str:
    return f"{int(value):,}"


def state_dict_keys(name: str, input_shape: tuple[int, ...] | None = None) -> list[tuple[str, list[int], str]]:
    """Built-in model ``name``'s state-dict entries in order: (key, shape, dtype), for ``input_shape``
    (default: its first in :data:`MODELS`): the names the checkpoint and the fingerprint use, which a
    device written in another language must use too."""
    shape = input_shape or MODELS[name][1][0][0]
    model = build_model(name, NUM_CLASSES, shape, seed=0)
    return [(key, list(t.shape), str(t.dtype).removeprefix("torch.")) for key, t in model.state_dict().items()]


def _keys_lines(name: str) -> list[str]:
    """The model's state-dict keys, one line per block."""
    by_block: dict[str, list[str]] = {}
    for key, _, _ in state_dict_keys(name):
        by_block.setdefault(key.split(".")[1], []).append(f"`{key}`")
    lines = [f"State-dict keys, in order: the names in `checkpoint.msgpack` and the model fingerprint; the exported "
             f"`model.pt` and `model.safetensors` hold them without the `blocks.` prefix (`python -m "
             f"shared.models.describe --keys {name}` prints them with shapes and dtypes):", ""]
    return lines + [f"- `{block}`: {', '.join(keys)}" for block, keys in by_block.items()] + [""]


def _model_section(name: str) -> list[str]:
    """One model's section: its state-dict keys, and per input shape its blocks and its split points."""
    summary, inputs = MODELS[name]
    lines = [f"## {name}", "", summary, "", *_keys_lines(name)]
    for index, (input_shape, source) in enumerate(inputs):
        model = build_model(name, NUM_CLASSES, input_shape, seed=0)
        model.eval()
        blocks = list(model.blocks.items())
        shapes, params = [], []
        with torch.no_grad():
            x = torch.zeros(1, *input_shape)
            for k, (_, block) in enumerate(blocks):
                x = model.forward_blocks(x, k, k + 1)
                shapes.append(tuple(x.shape[1:]))
                params.append(sum(p.numel() for p in block.parameters()))
        profile = profile_model(model, name)
        total = sum(params)
        lines += [f"### {name} on {_shape(input_shape)} ({'default; ' if index == 0 else ''}{source})", ""]
        lines += ["| # | block | layers | parameters | output shape |", "|---|---|---|---|---|"]
        for k, ((block_name, block), count, shape) in enumerate(zip(blocks, params, shapes), start=1):
            lines.append(f"| {k} | `{block_name}` | {describe_block(block)} "
                         f"| {count:,} | {_shape(shape)} |")
        lines += ["", f"{total:,} parameters; {_count(profile.total_flops)} FLOPs per sample (forward + backward).", ""]
        lines += ["| split point | blocks on the device | activation sent (per sample) | float32 bytes per sample "
                  "| device / server parameter bytes | device / server FLOPs per sample |",
                  "|---|---|---|---|---|---|"]
        for cost in profile.splits:
            device_blocks = ", ".join(f"`{n}`" for n, _ in blocks[:cost.k])
            lines.append(f"| {cost.k} | {device_blocks} | {_shape(shapes[cost.k - 1])} | {cost.activation_bytes:,} "
                         f"| {cost.client_param_bytes:,} / {cost.server_param_bytes:,} "
                         f"| {_count(cost.client_flops)} / {_count(cost.server_flops)} |")
        lines.append("")
    return lines


def render() -> str:
    """The whole page, as committed in docs/builtin-models.md."""
    lines = [
        "# Built-in models",
        "",
        "<!-- Generated by `python -m shared.models.describe --write` from shared/models/zoo.py; do not edit by hand. -->",
        "",
        "Every built-in model (`model:` in the run configuration) is an ordered list of named blocks with",
        "three candidate split points. At split point `k` the device runs the first `k` blocks and sends",
        "their output, the activation, to the Main Server, which runs the rest. A step's activation must have",
        "the shape `[B, *activation]` below for the split point in the device's task, with",
        "`1 <= B <= train.batch_size` ([wire-format.md](wire-format.md), [api.md](api.md)); split depth zero",
        "(FedAvg, FedBC, FedIPG, FNR-FL) trains every block on the device and sends no activation.",
        "",
        f"Figures are for {NUM_CLASSES} classes (the head's parameters grow with `num_classes`: CIFAR-100",
        "has 100). Parameters count weights and biases; parameter bytes count them and BatchNorm's running",
        "mean and variance as float32 (what a device holds and uploads), as `shared/models/profile.py`",
        "measures them. FLOPs are measured by running one sample forward and backward under torch's FLOP",
        "counter: convolutions and matrix products, 2 FLOPs per multiply-add; norms, activations and",
        "pooling are not counted. The Fed Server uses these costs to choose S2FL's split points.",
        "",
        "Layer notation: `conv5x5 1->32 p2` is a 5x5 convolution from 1 to 32 channels with padding 2",
        "(`s2`: stride 2; `depthwise`: one filter per channel); `BN` batch norm; `maxpool2` a 2x2 max",
        "pool (`ceil`: ceil mode); `global avgpool` adaptive average pooling to 1x1; `dwsep 32->64 s2`",
        "MobileNet's depthwise-separable unit (depthwise 3x3 conv with that stride, BN, ReLU, pointwise 1x1",
        "conv, BN, ReLU); `residual[...] + shortcut[...], ReLU` a ResNet basic block, ReLU of the main path",
        "plus the shortcut; `Nx ...` N identical layers in a row.",
        "",
        "Regenerate after changing the zoo: `python -m shared.models.describe --write` (a unit test fails",
        "while this page and the code disagree).",
        "",
    ]
    for name in MODELS:
        lines += _model_section(name)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m shared.models.describe",
                                     description="Print (or write, or check) docs/builtin-models.md: the built-in "
                                                 "models' blocks, activation shapes, parameters and FLOPs per split.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help=f"rewrite {PAGE.name} in docs/")
    action.add_argument("--check", action="store_true", help="exit 1 if the committed page is out of date")
    action.add_argument("--keys", choices=list(MODELS), metavar="MODEL",
                        help=f"print MODEL's state-dict keys with shapes and dtypes on its default input shape "
                             f"(one of {', '.join(MODELS)})")
    args = parser.parse_args(argv)
    if args.keys:
        for key, shape, dtype in state_dict_keys(args.keys):
            print(f"{key} {dtype} {shape}")
        return
    text = render()
    if args.write:
        PAGE.write_text(text)
    elif args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python -m shared.models.describe --write", file=sys.stderr)
            sys.exit(1)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
