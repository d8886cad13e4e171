"""Building a model from its reference: a built-in (zoo) name or an import path ``package.module:function``.

One entry point, :func:`build_model`, serves every process (Fed Server, Main Server, device agent,
profile, benchmarks, experiments), so the same reference, parameters and seed give the same model
everywhere. The zoo's names are entries of the same mechanism: a name maps to a builder function
in :data:`BUILTIN_MODELS`, an import path is imported. What a function may return, the defaults
and the inference rules are documented in docs/models.md.

Import paths are code: they are taken only from the operator (the Fed Server's config, the Main
Server's and device agent's ``--model``), never from a message (:func:`check_model_origin`).
"""
from __future__ import annotations

import inspect
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shared.imports import check_import_origin, import_callable, is_import_path
from shared.models.split_model import SplitModel
from shared.models.tracing import trace_blocks
from shared.models.zoo import DEFAULT_INPUT_SHAPES, ZOO_BUILDERS

__all__ = ["ModelDefinition", "BUILTIN_MODELS", "build_model", "build_model_layout", "is_import_path",
           "check_model_origin"]

#: Built-in model names -> builder functions (the zoo). An import path is looked up only when the
#: reference is not one of these.
BUILTIN_MODELS: Mapping[str, Callable[..., Any]] = ZOO_BUILDERS


@dataclass
class ModelDefinition:
    """What a model function may return when it declares more than its blocks.

    Attributes:
        blocks: the ordered named blocks (an ``nn.Sequential`` or a mapping name -> module), or a
            module with its own forward, cut into blocks by tracing (:mod:`shared.models.tracing`).
        split_points: candidate cut positions ``k`` (device runs ``blocks[:k]``); None = every
            block boundary ``1..n-1``; an empty sequence = never cut (split-depth-zero algorithms only).
        feature_block: name of the block whose (flattened) output is the penultimate feature vector;
            None = inferred (see :func:`infer_parts`).
        output_layer: module path of the final ``nn.Linear`` inside the blocks (``"head"`` or
            ``"classifier.2"``), or in the traced module (``"fc"``); None = inferred.
    """

    blocks: nn.Module | Mapping[str, nn.Module]
    split_points: Sequence[int] | None = None
    feature_block: str | None = None
    output_layer: str | None = None


def check_model_origin(run_model: str, local_model: str | None) -> None:
    """Refuse to import a model named by the network: a run whose model is an import path is built
    only if the operator gave this process the same reference (``--model``). A built-in name may
    come from anywhere. Raises ValueError saying how to start the process."""
    check_import_origin("model", run_model, local_model)


def _resolve(ref: str) -> Callable[..., Any]:
    """The builder function for ``ref``: a built-in entry, or the imported ``module:function``."""
    if ref in BUILTIN_MODELS:
        return BUILTIN_MODELS[ref]
    if ":" not in ref:
        raise ValueError(f"unknown model {ref!r}: use a built-in name ({', '.join(BUILTIN_MODELS)}) "
                         f"or an import path package.module:function")
    return import_callable(ref, f"model {ref!r}")


