"""The model fingerprint: identical for identical builds (also on the meta device), and a difference
in the model or the sample pipeline is named in a short list."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from shared.data.spec import DataSpec, InputTransform
from shared.models import build_model, fingerprint_differences, model_fingerprint
from shared.models.fingerprint import MAX_DIFFERENCES, ModelFingerprint

SPEC = DataSpec(dataset="local", num_classes=10, input_shape=[1, 28, 28],
                input_transform=InputTransform(scale=1 / 255, mean=[0.5], std=[0.25]))


def _fp(model: str = "cnn", spec: DataSpec = SPEC, **kwargs) -> ModelFingerprint:
    return model_fingerprint(build_model(model, 10, (1, 28, 28), **kwargs), spec)


def test_same_model_same_fingerprint_whatever_the_seed_or_device():
    a = _fp(seed=0)
    with torch.device("meta"):
        meta = model_fingerprint(build_model("cnn", 10, (1, 28, 28), seed=7), SPEC)
    assert a == meta and len(a.digest) == 64
    assert fingerprint_differences(a, meta) == []
    names = [t.name for t in a.tensors]
    assert "blocks.fc1.1.weight" in names and a.split_points == [1, 2, 3] and a.model == "cnn"


def test_a_different_layer_size_is_named_with_both_shapes():
    here = _fp()
    there = model_fingerprint(build_model("cnn", 10, (1, 32, 32)), SPEC)
    lines = fingerprint_differences(here, there, "here", "on the server")
    assert lines == ["input_shape: [1, 28, 28] here, [1, 32, 32] on the server",
                     "parameter blocks.fc1.1.weight: float32 [512, 3136] here, float32 [512, 4096] on the server"]


def test_transform_differences_are_named_by_field():
    other = SPEC.model_copy(update={"input_transform": InputTransform(scale=1 / 255, mean=[0.1307], std=[0.25])})
    lines = fingerprint_differences(_fp(spec=other), _fp(), "on the device", "in the run")
    assert lines == ["input_transform.mean: [0.1307] on the device, [0.5] in the run"]


def test_a_totally_different_model_gives_a_short_message():
    lines = fingerprint_differences(_fp("vgg16"), _fp("cnn"))
    assert lines[0].startswith("model: 'vgg16' here, 'cnn' on the server")
    assert len(lines) == MAX_DIFFERENCES + 1 and lines[-1].startswith("... and ")


def test_a_received_fingerprint_must_match_its_digest():
    body = _fp().model_dump(mode="json")
    assert ModelFingerprint.model_validate(body) == _fp()
    body["tensors"][0]["shape"] = [1]
    with pytest.raises(ValidationError, match="digest does not match"):
        ModelFingerprint.model_validate(body)
