"""Who shares secrets and masks with whom in one attempt: SecAgg+'s sparse graph (Bell et al.,
CCS 2020), or SecAgg's complete graph.

With ``neighbours`` = k, the roster is laid on a ring in a fresh random order and each device's
neighbours are the k / 2 before it and the k / 2 after it (a Harary graph H(n, k) with its nodes
permuted, as Flower's SecAgg+ builds it). The relation is symmetric, so the pairwise masks of two
neighbours cancel in the sum. Each device Shamir-shares its secrets among its neighbourhood only
(itself and its neighbours), which turns the quadratic share and interpolation work of the
complete graph into work linear in the roster. With ``neighbours`` null, or at least the roster
less one, every device is every other's neighbour."""
from __future__ import annotations

import random
from collections.abc import Sequence

#: One device's neighbourhood: itself and its neighbours, sorted (the order of its share indices).
Neighbourhoods = dict[str, list[str]]


def majority_threshold(neighbourhood: int) -> int:
    """The default threshold for neighbourhoods of ``neighbourhood`` devices: a majority of them."""
    return neighbourhood // 2 + 1


def neighbourhoods(roster: Sequence[str], neighbours: int | None, rng: random.Random) -> Neighbourhoods:
    """Each roster device's neighbourhood, itself included, sorted: everyone's with ``neighbours``
    None or at least ``len(roster) - 1``, otherwise the ``neighbours / 2`` devices on each side of
    it on a ring in ``rng``'s random order. ValueError for an odd or negative ``neighbours``."""
    if neighbours is not None and (neighbours < 0 or neighbours % 2):
        raise ValueError(f"neighbours must be an even count, not {neighbours}")
    if neighbours is None or neighbours >= len(roster) - 1:
        everyone = sorted(roster)   # one list every device's entry shares: nobody changes it
        return {device: everyone for device in roster}
    ring = sorted(roster)
    rng.shuffle(ring)
    half = neighbours // 2
    return {device: sorted(ring[(at + offset) % len(ring)] for offset in range(-half, half + 1))
            for at, device in enumerate(ring)}
