"""The masks of secure aggregation, per model block, and their removal.

Devices are cut at different blocks, so a block is summed over the devices that hold it (Algorithm
1, layer-wise). Masks are therefore agreed per block: a device masks each block it holds with its
own mask (from its seed) and, for each neighbour that holds the block too, with the mask of their
pair (from their agreed key), added by the one whose id sorts first and subtracted by the other.
Summed over a block's holders, the pairs' masks cancel and the Fed Server removes the own masks of
the devices it sums (their seeds, rebuilt from shares) and the pairs' masks of neighbours that
dropped after masking (their mask keys, rebuilt from shares).

Each block's mask is one keystream (``crypto.keystream_words``, the stream numbered by the block)
spread over the block's state entries in the model's order. In U-shaped mode every device also
holds the model's head, the blocks from ``head_start`` on: it masks them as the blocks before its
cut, and every pair of devices holds them both.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from shared.models import SplitModel
from shared.secagg.crypto import MASK_PURPOSE, agree, keystream_words, private_key, seed_key

Words = dict[str, np.ndarray]


@dataclass(frozen=True)
class BlockLayout:
    """The model's state entries (name, shape) block by block, which the devices and the Fed
    Server both know, and where U-shaped devices' heads start (None: not U-shaped)."""

    blocks: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]
    head_start: int | None = None

    @classmethod
    def of(cls, model: SplitModel, head_start: int | None = None) -> "BlockLayout":
        """The layout of ``model`` (a meta-device layout serves: only names and shapes are read)."""
        state = model.state_dict()
        return cls(tuple(tuple((key, tuple(state[key].shape)) for key in model.portion_keys(b, b + 1))
                         for b in range(len(model.blocks))), head_start)

    def held(self, split_point: int) -> list[int]:
        """The blocks a device cut after ``split_point`` masks: ``[0, split_point)``, and U-shaped
        its head ``[head_start, blocks)``."""
        head = range(max(self.head_start, split_point), len(self.blocks)) if self.head_start is not None else range(0)
        return [*range(split_point), *head]

    def held_keys(self, split_point: int) -> list[str]:
        """The state entries of the blocks :meth:`held` names."""
        return [name for block in self.held(split_point) for name, _ in self.entries(block)]

    def entries(self, block: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """The entries of ``block``."""
        return self.blocks[block]

    def stream(self, key: bytes, block: int) -> Words:
        """``block``'s mask under ``key``: one keystream over its entries, each in its shape."""
        entries = self.entries(block)
        sizes = [math.prod(shape) for _, shape in entries]
        words = keystream_words(key, block, sum(sizes))
        out, at = {}, 0
        for (name, shape), size in zip(entries, sizes):
            out[name] = words[at:at + size].reshape(shape)
            at += size
        return out


def well_held(splits: Mapping[str, int], members: Iterable[str], threshold: int) -> int:
    """How many leading blocks at least ``threshold`` of ``members``, cut at ``splits``, hold: a
    block is held by every device cut after it, so the ``threshold``-th deepest of their cuts (0
    with fewer devices)."""
    deepest = sorted((splits[m] for m in members), reverse=True)
    return deepest[threshold - 1] if len(deepest) >= threshold else 0


def masked_splits(splits: Mapping[str, int], threshold: int,
                  neighbourhoods: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """The blocks each device masks and uploads, ``[0, masked split)``: those of its own that at
    least ``threshold`` devices of its neighbourhood (itself included) mask too; its deeper blocks
    are not aggregated from it. A device's block carries the pairwise masks of its neighbours that
    hold it, and no others: with fewer than ``threshold`` of them its block's sum would come out
    over fewer devices than the threshold (with none, its own update, once its seed is rebuilt).
    Lowering one device's masked split can leave a neighbour short, so it is repeated until none
    changes (with the complete graph, once: every device's bound is the same)."""
    masked = dict(splits)
    while lowered := {d: bound for d, bound in _bounds(masked, threshold, neighbourhoods, set(masked)).items()
                      if masked[d] > bound}:
        masked.update(lowered)
    return masked


def unprotected(splits: Mapping[str, int], threshold: int, neighbourhoods: Mapping[str, Sequence[str]],
                among: set[str]) -> list[str]:
    """The devices of ``among`` (those that shared, or survived) whose last masked block (``splits``:
    their masked splits) fewer than ``threshold`` devices of their neighbourhood among ``among``,
    themselves included, mask too (:func:`masked_splits`), sorted: its sum would come out over too
    few devices."""
    return sorted(d for d, bound in _bounds(splits, threshold, neighbourhoods, among).items() if splits[d] > bound)


def _bounds(splits: Mapping[str, int], threshold: int, neighbourhoods: Mapping[str, Sequence[str]],
            among: set[str]) -> dict[str, int]:
    """For each device of ``among``: how many leading blocks at least ``threshold`` devices of its
    neighbourhood among ``among`` hold (:func:`well_held`), computed once a neighbourhood (the
    complete graph's devices share one list)."""
    by_hood: dict[int, int] = {}
    bounds = {}
    for device in among:
        hood = neighbourhoods[device]
        if id(hood) not in by_hood:
            by_hood[id(hood)] = well_held(splits, [d for d in hood if d in among], threshold)
        bounds[device] = by_hood[id(hood)]
    return bounds


def pair_sign(device: str, partner: str) -> int:
    """+1 where ``device`` adds the pair's mask (its id sorts first), -1 where it subtracts it."""
    return 1 if device < partner else -1


def _apply(words: Words, mask: Words, sign: int) -> None:
    """``words += sign * mask`` modulo 2**64, in place."""
    for name, value in mask.items():
        target = words[name] = np.asarray(words[name])   # a 0-d entry summed may be a numpy scalar
        (np.add if sign > 0 else np.subtract)(target, value, out=target)


def add_masks(words: Words, layout: BlockLayout, device: str, split_point: int, seed: bytes,
              partners: Mapping[str, tuple[bytes, int]]) -> Words:
    """A device's encoded update with its masks: its own on every block it holds, and each
    partner's (``partners``: id -> (the key the pair agreed, :data:`MASK_PURPOSE`; its split point))
    on the blocks both hold. ``words`` (uint64, by entry) is changed in place and returned."""
    own = seed_key(seed)
    pairs = {partner: (key, pair_sign(device, partner), set(layout.held(split)))
             for partner, (key, split) in partners.items()}
    for block in layout.held(split_point):
        _apply(words, layout.stream(own, block), 1)
        for key, sign, held in pairs.values():
            if block in held:
                _apply(words, layout.stream(key, block), sign)
    return words


def remove_masks(total: Words, layout: BlockLayout, splits: Mapping[str, int], seeds: Mapping[str, bytes],
                 dropped_keys: Mapping[str, bytes], partners_of_dropped: Mapping[str, Iterable[str]],
                 public_mask_keys: Mapping[str, bytes]) -> Words:
    """The sum of the summed devices' updates from the sum of their masked words ``total`` (uint64,
    by entry; changed in place): each summed device's own mask removed with its rebuilt ``seeds``,
    and the pairs' masks each dropped device left in its summed partners' words removed with its
    rebuilt mask key (``dropped_keys``; ``partners_of_dropped``: its summed partners)."""
    for device, seed in seeds.items():
        own = seed_key(seed)
        for block in layout.held(splits[device]):
            _apply(total, layout.stream(own, block), -1)
    for dropped, raw in dropped_keys.items():
        private = private_key(raw)
        for partner in partners_of_dropped[dropped]:
            key = agree(private, public_mask_keys[partner], MASK_PURPOSE)
            common = set(layout.held(splits[dropped])).intersection(layout.held(splits[partner]))
            for block in sorted(common):
                _apply(total, layout.stream(key, block), -pair_sign(partner, dropped))
    return total
