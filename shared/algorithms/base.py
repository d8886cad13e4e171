"""The small interface every algorithm implements.

In the spirit of Flower's ``Strategy``: an algorithm decides *what* happens in a round (which
devices train, where each one's model is cut, how the Main Server groups them, how updates are
combined); the services decide *how* it travels. Services call these methods and never branch
on an algorithm's name. Adding an algorithm = one new module + one line in ``registry.py``.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

import torch

from shared.algorithms.aggregation import Contribution, layerwise_aggregate

if TYPE_CHECKING:
    from shared.config import RunConfig

SplitMode = Literal["sliding", "fixed", "zero"]
GroupingMode = Literal["balanced", "singleton"]


class Algorithm:
    """Defaults: uniform random selection, Algorithm 1 aggregation, split depth zero."""

    name: ClassVar[str] = ""

    def __init__(self, config: "RunConfig") -> None:
        self.config = config

    # --- Fed Server decisions ------------------------------------------------------------------
    def split_mode(self) -> SplitMode:
        """``zero``: the whole model trains on the device; ``fixed``: every device gets the
        largest client portion; ``sliding``: per-device split from the client time table."""
        return "zero"

    def select_devices(self, round_id: int, available: Sequence[str], count: int, rng: random.Random) -> list[str]:
        """Which devices train this round (S2FL Algorithm 2 line 3: uniformly at random)."""
        pool = sorted(available)
        return sorted(rng.sample(pool, min(count, len(pool))))

    def aggregate(self, global_state: Mapping[str, torch.Tensor], contributions: Sequence[Contribution]) -> dict[str, torch.Tensor]:
        """New global model from the round's uploads (S2FL Algorithm 1; FedAvg when nothing is split)."""
        return layerwise_aggregate(global_state, contributions)

    # --- Main Server decisions -----------------------------------------------------------------
    def grouping(self) -> GroupingMode:
        """How the Main Server groups a round's devices (one server copy per group)."""
        return "singleton"

    @property
    def uses_main_server(self) -> bool:
        return self.split_mode() != "zero"
