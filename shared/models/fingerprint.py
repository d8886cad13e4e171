"""The model fingerprint: what must be identical on every process of a run for their weights to mean
the same thing.

The Fed Server publishes its fingerprint in ``GET /v1/run``; a device computes its own from the
model it built and sends it when it registers, and a difference is refused (409) with the lines of
:func:`fingerprint_differences`. A device whose package defines the "same" model differently (other
layer sizes, another version of the user's code) or whose data pipeline differs would otherwise
train on something else silently. The fingerprint holds structure, not weights: parameter and
buffer names, shapes and dtypes, split points, input shape, classes, and the DataSpec fields that
change what a sample looks like (dataset, transform, input_transform).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from shared.data.spec import DataSpec, InputTransform
from shared.models.split_model import SplitModel

__all__ = ["TensorSignature", "ModelFingerprint", "model_fingerprint", "fingerprint_differences", "MAX_DIFFERENCES"]

#: At most this many difference lines: a totally different model gives a short message, not one
#: line per parameter.
MAX_DIFFERENCES = 8


class TensorSignature(BaseModel):
    """One state_dict entry's name, shape and dtype."""

    model_config = ConfigDict(extra="forbid")

    name: str
    shape: list[int]
    dtype: str


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
    digest: str = ""

    def canonical_digest(self) -> str:
        """sha256 (hex) of every field but ``digest``, as sorted-key compact JSON."""
        body = self.model_dump(mode="json", exclude={"digest"})
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

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


def model_fingerprint(model: SplitModel, spec: DataSpec) -> ModelFingerprint:
    """The fingerprint of ``model`` (its ``ref``: what ``build_model`` built it from) fed by data
    ``spec``. Works on a model on the meta device (only names, shapes and dtypes are read)."""
    tensors = [TensorSignature(name=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."))
               for name, t in model.state_dict(keep_vars=True).items()]
    return ModelFingerprint(model=model.ref, tensors=tensors, split_points=list(model.split_points),
                            input_shape=list(model.input_shape), num_classes=model.num_classes,
                            dataset=spec.dataset, transform=spec.transform,
                            input_transform=spec.input_transform)


def _describe(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": ")) if not isinstance(value, str) else repr(value)


def fingerprint_differences(here: ModelFingerprint, there: ModelFingerprint, here_name: str = "here",
                            there_name: str = "on the server") -> list[str]:
    """Human-readable lines saying how ``here`` differs from ``there`` (empty when the digests match),
    at most :data:`MAX_DIFFERENCES` lines plus one saying how many more there are."""
    if here.digest == there.digest:
        return []
    lines: list[str] = []
    a, b = here.model_dump(mode="json"), there.model_dump(mode="json")
    for key in ("model", "input_shape", "num_classes", "split_points", "dataset", "transform"):
        if a[key] != b[key]:
            lines.append(f"{key}: {_describe(a[key])} {here_name}, {_describe(b[key])} {there_name}")
    for key in InputTransform.model_fields:
        if a["input_transform"][key] != b["input_transform"][key]:
            lines.append(f"input_transform.{key}: {_describe(a['input_transform'][key])} {here_name}, "
                         f"{_describe(b['input_transform'][key])} {there_name}")
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
