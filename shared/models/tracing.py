"""An ordinary ``nn.Module`` as a chain of blocks: traced with ``torch.fx`` and cut where one tensor is live.

A model function may return a module with its own ``forward`` instead of an ``nn.Sequential``.
:func:`trace_blocks` traces it symbolically (``torch.fx``), so its forward becomes a graph of
operations in execution order, and cuts that graph into an ordered chain of blocks the rest of the
system uses exactly as it uses a Sequential's children.

Where it cuts (docs/models.md, "An ordinary nn.Module"):

- A **cut point** is a point between two operations where exactly one value computed so far is
  still needed later, and that value is a tensor: the activation a device sends must be one
  tensor. Inside a residual connection two tensors are live (the branch and the skip), so a cut
  never falls there. Parameters and buffers read with ``self.weight`` are not activations: each
  block reads the ones it uses itself.
- A **layer** is an operation that uses parameters: a call of a module holding some, or an
  operation reading a parameter. Normalisation layers (BatchNorm, LayerNorm, GroupNorm, ...) do not
  start a layer: they belong to the layer before them.
- Between two consecutive layers the chain is cut at the *last* cut point (after the activation,
  pooling and flattening that follow a layer, so the smallest tensor crosses the network); where
  there is none, the two layers share a block. A parameter or buffer used at two places is never
  cut between them (tied weights stay in one block).

Each block is a ``torch.fx.GraphModule`` owning, under the user's own names, the submodules and
parameters its operations use (the same objects as the user's module, not copies), so a block's
state_dict keys are the user's (``layer1.0.conv1.weight``). Tracing checks that the chain gives the
module's output on a random input (eval mode) before the model is used.
"""
from __future__ import annotations

import inspect
import os
import threading
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

__all__ = ["TracedBlocks", "trace_blocks"]

#: Normalisation layers: parameters, but part of the layer before them, not a layer of their own.
_NORMS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm)
#: Operations that change only the layout of their input (or read its size): the output layer's
#: input is still the previous block's output after these.
_PASS_THROUGH_MODULES = (nn.Flatten, nn.Identity, nn.Dropout)
_PASS_THROUGH_FUNCTIONS = (torch.flatten, F.dropout, getattr)
_PASS_THROUGH_METHODS = ("flatten", "view", "reshape", "size", "contiguous")


@dataclass(frozen=True)
class TracedBlocks:
    """A module cut into blocks.

    Attributes:
        blocks: the ordered named blocks.
        feature_block: the block whose output the output layer takes (inferred), or None.
        output_layer: the model's key prefix of a final ``nn.Linear`` with a bias
            (``"blocks.fc.fc"``), or None.
        owners: the user's module path of every module and parameter owner the forward uses ->
            the block using it (``"fc" -> "fc"``), to place a declared output layer.
    """

    blocks: OrderedDict[str, fx.GraphModule]
    feature_block: str | None
    output_layer: str | None
    owners: dict[str, str]

    def output_layer_of(self, path: str) -> str:
        """The model's key prefix of the user's module ``path`` (ValueError when no block uses it)."""
        if path not in self.owners:
            raise ValueError(f"output_layer {path!r} is not a module the forward uses "
                             f"(it uses {', '.join(sorted(self.owners)) or 'none'})")
        return f"blocks.{self.owners[path]}.{path}"


