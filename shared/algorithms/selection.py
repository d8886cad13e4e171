"""Device selection policies, pluggable under any algorithm (``RunConfig.selection``).

A selector decides which devices train in a round and may learn from what they upload (HiCS-FL
estimates label heterogeneity from output-layer updates). Adding a policy: one module with a
:class:`DeviceSelector` subclass and one line in ``SELECTORS`` (``shared/algorithms/registry.py``).
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from shared.algorithms.aggregation import Contribution

if TYPE_CHECKING:
    from shared.algorithms.base import RoundContext
    from shared.config import RunConfig


class SelectorParams(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeviceSelector:
    """Uniformly random selection without replacement (S2FL Algorithm 2 line 3, FedAvg)."""

    Params: ClassVar[type[SelectorParams]] = SelectorParams
    #: Why the policy cannot serve a regression task, or None (``Algorithm.needs_classes``).
    needs_classes: ClassVar[str | None] = None
    #: Why the policy learns from each device's own update, or None (``Algorithm.individual_updates``).
    individual_updates: ClassVar[str | None] = None

    def __init__(self, config: "RunConfig", output_layer: str | None = None) -> None:
        self.config = config
        self.params = self.Params.model_validate(config.selection_params)
        self.output_layer = output_layer

    def model_parts_needed(self) -> tuple[str, ...]:
        """Optional model parts this policy uses (see ``Algorithm.model_parts_needed``)."""
        return ()

    def select(self, ctx: "RoundContext", available: Sequence[str], count: int, rng: random.Random) -> list[str]:
        pool = sorted(available)
        return sorted(rng.sample(pool, min(count, len(pool))))

    def observe(self, device_id: str, contribution: Contribution, global_state: Mapping[str, torch.Tensor]) -> None:
        """Learn from a device's accepted upload (before aggregation changes the global model)."""

    def metrics(self) -> dict[str, Any]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
