"""A model expressed as an ordered list of named blocks that can be cut at candidate split points.

Split federated learning cuts one network between a device (client) and a server: the client runs
``blocks[:k]`` and sends the activation at the cut to the server, which runs ``blocks[k:]``. Every
model in the zoo is a :class:`SplitModel` so that the cut, the parameter exchange (by state_dict
key) and the cost profile can all be expressed in terms of block indices.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from torch import Tensor, nn

__all__ = ["SplitModel", "Portion", "DevicePortion"]


class Portion(nn.Module):
    """A contiguous range ``blocks[start:end]`` of a :class:`SplitModel`.

    The portion holds the *same* block module objects as the full model (no copy), registered under
    ``self.blocks`` so that its state_dict keys are exactly the full model's keys for those blocks
    (``"blocks.conv1.weight"``, ...). Training a portion therefore trains the full model in place,
    and a portion's state_dict can be merged into the full model's with no key translation.
    """

    def __init__(self, blocks: Mapping[str, nn.Module], start: int, end: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(OrderedDict(blocks))
        self.start = int(start)
        self.end = int(end)

    def block_names(self) -> list[str]:
        """Names of the blocks in this portion, in execution order."""
        return list(self.blocks.keys())

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


class DevicePortion(Portion):
    """What a U-shaped device holds: its front ``blocks[:split_point]`` and its head
    ``blocks[head_start:]`` (the same block objects as the full model), state_dict keys exactly the
    full model's for those blocks. It runs in two parts, :meth:`front` and :meth:`head`, with the
    Main Server's middle between them: calling it whole is an error."""

    _front: Portion
    _head: Portion

    def __init__(self, model: "SplitModel", split_point: int, head_start: int) -> None:
        names = model.block_names()
        blocks = {n: model.blocks[n] for n in names[:split_point] + names[head_start:]}
        super().__init__(blocks, 0, len(names))
        self.split_point = int(split_point)
        self.head_start = int(head_start)
        # Plain attributes, not submodules: their blocks are this portion's (registered above once).
        object.__setattr__(self, "_front", model.portion(0, split_point))
        object.__setattr__(self, "_head", model.portion(head_start, len(names)))

    def front(self) -> Portion:
        """The blocks before the cut, whose output the device sends."""
        return self._front

    def head(self) -> Portion:
        """The last blocks, which turn the middle's output into the model's."""
        return self._head

    def forward(self, x: Tensor) -> Tensor:
        raise TypeError("a U-shaped device portion runs in two parts (front, then head on the middle's output)")


