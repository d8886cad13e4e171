"""The model fingerprint: what must be identical on every process of a run for their weights to mean
the same thing and their samples to come from the same pipeline.

The Fed Server publishes its fingerprint in ``GET /v1/run``; a device computes its own from the
model it built and the data it derives, and sends it when it registers; a difference is refused
(409) with the lines of :func:`fingerprint_differences`. A device whose package defines the "same"
model differently (other layer sizes, another version of the user's code) or whose data pipeline
differs would otherwise train on something else silently. The fingerprint holds structure, not
weights: parameter and buffer names, shapes and dtypes, split points, input shape, classes, the
DataSpec fields that change what a sample looks like (dataset, transform, input_transform) and, for
a built-in data set, its pipeline (:class:`DataPipeline`: the normalisation, the public set,
``max_samples``, the partition and its parameters, the per-device transform and its parameters, the
seed, and the digest of every shard's test vector). docs/models.md#the-fingerprint says what it
does not cover.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidatorFunctionWrapHandler, model_validator

from shared.data.datasets import (
    CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, MNIST_MEAN, MNIST_STD,
)
from shared.data.spec import DataSpec, InputTransform
from shared.data.vectors import canonical_json, spec_shards_sha256
from shared.losses import DEFAULT_LOSS
from shared.models.split_model import SplitModel

__all__ = ["TensorSignature", "DataPipeline", "ModelFingerprint", "model_fingerprint", "fingerprint_differences",
           "MAX_DIFFERENCES"]

#: At most this many difference lines: a totally different model gives a short message, not one
#: line per parameter.
MAX_DIFFERENCES = 8


class TensorSignature(BaseModel):
    """One state_dict entry's name, shape and dtype."""

    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int]
    dtype: str


#: A built-in data set's normalisation, as its loader applies it (docs/builtin-data.md#the-files):
#: raw values divided by ``divisor``, then per channel ``(x - mean) / std``.
NORMALISATION: dict[str, tuple[float, tuple[float, ...], tuple[float, ...]]] = {
    "mnist": (255.0, (MNIST_MEAN,), (MNIST_STD,)),
    "cifar10": (255.0, CIFAR10_MEAN, CIFAR10_STD),
    "cifar100": (255.0, CIFAR100_MEAN, CIFAR100_STD),
    "femnist": (1.0, (MNIST_MEAN,), (MNIST_STD,)),   # LEAF's values are in [0, 1] already
    "synthetic": (1.0, (), ()),
}

#: The DataSpec fields that pick or change a built-in data set's shards, in :class:`DataPipeline`.
PIPELINE_SETTINGS = ("public_samples", "max_samples", "partition", "alpha", "num_devices", "seed",
                     "device_transform", "device_transform_params", "synthetic_alpha", "synthetic_beta",
                     "synthetic_iid")


class DataPipeline(BaseModel):
    """How a built-in data set's shards come about (docs/builtin-data.md): the normalisation its
    loader applies, the ``data`` settings that pick and change each shard's samples, and
    ``shards_sha256``, the digest of every shard's size and first batch as this process derived
    them (``shared.data.vectors``), which differs when the same settings give other samples."""

    model_config = ConfigDict(extra="forbid")

    divisor: float
    mean: list[float]
    std: list[float]
    public_samples: int
    max_samples: int | None
    partition: str
    alpha: float
    num_devices: int
    seed: int
    device_transform: str
    device_transform_params: dict[str, Any]
    synthetic_alpha: float
    synthetic_beta: float
    synthetic_iid: bool
    shards_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


def data_pipeline(spec: DataSpec) -> DataPipeline | None:
    """``spec``'s :class:`DataPipeline`, its shards derived here (loads the data set); None for
    ``dataset: local``, whose devices bring their own data."""
    if spec.dataset == "local":
        return None
    divisor, mean, std = NORMALISATION[spec.dataset]
    return DataPipeline(divisor=divisor, mean=list(mean), std=list(std), **spec.model_dump(include=set(PIPELINE_SETTINGS)),
                        shards_sha256=spec_shards_sha256(spec))