def _call(ref: str, fn: Callable[..., Any], num_classes: int, input_shape: tuple[int, ...],
          params: Mapping[str, Any]) -> Any:
    """``fn(**params)`` plus ``num_classes=`` and ``input_shape=`` where its signature takes them."""
    reserved = {"num_classes", "input_shape"} & set(params)
    if reserved:
        raise ValueError(f"model {ref!r}: model_params may not set {sorted(reserved)}: they come from the data spec")
    kwargs = dict(params)
    try:
        sig = inspect.signature(fn)
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        for name, value in (("num_classes", num_classes), ("input_shape", input_shape)):
            if takes_any or name in sig.parameters:
                kwargs[name] = value
    except (TypeError, ValueError):  # no signature (a builtin): pass what the user gave
        pass
    try:
        return fn(**kwargs)
    except TypeError as exc:
        raise ValueError(f"model {ref!r}: calling it with model_params {dict(params)} failed: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"model {ref!r}: {exc}") from None
    except Exception as exc:  # the user's code failed: say whose, keep the reason
        raise ValueError(f"model {ref!r}: building it failed: {type(exc).__name__}: {exc}") from None


def _blocks_of(value: Any) -> OrderedDict[str, nn.Module]:
    if isinstance(value, nn.Sequential):
        items = list(value.named_children())
    elif isinstance(value, Mapping):
        items = list(value.items())
    else:
        raise ValueError(f"blocks must be an nn.Module, an nn.Sequential or a mapping name -> module, "
                         f"got {type(value).__name__}")
    for name, module in items:
        if not isinstance(name, str) or not isinstance(module, nn.Module):
            raise ValueError(f"block {name!r} is not a named nn.Module ({type(module).__name__})")
    if len(items) < 2:
        raise ValueError(f"needs at least two blocks to be split or profiled, got {len(items)} "
                         f"({[n for n, _ in items]})")
    return OrderedDict(items)


def _final_linear(block: nn.Module) -> str | None:
    """Path (relative to ``block``) of a final bias-carrying ``nn.Linear``: "" for the block itself,
    ``"2"`` for the last module of a Sequential; None when the block does not end in one."""
    if isinstance(block, nn.Linear):
        return "" if block.bias is not None else None
    if isinstance(block, nn.Sequential) and len(block) > 0:
        inner = _final_linear(block[-1])
        if inner is not None:
            last = str(len(block) - 1)
            return f"{last}.{inner}" if inner else last
    return None


# Modules that change no values, only the layout: a feature block's output followed by these and
# then the output Linear is still that Linear's input.
_PASS_THROUGH = (nn.Flatten, nn.Identity, nn.Dropout)


def infer_parts(blocks: Mapping[str, nn.Module]) -> tuple[str | None, str | None]:
    """``(feature_block, output_layer)`` of a model that declares neither.

    The output layer is the last block when it is an ``nn.Linear`` with a bias, or a Sequential
    ending in one (its key prefix, e.g. ``"blocks.head"`` or ``"blocks.classifier.2"``). The feature
    block is the block before it, inferred only when the output Linear's input *is* that block's
    (flattened) output: the last block is the Linear alone, or a Sequential whose other modules
    are Flatten/Identity/Dropout. Anything else is not guessed: None.
    """
    names = list(blocks)
    last = blocks[names[-1]]
    path = _final_linear(last)
    if path is None:
        return None, None
    output_layer = f"blocks.{names[-1]}" + (f".{path}" if path else "")
    direct = path == "" or (isinstance(last, nn.Sequential)
                            and all(isinstance(m, _PASS_THROUGH) for m in list(last)[:-1])
                            and "." not in path)
    return (names[-2] if direct else None), output_layer


def _split_model(ref: str, value: Any, num_classes: int, input_shape: tuple[int, ...]) -> SplitModel:
    """Whatever the function returned -> a :class:`SplitModel` (ValueError naming what is wrong)."""
    if isinstance(value, SplitModel):
        return value
    definition = value if isinstance(value, ModelDefinition) else ModelDefinition(value) \
        if isinstance(value, (nn.Module, Mapping)) else None
    if definition is None:
        raise ValueError(f"model {ref!r}: returned {type(value).__name__}; return an nn.Sequential, an ordered "
                         f"mapping name -> module, an nn.Module with its own forward, or "
                         f"shared.models.ModelDefinition(blocks, ...)")
    try:
        if isinstance(definition.blocks, nn.Module) and not isinstance(definition.blocks, nn.Sequential):
            source: nn.Module | None = definition.blocks
            traced = trace_blocks(definition.blocks, input_shape)
            blocks: Mapping[str, nn.Module] = traced.blocks
            feature_block, output_layer = traced.feature_block, traced.output_layer
            if definition.output_layer is not None:
                output_layer = traced.output_layer_of(definition.output_layer)
        else:
            source = None
            blocks = _blocks_of(definition.blocks)
            feature_block, output_layer = infer_parts(blocks)
            if definition.output_layer is not None:
                output_layer = f"blocks.{definition.output_layer}"
        if definition.output_layer is not None:
            feature_block = None   # inferred from a different output layer: not trusted
        if definition.feature_block is not None:
            feature_block = definition.feature_block
        split_points = range(1, len(blocks)) if definition.split_points is None else definition.split_points
        return SplitModel(blocks, split_points, feature_block, output_layer, input_shape, num_classes, source)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"model {ref!r}: {exc}") from None