def trace_blocks(module: nn.Module, input_shape: tuple[int, ...]) -> TracedBlocks:
    """Trace ``module`` and cut it into blocks (the rules are in the module docstring).

    Runs the traced forward on one batch of two samples of ``input_shape`` to learn which values
    are tensors, and (unless the module is on the meta device) checks that the chain of blocks
    gives the module's own output. Raises ValueError, one line, saying what failed and how to fix it."""
    graph_module = _trace(module)
    graph = graph_module.graph
    param = next(module.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    x = torch.randn((2, *input_shape), generator=torch.Generator().manual_seed(0), dtype=dtype,
                    device="cpu").to(device)
    with _eval(module), torch.no_grad():
        is_tensor = _value_kinds(graph_module, x, f"{type(module).__name__}.forward")
    order = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    (inp,) = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    live_at = _cut_points(order, inp, is_tensor)
    cuts = _choose_cuts(order, live_at, module)
    blocks: OrderedDict[str, fx.GraphModule] = OrderedDict()
    owners: dict[str, str] = {}
    bounds = [-1, *cuts, len(order) - 1]
    for j, (first, last) in enumerate(zip(bounds, bounds[1:])):
        part = order[first + 1:last + 1]
        name = _unique(_block_name(part, module), blocks)
        block_input = inp if j == 0 else live_at[first]
        block_output = output.args[0] if j == len(cuts) else live_at[last]
        blocks[name] = _block(module, part, block_input, block_output)
        owners.update({path: name for path in _owner_paths(part, module)})
    if device.type != "meta":
        _check_outputs(module, blocks, x)
    feature_block, output_layer = _infer_parts(blocks, module)
    return TracedBlocks(blocks, feature_block, output_layer, owners)


# ---------------------------------------------------------------------------------------- tracing
#: torch.fx patches ``nn.Module.__call__`` and ``__getattr__`` for the whole process while it
#: traces, and restores what it found when it ends: two traces at once would undo each other's
#: patches. An agent builds its devices' models in parallel threads, so one trace at a time.
_TRACE_LOCK = threading.Lock()


class _ThreadTracer(fx.Tracer):
    """A tracer that records only the calls of the thread that traces: a module that another thread
    runs meanwhile (a device checking or training its model) runs as it would untraced, instead of
    reaching this trace and failing there."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()

    def call_module(self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if threading.get_ident() != self._thread:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if threading.get_ident() != self._thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)


def _trace(module: nn.Module) -> fx.GraphModule:
    """``module``'s forward as a graph with one input; arguments after the first that have a
    default are fixed to it (``forward(x, mask=None)`` is traced as ``forward(x)``)."""
    who = f"{type(module).__name__}.forward"
    try:
        signature = inspect.signature(module.forward)
    except (TypeError, ValueError):
        signature = None
    concrete: dict[str, Any] = {}
    if signature is not None:
        params = list(signature.parameters.values())
        required = [p.name for p in params if p.default is inspect.Parameter.empty
                    and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
        if len(required) != 1 or params[0].name != required[0]:
            raise ValueError(f"{who} takes {len(required)} input(s) without a default ({', '.join(required)}); "
                             f"a model that is cut takes one tensor: forward(self, x)")
        concrete = {p.name: p.default for p in params[1:] if p.default is not inspect.Parameter.empty}
    try:
        with _TRACE_LOCK:
            tracer = _ThreadTracer()
            graph = tracer.trace(module, concrete_args=concrete or None)
        graph_module = fx.GraphModule(tracer.root, graph, type(module).__name__)
    except Exception as exc:  # the user's forward: say where and why, not torch.fx's traceback
        raise ValueError(f"{who} cannot be traced by torch.fx{_where(exc)}: {_first_line(exc)}; make forward "
                         f"traceable (no `if` or loop on tensor values) or return an nn.Sequential or "
                         f"ModelDefinition(blocks) of its parts (docs/models.md)") from None
    _drop_fixed_arguments(graph_module.graph)
    return graph_module


def _drop_fixed_arguments(graph: fx.Graph) -> None:
    """Remove the placeholders of the arguments fixed to their defaults and the guards torch.fx
    adds on them (they only check the value is the default)."""
    pending = [n for n in graph.nodes if n.op == "placeholder"][1:]
    doomed: set[fx.Node] = set()
    while pending:
        node = pending.pop()
        if node not in doomed:
            doomed.add(node)
            pending.extend(node.users)
    for node in reversed(list(graph.nodes)):
        if node in doomed:
            graph.erase_node(node)


def _where(exc: BaseException) -> str:
    """`` at file:line`` of the innermost frame outside torch (the user's line that failed)."""
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(torch_dir)]
    return f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if len(frames) > 1 else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class _eval:
    """Eval mode for ``module`` (and every submodule) inside the ``with``; each restored after."""

    def __init__(self, *modules: nn.Module) -> None:
        self.modes = [(m, m.training) for module in modules for m in module.modules()]

    def __enter__(self) -> None:
        for m, _ in self.modes:
            m.training = False

    def __exit__(self, *_: object) -> None:
        for m, training in self.modes:
            m.training = training


def _value_kinds(graph_module: fx.GraphModule, x: Tensor, who: str) -> dict[fx.Node, bool]:
    """Run the traced forward (``who``) on ``x``: for every node, whether its value is a tensor."""
    kinds: dict[fx.Node, bool] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            kinds[n] = isinstance(value, Tensor)
            return value

    try:
        Recorder(graph_module).run(x)
    except Exception as exc:
        raise ValueError(f"{who} fails on a batch of shape {list(x.shape)}: "
                         f"{_first_line(exc)}") from None
    return kinds


# ---------------------------------------------------------------------------------------- cutting
def _cut_points(order: list[fx.Node], inp: fx.Node, is_tensor: dict[fx.Node, bool]) -> dict[int, fx.Node]:
    """Position ``i`` in ``order`` -> the one tensor live after ``order[i]``, for every position
    after which exactly one value is needed later (and it is a tensor). The last position is not
    a cut (nothing follows it)."""
    end = len(order)
    position = {inp: -1, **{n: i for i, n in enumerate(order)}}
    last_use = {n: max((position.get(u, end) for u in n.users), default=at) for n, at in position.items()}
    live_at: dict[int, fx.Node] = {}
    live = {inp}
    for i, node in enumerate(order):
        live = {n for n in (*live, node) if last_use[n] > i}
        if len(live) == 1 and i < end - 1:
            (value,) = live
            if is_tensor.get(value, False):
                live_at[i] = value
    return live_at


def _tensors_used(node: fx.Node, module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The parameters and buffers ``node`` reads: all of a called module's, and those read directly."""
    if node.op == "call_module":
        called = module.get_submodule(str(node.target))
        for name, tensor in (*called.named_parameters(), *called.named_buffers()):
            yield f"{node.target}.{name}", tensor
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            value = _attribute(module, str(arg.target))
            if isinstance(value, Tensor):
                yield str(arg.target), value


def _attribute(module: nn.Module, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, name)


def _is_layer(node: fx.Node, module: nn.Module) -> bool:
    """Whether ``node`` starts a layer: a call of a module holding parameters (not a normalisation),
    or an operation reading a parameter."""
    if node.op == "call_module":
        called = module.get_submodule(str(node.target))
        return not isinstance(called, _NORMS) and next(called.parameters(), None) is not None
    return any(isinstance(_attribute(module, str(a.target)), nn.Parameter)
               for a in node.all_input_nodes if a.op == "get_attr")


def _choose_cuts(order: list[fx.Node], live_at: dict[int, fx.Node], module: nn.Module) -> list[int]:
    """The positions the chain is cut after: between two consecutive layers, the last cut point
    that no shared parameter spans. ValueError when that leaves a single block."""
    uses: dict[int, tuple[str, int, int]] = {}   # id(tensor) -> (name, first use, last use)
    for i, node in enumerate(order):
        for name, tensor in _tensors_used(node, module):
            first = uses.get(id(tensor), (name, i, i))
            uses[id(tensor)] = (first[0], first[1], i)
    spans = [(name, lo, hi) for name, lo, hi in uses.values() if lo < hi]

    def spanned_by(i: int) -> str | None:
        return next((name for name, lo, hi in spans if lo <= i < hi), None)

    layers = [i for i, n in enumerate(order) if _is_layer(n, module)]
    cuts: list[int] = []
    shared: set[str] = set()
    for a, b in zip(layers, layers[1:]):
        options = [i for i in live_at if a <= i < b]
        shared.update(name for name in map(spanned_by, options) if name is not None)
        allowed = [i for i in options if spanned_by(i) is None]
        if allowed:
            cuts.append(max(allowed))
    if not cuts:
        why = (f"parameter {sorted(shared)[0]!r} is used on both sides of every possible cut (shared weights stay "
               f"in one block)" if shared else
               f"no point between two layers with parameters ({len(layers)} found) has exactly one tensor "
               f"live (what crosses the network at a cut)")
        raise ValueError(f"{type(module).__name__}.forward cannot be cut into two blocks: {why}; return an "
                         f"nn.Sequential or ModelDefinition(blocks) of its parts (docs/models.md)")
    return cuts


# ---------------------------------------------------------------------------------------- blocks
def _block(module: nn.Module, part: list[fx.Node], block_input: fx.Node, block_output: Any) -> fx.GraphModule:
    """The nodes ``part`` as a GraphModule taking ``block_input``'s value and returning
    ``block_output``'s, owning what they read of ``module`` under the same names."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {block_input: graph.placeholder("x")}

    def value(node: fx.Node) -> fx.Node:
        if node not in env:   # a parameter or buffer: each block reads its own
            if node.op != "get_attr":
                raise AssertionError(f"value {node.name} crosses a cut point")
            env[node] = graph.get_attr(str(node.target))
        return env[node]

    for node in part:
        env[node] = graph.node_copy(node, value)
    graph.output(fx.node.map_arg(block_output, value))
    return fx.GraphModule(module, graph, class_name=f"{type(module).__name__}Block")


def _owner_paths(part: list[fx.Node], module: nn.Module) -> Iterator[str]:
    """The user's paths of the layers in ``part``: called modules, and owners of parameters read."""
    for node in part:
        if not _is_layer(node, module):
            continue
        if node.op == "call_module":
            yield str(node.target)
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and isinstance(_attribute(module, str(arg.target)), nn.Parameter):
                owner = str(arg.target).rpartition(".")[0]
                yield owner or str(arg.target)


def _block_name(part: list[fx.Node], module: nn.Module) -> str:
    """The longest module path common to the block's layers (``layer1.0``), else its first
    layer's path (``conv1``), with ``_`` for ``.`` (a block name has no dots). Every block holds a
    layer: the chain is cut only between two."""
    paths = [p.split(".") for p in _owner_paths(part, module)]
    return "_".join(os.path.commonprefix(paths) or paths[0])


def _unique(name: str, taken: OrderedDict[str, fx.GraphModule]) -> str:
    """``name``, or ``name_2``, ``name_3``, ... when taken or an attribute of ``nn.ModuleDict``."""
    base = name if not hasattr(nn.ModuleDict(), name) else f"{name}_"
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}_{n}"
    return candidate


def _check_outputs(module: nn.Module, blocks: OrderedDict[str, fx.GraphModule], x: Tensor) -> None:
    """The chain of blocks must give the module's output on ``x`` (eval mode)."""
    with _eval(module, *blocks.values()), torch.no_grad():
        want = module(x)
        got = x
        for block in blocks.values():
            got = block(got)
    who = f"{type(module).__name__}.forward"
    if not isinstance(want, Tensor) or not isinstance(got, Tensor):
        raise ValueError(f"{who} returns {type(want).__name__}, not a tensor of logits")
    if want.shape != got.shape or not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
        diff = "shape " + str(list(got.shape)) if want.shape != got.shape else \
            f"largest difference {(want - got).abs().max().item():.3g}"
        raise ValueError(f"the blocks traced from {who} do not reproduce its output ({diff}): a forward that reads "
                         f"self.training, draws random numbers or keeps state between calls cannot be traced "
                         f"faithfully; return an nn.Sequential or ModelDefinition(blocks) of its parts (docs/models.md)")


def _is_pass_through(node: fx.Node, module: nn.Module) -> bool:
    if node.op == "call_module":
        return isinstance(module.get_submodule(str(node.target)), _PASS_THROUGH_MODULES)
    if node.op == "call_function":
        return node.target in _PASS_THROUGH_FUNCTIONS
    return node.op == "call_method" and node.target in _PASS_THROUGH_METHODS


def _infer_parts(blocks: OrderedDict[str, fx.GraphModule], module: nn.Module) -> tuple[str | None, str | None]:
    """``(feature_block, output_layer)``: the last block's output is a call of an ``nn.Linear``
    with a bias -> that Linear is the output layer; when the last block does nothing else than
    reshape or drop out before it, the block before is the feature block."""
    names = list(blocks)
    graph = blocks[names[-1]].graph
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    if not isinstance(out, fx.Node) or out.op != "call_module":
        return None, None
    layer = module.get_submodule(str(out.target))
    if not isinstance(layer, nn.Linear) or layer.bias is None:
        return None, None
    before = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output") and n is not out]
    direct = all(_is_pass_through(n, module) for n in before)
    return (names[-2] if direct else None), f"blocks.{names[-1]}.{out.target}"
