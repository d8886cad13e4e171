"""A trained model out of a run: files plain PyTorch loads, and a one-line loader for the user's module.

The global model is a :class:`~shared.models.SplitModel` whose state_dict keys carry a ``blocks.``
prefix (``blocks.conv1.0.weight``). The user's own model is the blocks in order: the
``nn.Sequential`` their function returned, or ``nn.Sequential(OrderedDict(blocks))`` for a mapping
or a :class:`~shared.models.ModelDefinition`, whose keys are the global model's without the prefix
(``conv1.0.weight``); or, for a module cut by tracing, that module itself, whose keys are the global
model's without the prefix and the block name (``blocks.layer1_0.layer1.0.conv1.weight`` ->
``layer1.0.conv1.weight``). Every exported file holds the user's keys, so ``net.load_state_dict(
torch.load("model.pt", weights_only=True))`` loads into the user's own ``net`` without this project.

Formats: ``pt`` (a state dict of plain tensors, ``torch.save``; loads with ``weights_only=True``),
``safetensors``, ``pt2`` (``torch.export``'s program, any batch size: ``torch.export.load``),
``torchscript`` (the blocks traced on a zero batch, for runtimes that still take TorchScript, which
PyTorch now deprecates) and ``onnx`` (where the ``onnx`` package is installed: one file up to
:data:`ONNX_SINGLE_FILE_MAX_BYTES` of weights, above it the weights in ``model.onnx.data`` beside it).
``model.json`` beside them says which model (reference, parameters, classes, input shape) the
weights are for, and :func:`load_trained` reads it.

The exporters' own chatter is kept out of the output: ``torch.onnx``'s progress lines, its note
that torchvision's operators are not registered, and PyTorch's deprecation warnings about its own
internals. Any other warning an exporter raises is kept, one line each (:attr:`Exported.warnings`).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shared.models.loading import build_model
from shared.models.split_model import SplitModel

__all__ = ["FORMATS", "Exported", "export_model", "load_trained", "plain_model", "user_state"]

#: The formats :func:`export_model` writes, and the file each one goes to.
FORMATS: dict[str, str] = {
    "pt": "model.pt", "safetensors": "model.safetensors", "pt2": "model.pt2", "torchscript": "model.torchscript.pt",
    "onnx": "model.onnx",
}
#: What says which model the weights are for (read by :func:`load_trained`).
DESCRIPTION = "model.json"
#: Weights up to this size go inside ``model.onnx``; larger ones into ``model.onnx.data`` beside it
#: (ONNX's protobuf file cannot pass 2 GiB, graph included). One file is what a user copies whole.
ONNX_SINGLE_FILE_MAX_BYTES = 1 << 30
#: The logger of ``torch.onnx``'s note, once per export, that torchvision's operators are skipped
#: (torchvision is not installed here, and no exported model uses them).
_ONNX_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"
_PREFIX = "blocks."


def user_state(model: SplitModel, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The global model's ``state`` under the user's own key names (in their module's order), each
    tensor contiguous and on the CPU (what ``safetensors`` and ``weights_only`` loading want).
    ``state`` is loaded into ``model`` on the way; one that is not ``model``'s is a ValueError."""
    try:
        model.load_state_dict(dict(state))
    except RuntimeError as exc:
        raise ValueError(f"the state is not this model's: {' '.join(str(exc).split())[:300]}") from None
    return {key: value.detach().to("cpu").contiguous() for key, value in plain_model(model).state_dict().items()}


def plain_model(model: SplitModel) -> nn.Module:
    """The model as the user wrote it, holding ``model``'s current weights: the blocks in order as a
    plain ``nn.Sequential`` (the same modules, no copy), or the user's own module the blocks were
    traced from. A traced module's tensors that its forward never uses are in no block: they keep
    the values they were built with (training never changes them)."""
    if model.source is None:
        return nn.Sequential(OrderedDict(model.blocks.items()))
    own = model.source.state_dict()
    trained = {key.split(".", 2)[2]: value for key, value in model.state_dict().items()}   # blocks.<name>.<key>
    model.source.load_state_dict({key: trained.get(key, value) for key, value in own.items()})
    return model.source


@dataclass
class Exported:
    """What :func:`export_model` wrote (format -> file) and what it could not, with the reason."""

    files: dict[str, Path] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    #: Files a format wrote besides its own, which go with it (``onnx``: ``model.onnx.data``).
    companions: dict[str, Path] = field(default_factory=dict)
    #: The exporters' warnings worth reading, one line each: ``<format>: <category>: <message>``.
    warnings: list[str] = field(default_factory=list)