class ModelFingerprint(BaseModel):
    """Structure of the model and the sample pipeline; ``digest`` = sha256 of the rest as canonical JSON."""

    model_config = ConfigDict(extra="forbid")

    model: str
    tensors: list[TensorSignature]
    split_points: list[int]
    input_shape: list[int]
    num_classes: int
    dataset: str
    transform: str
    input_transform: InputTransform
    data: DataPipeline | None
    #: The run's loss and task (``train.loss``, ``train.task``): a device computes its own loss.
    loss: str
    task: str
    digest: str = ""

    def canonical_json(self) -> str:
        """Every field but ``digest``, schema-filled (defaults and nulls written out), as
        ``shared.data.vectors.canonical_json`` writes it: the text the digest is the sha256 of."""
        return canonical_json(self.model_dump(mode="json", exclude={"digest"}))

    def canonical_digest(self) -> str:
        """sha256 (hex) of :meth:`canonical_json`."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @model_validator(mode="wrap")
    @classmethod
    def _same_format(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> "ModelFingerprint":
        # A fingerprint computed by another version of this code lacks fields or has unknown ones:
        # say so, and what to update, rather than pydantic's bare "Field required" per field.
        try:
            return handler(data)
        except ValidationError as exc:
            problem = format_problem(exc)
            if problem is None:
                raise
            raise ValueError(problem) from None

    @model_validator(mode="after")
    def _digest(self) -> "ModelFingerprint":
        # Filled when empty (built here); a received one must match its own fields, so a digest
        # cannot claim a structure the fields do not have.
        expected = self.canonical_digest()
        if not self.digest:
            self.digest = expected
        elif self.digest != expected:
            raise ValueError("fingerprint digest does not match its fields")
        return self


def format_problem(exc: ValidationError) -> str | None:
    """What a fingerprint's validation errors say about its format, or None when every field is
    there and known (a wrong value: pydantic's own message stands). A missing field means older
    software computed it, an unknown one newer software; the line names the fields and what to
    update. The receiver may be either side: the Fed Server reading a registration, or a device
    reading ``GET /v1/run``."""
    def fields(kind: str) -> list[str]:
        return [".".join(str(p) for p in e["loc"]) for e in exc.errors() if e["type"] == kind]
    missing, unknown = fields("missing"), fields("extra_forbidden")
    if not missing and not unknown:
        return None
    named = "; ".join(part for part in (f"without {', '.join(missing)}" if missing else "",
                                        f"with {', '.join(unknown)} unknown here" if unknown else "") if part)
    if missing and not unknown:
        return (f"the fingerprint is in an older format ({named}): update the software that computed it (the "
                f"device agent, or your own device's fingerprint code: docs/models.md#the-fingerprint) to this "
                f"version, or send none (accepted unchecked)")
    if unknown and not missing:
        return (f"the fingerprint is in a newer format ({named}): update this side to the version of the software "
                f"that computed it")
    return (f"the fingerprint is in another format ({named}): run the same version of the software on the device "
            f"and the Fed Server")


def model_fingerprint(model: SplitModel, spec: DataSpec, loss: str = DEFAULT_LOSS,
                      task: str = "classification") -> ModelFingerprint:
    """The fingerprint of ``model`` (its ``ref``: what ``build_model`` built it from) fed by data
    ``spec`` and trained with ``loss`` for ``task``. Works on a model on the meta device (only names, shapes and dtypes are read); a
    built-in data set is loaded and partitioned to derive its shards (once per process and spec)."""
    tensors = [TensorSignature(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
               for name, t in model.state_dict(keep_vars=True).items()]
    return ModelFingerprint(model=model.ref, tensors=tensors, split_points=list(model.split_points),
                            input_shape=list(model.input_shape), num_classes=model.num_classes,
                            dataset=spec.dataset, transform=spec.transform,
                            input_transform=spec.input_transform, data=data_pipeline(spec), loss=loss, task=task)


def _describe(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": ")) if not isinstance(value, str) else repr(value)


def _pipeline_differences(a: dict[str, Any], b: dict[str, Any], here_name: str, there_name: str) -> list[str]:
    """The lines for two built-in data pipelines: each setting that differs, and the shards' digest
    when the same settings give other shards."""
    lines = [f"data.{key}: {_describe(a[key])} {here_name}, {_describe(b[key])} {there_name}"
             for key in DataPipeline.model_fields if key != "shards_sha256" and a[key] != b[key]]
    if a["shards_sha256"] != b["shards_sha256"] and not lines:
        lines.append(f"data.shards_sha256: {a['shards_sha256'][:12]} {here_name}, {b['shards_sha256'][:12]} "
                     f"{there_name}: the same settings give other samples (another version of the data file, "
                     f"of numpy or torch, or of this code; docs/builtin-data.md#test-vectors)")
    return lines


def fingerprint_differences(here: ModelFingerprint, there: ModelFingerprint, here_name: str = "here",
                            there_name: str = "on the server") -> list[str]:
    """Human-readable lines saying how ``here`` differs from ``there`` (empty when the digests match),
    at most :data:`MAX_DIFFERENCES` lines plus one saying how many more there are."""
    if here.digest == there.digest:
        return []
    lines: list[str] = []
    a, b = here.model_dump(mode="json"), there.model_dump(mode="json")
    for key in ("model", "input_shape", "num_classes", "split_points", "dataset", "transform", "loss", "task"):
        if a[key] != b[key]:
            lines.append(f"{key}: {_describe(a[key])} {here_name}, {_describe(b[key])} {there_name}")
    for key in InputTransform.model_fields:
        if a["input_transform"][key] != b["input_transform"][key]:
            lines.append(f"input_transform.{key}: {_describe(a['input_transform'][key])} {here_name}, "
                         f"{_describe(b['input_transform'][key])} {there_name}")
    if a["data"] is not None and b["data"] is not None:
        lines += _pipeline_differences(a["data"], b["data"], here_name, there_name)
    mine = {t.name: t for t in here.tensors}
    theirs = {t.name: t for t in there.tensors}
    for name, t in mine.items():
        other = theirs.get(name)
        if other is None:
            lines.append(f"parameter {name}: present {here_name}, missing {there_name}")
        elif (t.shape, t.dtype) != (other.shape, other.dtype):
            lines.append(f"parameter {name}: {t.dtype} {t.shape} {here_name}, {other.dtype} {other.shape} {there_name}")
    lines += [f"parameter {name}: missing {here_name}, present {there_name}" for name in theirs if name not in mine]
    if not lines:  # same entries, other order
        lines.append(f"the parameter order differs {here_name} and {there_name}")
    if len(lines) > MAX_DIFFERENCES:
        lines = lines[:MAX_DIFFERENCES] + [f"... and {len(lines) - MAX_DIFFERENCES} more differences"]
    return lines