class SplitModel(nn.Module):
    """A model as an ordered list of named blocks, with candidate split points.

    Attributes:
        blocks: the ordered named blocks; the model is ``blocks[-1](...blocks[0](x))``.
        split_points: candidate cut positions ``k`` (client = ``blocks[:k]``, server = ``blocks[k:]``),
            strictly increasing, each ``1 <= k < len(blocks)``; may be empty (a model that is never
            cut, usable only with split-depth-zero algorithms). The zoo's models have three.
        feature_block: name of the block whose output is the flat penultimate feature vector, or
            None when the model does not declare one (FNR-FL and FedIPG need it).
        output_layer: state_dict key prefix of the final Linear (``f"{output_layer}.bias"`` is a
            key), or None when the model does not declare one (FedIPG and HiCS-FL need it).
        input_shape: the shape of one sample, any rank (``(C, H, W)`` for images, ``(F,)`` for tabular).
        num_classes: number of output logits.
        source: the user's own module when the blocks were traced from it
            (:mod:`shared.models.tracing`), else None. Not a submodule: its tensors are the blocks'
            (so they are not counted, moved or saved twice); export gives its key names back.
    """

    source: nn.Module | None

    def __init__(
        self,
        blocks: Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]],
        split_points: Iterable[int],
        feature_block: str | None,
        output_layer: str | None,
        input_shape: tuple[int, ...],
        num_classes: int,
        source: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict(OrderedDict(blocks.items() if isinstance(blocks, Mapping) else blocks))
        self.split_points: tuple[int, ...] = tuple(int(k) for k in split_points)
        self.feature_block = None if feature_block is None else str(feature_block)
        self.output_layer = None if output_layer is None else str(output_layer)
        self.input_shape: tuple[int, ...] = tuple(int(d) for d in input_shape)
        self.num_classes = int(num_classes)
        #: The reference it was built from (set by ``build_model``; part of the fingerprint).
        self.ref = ""
        object.__setattr__(self, "source", source)   # a plain attribute, not a registered submodule
        self._validate()

    def _validate(self) -> None:
        n = len(self.blocks)
        if n < 2:
            raise ValueError(f"a SplitModel needs at least two blocks, got {n}: {self.block_names()}")
        ks = self.split_points
        if any(not 1 <= k < n for k in ks) or any(a >= b for a, b in zip(ks, ks[1:])):
            raise ValueError(f"split_points must be strictly increasing within [1, {n - 1}], got {list(ks)}")
        if self.feature_block is not None and self.feature_block not in self.blocks:
            raise ValueError(f"feature_block {self.feature_block!r} is not a block: {self.block_names()}")
        if self.output_layer is not None and f"{self.output_layer}.bias" not in self.state_dict():
            raise ValueError(f"output_layer {self.output_layer!r} has no bias key in the state_dict")
        if not self.input_shape or min(self.input_shape) < 1:
            raise ValueError(f"input_shape must be positive sizes, got {list(self.input_shape)}")

    # ------------------------------------------------------------------ structure
    def block_names(self) -> list[str]:
        """Names of all blocks, in execution order."""
        return list(self.blocks.keys())

    def _check_range(self, start: int, end: int) -> None:
        if not 0 <= start <= end <= len(self.blocks):
            raise IndexError(f"block range [{start}, {end}) out of bounds for {len(self.blocks)} blocks")

    # ------------------------------------------------------------------ compute
    def forward(self, x: Tensor) -> Tensor:
        """Run all blocks."""
        return self.forward_blocks(x, 0, len(self.blocks))

    def forward_blocks(self, x: Tensor, start: int, end: int) -> Tensor:
        """Run ``blocks[start:end]`` on ``x`` (the input of block ``start``)."""
        self._check_range(start, end)
        for block in list(self.blocks.values())[start:end]:
            x = block(x)
        return x

    def features(self, x: Tensor) -> Tensor:
        """Penultimate features: the flat ``[N, D]`` output of ``feature_block``."""
        if self.feature_block is None:
            raise ValueError("this model declares no feature_block (docs/models.md)")
        end = self.block_names().index(self.feature_block) + 1
        return self.forward_blocks(x, 0, end).flatten(1)

    # ------------------------------------------------------------------ portions
    def portion(self, start: int, end: int) -> Portion:
        """``blocks[start:end]`` as a module that shares (not copies) this model's blocks."""
        self._check_range(start, end)
        names = self.block_names()[start:end]
        return Portion({n: self.blocks[n] for n in names}, start, end)

    def device_portion(self, split_point: int, head_start: int) -> Portion:
        """What a device cut at ``split_point`` trains: ``blocks[:split_point]``, and in U-shaped
        mode (``head_start`` before the end) also the head ``blocks[head_start:]``
        (:class:`DevicePortion`)."""
        if head_start == len(self.blocks):
            return self.portion(0, split_point)
        if not 0 < split_point < head_start < len(self.blocks):
            raise IndexError(f"a U-shaped device needs 0 < split point {split_point} < head start {head_start} "
                             f"< {len(self.blocks)} blocks")
        return DevicePortion(self, split_point, head_start)

    def portion_keys(self, start: int, end: int) -> list[str]:
        """state_dict keys (params and buffers) of ``blocks[start:end]``, in state_dict order."""
        self._check_range(start, end)
        return [
            f"blocks.{n}.{key}"
            for n in self.block_names()[start:end]
            for key in self.blocks[n].state_dict(keep_vars=True).keys()
        ]

    def extra_repr(self) -> str:
        return (
            f"split_points={self.split_points}, feature_block={self.feature_block!r}, "
            f"output_layer={self.output_layer!r}, input_shape={self.input_shape}, num_classes={self.num_classes}"
        )