def _check_shapes(ref: str, model: SplitModel) -> None:
    """Run a zero batch of one sample through the blocks one at a time (on the model's device: the
    meta device costs nothing) and name the first block that cannot take its input, then check the
    output is ``[N, num_classes]``. Eval mode, so BatchNorm accepts one sample; restored after."""
    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    x = torch.zeros((1, *model.input_shape), dtype=dtype, device=device)
    was_training = model.training
    model.eval()
    previous = "the input"
    who = f"model {ref!r} with input_shape {list(model.input_shape)}"
    try:
        with torch.no_grad():
            for name, block in model.blocks.items():
                try:
                    x = block(x)
                except Exception as exc:
                    raise ValueError(f"{who}: block {name!r} cannot take {previous} "
                                     f"(shape {list(x.shape)}): {exc}") from None
                if not isinstance(x, torch.Tensor):
                    raise ValueError(f"{who}: block {name!r} returned {type(x).__name__}, not a tensor")
                previous = f"the output of block {name!r}"
    finally:
        model.train(was_training)
    if tuple(x.shape) != (1, model.num_classes):
        raise ValueError(f"{who}: the output has shape {list(x.shape)} for one sample; expected "
                         f"[1, {model.num_classes}] ([N, num_classes])")


#: One build at a time in a process: a build forks the process's one CPU generator and seeds it.
#: Two threads building at once (an agent's devices) seeded each other's builds (every weight
#: differed from a build alone), and under ``torch.device("meta")`` they could deadlock in torch's
#: generator lock (both waiting in ``get_rng_state``).
_BUILDING = threading.RLock()   # re-entrant: a model function may build a built-in model itself


def build_model(
    ref: str,
    num_classes: int = 10,
    input_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
) -> SplitModel:
    """Build model ``ref`` (a built-in name or ``package.module:function``) as a :class:`SplitModel`.

    The function is called with ``**params`` plus ``num_classes=``/``input_shape=`` when its
    signature accepts them. Weights are initialised deterministically from ``seed`` (on the CPU, the
    default device, where every process builds them): the global torch CPU RNG state is saved and restored, so building never perturbs other code, and the same arguments
    give an identical state_dict. Under ``with torch.device("meta")`` the model (and the shape check)
    costs no memory. ``input_shape`` may be omitted for built-in names (their default). Raises
    ValueError naming the reference and, where it applies, the block at fault.
    """
    fn = _resolve(ref)
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if input_shape is None:
        if ref not in DEFAULT_INPUT_SHAPES:
            raise ValueError(f"model {ref!r}: input_shape is required")
        input_shape = DEFAULT_INPUT_SHAPES[ref]
    shape = tuple(int(d) for d in input_shape)
    if not shape or min(shape) < 1:
        raise ValueError(f"input_shape must be positive sizes, got {list(input_shape)}")
    if ref in DEFAULT_INPUT_SHAPES and len(shape) != len(DEFAULT_INPUT_SHAPES[ref]):
        raise ValueError(f"model {ref!r}: input_shape must be (C, H, W), got {list(shape)}")
    with _BUILDING, torch.random.fork_rng(devices=[]):
        # The CPU generator, which builds the weights, seeded directly: torch.manual_seed would also
        # queue a seeding for each accelerator, formatting a stack trace per call where none is
        # initialised (milliseconds per build, paid by each device an agent sets up).
        torch.default_generator.manual_seed(seed)
        model = _split_model(ref, _call(ref, fn, num_classes, shape, params or {}), num_classes, shape)
    if (model.num_classes, model.input_shape) != (num_classes, shape):
        raise ValueError(f"model {ref!r}: returned a SplitModel for {model.num_classes} classes and input "
                         f"{list(model.input_shape)}, asked for {num_classes} and {list(shape)}")
    _check_shapes(ref, model)
    model.ref = ref
    return model


def build_model_layout(
    ref: str,
    num_classes: int = 10,
    input_shape: tuple[int, ...] | None = None,
    seed: int = 0,
    params: Mapping[str, Any] | None = None,
) -> SplitModel:
    """The model's structure on the meta device (names, shapes, dtypes; no memory), checked.

    Built on the meta device; a model whose code cannot run there (an operation without a meta
    kernel, a ``.item()`` or data-dependent branch while building or in a forward) is built for
    real instead and moved there, and that build's error, if any, is the one raised. So a model
    never fails only because of the meta device."""
    try:
        with torch.device("meta"):
            return build_model(ref, num_classes, input_shape, seed=seed, params=params)
    except Exception:  # noqa: BLE001 - retried for real below, whose error is the one reported
        return build_model(ref, num_classes, input_shape, seed=seed, params=params).to("meta")
