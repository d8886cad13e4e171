"""Per-split-point cost profile of a :class:`SplitModel`: parameter bytes, cut activation, FLOPs.

The S2FL scheduler needs, for each candidate split point ``k``, how much model the device holds
and trains (``blocks[:k]``), how big the activation it uploads per sample is, and how the training
compute divides between device and server. FLOPs are measured, not estimated by hand: one
forward+backward pass of a single sample runs under ``torch.utils.flop_counter.FlopCounterMode``,
which counts convolutions and matmuls (2 FLOPs per multiply-add) and attributes both forward and
backward ops to the module that ran them (keys like ``"SplitModel.blocks.conv1"``). Norms,
activations and pooling are not counted (negligible next to conv/matmul).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count

from shared.models.split_model import SplitModel
from shared.ranges import consecutive_runs

__all__ = ["SplitCost", "ModelProfile", "profile_model", "candidate_split_points"]


@dataclass(frozen=True)
class SplitCost:
    """Cost of cutting at split point ``k``, per ONE training sample."""

    k: int
    client_param_bytes: int  # bytes of float32 params + float buffers in blocks[:k]
    server_param_bytes: int  # same for blocks[k:]
    activation_bytes: int  # bytes of the float32 activation at the cut (one sample)
    client_flops: float  # forward+backward FLOPs of blocks[:k] for one sample
    server_flops: float  # forward+backward FLOPs of blocks[k:] for one sample


@dataclass(frozen=True)
class ModelProfile:
    """Whole-model totals and one :class:`SplitCost` per split point (same order as ``split_points``)."""

    model: str
    total_param_bytes: int
    total_flops: float  # forward+backward per sample
    splits: tuple[SplitCost, ...]

    def cost(self, k: int) -> SplitCost:
        """The :class:`SplitCost` of split point ``k`` (a cut position, not an index into ``splits``)."""
        for s in self.splits:
            if s.k == k:
                return s
        raise KeyError(f"{k} is not a split point of {self.model!r}; split points: {[s.k for s in self.splits]}")


_FLOAT32_BYTES = 4


def _conv_backward_flop(
    grad_out_shape: list[int],
    x_shape: list[int],
    w_shape: list[int],
    _bias: object,
    _stride: object,
    _padding: object,
    _dilation: object,
    transposed: bool,
    _output_padding: object,
    groups: int,
    output_mask: list[bool],
    out_shape: list[list[int]] | None = None,
    **kwargs: object,
) -> int:
    """``aten.convolution_backward`` FLOPs, with the weight-gradient term divided by ``groups``.

    torch's built-in formula (torch 2.13) ignores ``groups`` in the weight-gradient term, which
    overcounts a depthwise conv's backward by a factor of its channel count (MobileNet's backward
    came out ~10x its forward). The input-gradient term is already right (it is derived from the
    grouped weight shape), so it is kept exactly as torch computes it.
    """

    def t(shape: list[int]) -> list[int]:
        return [shape[1], shape[0], *shape[2:]]

    flops = 0
    if output_mask[0]:
        flops += conv_flop_count(grad_out_shape, w_shape, list(x_shape), not transposed)
    if output_mask[1]:
        if transposed:
            weight_term = conv_flop_count(t(grad_out_shape), t(x_shape), t(w_shape), transposed=False)
        else:
            weight_term = conv_flop_count(t(x_shape), t(grad_out_shape), t(w_shape), transposed=False)
        flops += weight_term // max(int(groups), 1)
    return flops


_CUSTOM_FLOPS = {torch.ops.aten.convolution_backward: _conv_backward_flop}


def _block_state_bytes(block: nn.Module) -> int:
    """Bytes of the block's parameters and floating-point buffers, counted as float32.

    Integer buffers (BatchNorm's ``num_batches_tracked``) are excluded: they are bookkeeping, not
    model weights, and are not what a device uploads for aggregation in any meaningful amount.
    """
    n = sum(p.numel() for p in block.parameters())
    n += sum(b.numel() for b in block.buffers() if b.is_floating_point())
    return n * _FLOAT32_BYTES


def _measure(model: SplitModel) -> tuple[list[float], list[int]]:
    """Forward+backward FLOPs per block and output numel per block, for one sample.

    Runs in eval mode (so BatchNorm running stats are not updated and a batch of one is valid) and
    takes gradients with ``torch.autograd.grad`` (so no ``.grad`` is left on the parameters). The
    input does not require grad, as on a real device: the first layer computes no input gradient.
    """
    names = model.block_names()
    out_numel: dict[str, int] = {}
    hooks = [
        model.blocks[n].register_forward_hook(
            lambda _m, _i, out, n=n: out_numel.__setitem__(n, out[0].numel())  # per-sample numel
        )
        for n in names
    ]
    param = next(model.parameters())
    x = torch.zeros((1, *model.input_shape), dtype=param.dtype, device=param.device)
    params = [p for p in model.parameters() if p.requires_grad]
    modes = [(m, m.training) for m in model.modules()]  # restored exactly, per submodule
    model.eval()
    try:
        with FlopCounterMode(display=False, custom_mapping=_CUSTOM_FLOPS) as counter:
            with torch.enable_grad():
                out = model(x)
                if params:
                    torch.autograd.grad(out.sum(), params)
    finally:
        for m, training in modes:
            m.training = training
        for h in hooks:
            h.remove()

    counts = counter.get_flop_counts()
    root = type(model).__name__
    flops = [float(sum(counts.get(f"{root}.blocks.{n}", {}).values())) for n in names]
    total = float(counter.get_total_flops())
    if abs(sum(flops) - total) > 1e-6 * max(total, 1.0):  # guards against a change in the key format
        raise RuntimeError(
            f"per-block FLOPs ({sum(flops)}) do not add up to the total ({total}); "
            f"counter keys: {sorted(counts)}"
        )
    return flops, [out_numel[n] for n in names]


def profile_model(model: SplitModel, name: str = "") -> ModelProfile:
    """Measure the per-sample cost of every split point of ``model`` (nothing is cached)."""
    flops, numels = _measure(model)
    block_bytes = [_block_state_bytes(b) for b in model.blocks.values()]
    total_bytes = sum(block_bytes)
    total_flops = float(sum(flops))
    splits = tuple(
        SplitCost(
            k=k,
            client_param_bytes=sum(block_bytes[:k]),
            server_param_bytes=sum(block_bytes[k:]),
            activation_bytes=numels[k - 1] * _FLOAT32_BYTES,
            client_flops=float(sum(flops[:k])),
            server_flops=float(sum(flops[k:])),
        )
        for k in model.split_points
    )
    return ModelProfile(model=name, total_param_bytes=total_bytes, total_flops=total_flops, splits=splits)


def candidate_split_points(profile: ModelProfile, candidates: int | Sequence[int] | None) -> list[int]:
    """The split points a run's planner chooses among (``split.candidates``, docs/configuration.md),
    ascending; ValueError, one line, for a setting the model cannot meet.

    None: every split point of the model. A list: those split points, each the model's, listed once
    in increasing order. A number N: the model's split points cut into N consecutive stretches of
    (nearly) equal length, and from each the one whose activation (the bytes a device sends per
    sample) is smallest, the earlier of equal ones. The stretches keep the choice spread from
    shallow to deep cuts, which a sliding split needs; within each the cheapest cut to send wins.
    """
    points = [s.k for s in profile.splits]
    if candidates is None:
        return points
    model = f"model {profile.model!r}" if profile.model else "the model"
    if isinstance(candidates, int):
        if not 1 <= candidates <= len(points):
            raise ValueError(f"split.candidates: {candidates} cut points, but {model} has {len(points)} split "
                             f"point(s) ({_points(points)}): give at most {len(points)}")
        stretches = [points[i * len(points) // candidates:(i + 1) * len(points) // candidates]
                     for i in range(candidates)]
        return [min(stretch, key=lambda k: (profile.cost(k).activation_bytes, k)) for stretch in stretches]
    chosen = list(candidates)
    unknown = [k for k in chosen if k not in points]
    if unknown:
        raise ValueError(f"split.candidates: {unknown} {'is not a split point' if len(unknown) == 1 else 'are not split points'} "
                         f"of {model} (its split points: {_points(points)})")
    if not chosen or chosen != sorted(set(chosen)):
        raise ValueError(f"split.candidates: {chosen}: list split points once each, in increasing order")
    return chosen


def _points(points: Sequence[int]) -> str:
    """Split points as runs: ``1-27``, ``1-3, 5``."""
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in consecutive_runs(points)) or "none"