def export_model(model: SplitModel, state: Mapping[str, torch.Tensor], out_dir: str | Path,
                 formats: Sequence[str] = tuple(FORMATS), description: Mapping[str, Any] | None = None) -> Exported:
    """Write ``state`` (the global model's, as checkpointed) for ``model``'s architecture into
    ``out_dir`` in each of ``formats``, and ``model.json`` with ``description`` (the model's
    reference, parameters, classes and input shape; the round it is from). A format that cannot be
    written here (ONNX without the ``onnx`` package, a model that does not trace) is skipped with
    the reason; an unknown format is a ValueError before anything is written."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown export format(s) {unknown}: choose from {', '.join(FORMATS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = user_state(model, state)
    net = plain_model(model).to("cpu").eval()
    example = torch.zeros((1, *model.input_shape))
    done = Exported()
    for fmt in formats:
        path = out / FORMATS[fmt]
        companion = path.with_name(path.name + ".data")
        if fmt == "onnx":
            companion.unlink(missing_ok=True)   # an earlier, larger export's: not this model's weights
        with _exporters_quiet() as caught:
            try:
                reason = _write(fmt, path, weights, net, example)
            except Exception as exc:   # one format failing (a model torch cannot trace) leaves the others
                reason = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        done.warnings += [line for line in (f"{fmt}: {w}" for w in caught) if line not in done.warnings]
        if reason is None:
            done.files[fmt] = path
            if fmt == "onnx" and companion.exists():
                done.companions[fmt] = companion
        else:
            done.skipped[fmt] = reason
    info = {**(description or {}), "keys": list(weights), "files": {f: p.name for f, p in done.files.items()},
            **({"companions": {f: p.name for f, p in done.companions.items()}} if done.companions else {})}
    (out / DESCRIPTION).write_text(json.dumps(info, indent=2) + "\n")
    return done


def _write(fmt: str, path: Path, weights: dict[str, torch.Tensor], net: nn.Module, example: torch.Tensor) -> str | None:
    """Write one format; the reason it cannot be written here, or None once written."""
    if fmt == "pt":
        torch.save(weights, path)
    elif fmt == "safetensors":
        if importlib.util.find_spec("safetensors") is None:
            return "the safetensors package is not installed (pip install safetensors)"
        from safetensors.torch import save
        # Written as any file here is (save_file creates its file owner-only, 0600 where the
        # others get the umask's 0644).
        path.write_bytes(save(weights))
    elif fmt == "pt2":
        torch.export.save(torch.export.export(net, (_batch_of_two(example),), dynamic_shapes=_ANY_BATCH), str(path))
    elif fmt == "torchscript":
        with torch.no_grad():
            torch.jit.trace(net, example).save(str(path))
    elif fmt == "onnx":
        if importlib.util.find_spec("onnx") is None:
            return "the onnx package is not installed (pip install onnx onnxscript)"
        size = sum(t.numel() * t.element_size() for t in weights.values())
        torch.onnx.export(net, (_batch_of_two(example),), str(path), input_names=["input"], output_names=["logits"],
                          dynamic_shapes=_ANY_BATCH, external_data=size > ONNX_SINGLE_FILE_MAX_BYTES, verbose=False)
    return None


#: The exported programs' input: any batch size (the first dimension), the rest as built.
_ANY_BATCH = ({0: torch.export.Dim("batch", min=1)},)


def _batch_of_two(example: torch.Tensor) -> torch.Tensor:
    """``example`` as a batch of two: an example batch of one would pin the batch size to 1."""
    return example.expand(2, *example.shape[1:])


@contextlib.contextmanager
def _exporters_quiet() -> Iterator[list[str]]:
    """Record the warnings raised inside (one line each, into the list given) but PyTorch's
    deprecations of its own internals, and hold back ``torch.onnx``'s torchvision note."""
    registry = logging.getLogger(_ONNX_REGISTRY_LOGGER)
    level = registry.level
    registry.setLevel(logging.ERROR)
    kept: list[str] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield kept
    finally:
        registry.setLevel(level)
    for w in caught:
        if not issubclass(w.category, (DeprecationWarning, FutureWarning)):
            line = f"{w.category.__name__}: {' '.join(str(w.message).split())[:300]}"
            if line not in kept:
                kept.append(line)


def load_trained(path: str | Path) -> nn.Module:
    """The trained model of an export (``path``: its folder, or its ``model.pt`` /
    ``model.safetensors``): the model ``model.json`` names, built as an ``nn.Sequential`` of its
    blocks (the user's own module for one cut by tracing), with the exported weights, in eval mode.
    A model given by an import path is imported, so its package must be importable here, as it was
    for the run."""
    path = Path(path)
    folder = path if path.is_dir() else path.parent
    info = json.loads((folder / DESCRIPTION).read_text())
    weights_file = path if path.is_file() else folder / FORMATS["pt"]
    if weights_file.suffix == ".safetensors":
        from safetensors.torch import load_file
        weights = load_file(str(weights_file))
    else:
        weights = torch.load(weights_file, map_location="cpu", weights_only=True)
    model = build_model(info["model"], int(info["num_classes"]), tuple(info["input_shape"]),
                        params=info.get("model_params") or {})
    net = plain_model(model)
    net.load_state_dict(weights)
    return net.eval()
