"""Runs of consecutive integers, as shard lists are written (``0-2,5``, ``dev/0-9``). Imports
nothing heavy: the testbed's launcher, which never imports torch, writes its agents' shards so."""
from __future__ import annotations

from collections.abc import Iterable

__all__ = ["consecutive_runs"]


def consecutive_runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """``values`` in their order as (first, last) runs of consecutive integers: ``[0, 1, 2, 5]`` ->
    ``[(0, 2), (5, 5)]``."""
    runs: list[tuple[int, int]] = []
    for value in values:
        if runs and runs[-1][1] == value - 1:
            runs[-1] = (runs[-1][0], value)
        else:
            runs.append((value, value))
    return runs
