"""The model fingerprint: identical for identical builds (also on the meta device), and a difference
in the model or the sample pipeline is named in a short list."""
from __future__ import annotations

import hashlib
import json

import pytest
import torch
from pydantic import ValidationError

from fed_server.coordinator import Coordinator
from fed_server.run_dir import RunDirectory
from shared.data import ArrayDataset, load_dataset, vectors
from shared.data.spec import DataSpec, InputTransform
from shared.errors import Conflict
from shared.models import build_model, describe, fingerprint, fingerprint_differences, model_fingerprint
from shared.models.fingerprint import MAX_DIFFERENCES, ModelFingerprint
from shared.run_config import load_run_config
from shared.schemas import DeviceProfileMsg, RegisterRequest

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


# A built-in data set: the fingerprint covers its pipeline. Small and quick: 4 shards of 400 samples.
BUILTIN = DataSpec(num_devices=4, max_samples=400)


@pytest.mark.parametrize("update, line", [
    ({"alpha": 0.1}, "data.alpha: 0.1 on the device, 0.5 in the run"),
    ({"partition": "iid"}, "data.partition: 'iid' on the device, 'dirichlet' in the run"),
    ({"num_devices": 5}, "data.num_devices: 5 on the device, 4 in the run"),
    ({"seed": 1}, "data.seed: 1 on the device, 0 in the run"),
    ({"max_samples": 500}, "data.max_samples: 500 on the device, 400 in the run"),
    ({"public_samples": 20}, "data.public_samples: 20 on the device, 0 in the run"),
    ({"device_transform": "gaussian_noise"}, "data.device_transform: 'gaussian_noise' on the device, 'none' in the run"),
])
def test_each_pipeline_setting_of_a_built_in_data_set_is_named(update, line):
    run = _fp(spec=BUILTIN)
    device = _fp(spec=BUILTIN.model_copy(update=update))
    assert device.digest != run.digest and device.data.shards_sha256 != run.data.shards_sha256
    assert fingerprint_differences(device, run, "on the device", "in the run") == [line]


def test_the_per_device_transform_parameters_are_named():
    noisy = BUILTIN.model_copy(update={"device_transform": "gaussian_noise"})
    lines = fingerprint_differences(_fp(spec=noisy.model_copy(update={"device_transform_params": {"sigma": 0.9}})),
                                    _fp(spec=noisy), "on the device", "in the run")
    assert lines == ['data.device_transform_params: {"sigma": 0.9} on the device, {} in the run']


def test_a_loader_that_normalises_otherwise_is_caught_by_the_shards_digest(monkeypatch):
    run = _fp(spec=BUILTIN)
    assert run.data.mean == [0.1307] and run.data.std == [0.3081] and run.data.divisor == 255.0

    def other_normalisation(spec):   # the same settings, another normalisation in the loader's code
        train, test = load_dataset(spec)
        return ArrayDataset(train.x * 1.01, train.y, train.num_classes), test

    monkeypatch.setattr(vectors, "_DIGESTS", {})   # a fresh process: nothing cached
    monkeypatch.setattr(vectors, "load_dataset", other_normalisation)
    device = _fp(spec=BUILTIN)
    lines = fingerprint_differences(device, run, "on the device", "in the run")
    assert len(lines) == 1 and lines[0].startswith(
        f"data.shards_sha256: {device.data.shards_sha256[:12]} on the device, {run.data.shards_sha256[:12]} in the run: "
        "the same settings give other samples")


def test_the_normalisation_constants_are_named(monkeypatch):
    run = _fp(spec=BUILTIN)
    monkeypatch.setitem(fingerprint.NORMALISATION, "mnist", (255.0, (0.5,), (0.3081,)))
    lines = fingerprint_differences(_fp(spec=BUILTIN), run, "on the device", "in the run")
    assert lines == ["data.mean: [0.5] on the device, [0.1307] in the run"]


def test_local_data_has_no_pipeline_but_its_input_transform():
    assert _fp().data is None and _fp().input_transform == SPEC.input_transform


def test_the_digest_is_the_sha256_of_the_schema_filled_object_as_sorted_compact_json():
    fp = _fp(spec=BUILTIN)
    body = fp.model_dump(mode="json")
    del body["digest"]
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    assert fp.canonical_json() == text and fp.digest == hashlib.sha256(text.encode()).hexdigest()
    # Every field is written, nulls and defaults included; floats as Python writes them.
    assert '"max_samples":400' in text and '"divisor":255.0' in text and '"alpha":0.5' in text
    assert '"input_transform":{"mean":null,"resize":null,"scale":1.0,"std":null}' in text
    assert fp.data.shards_sha256 == vectors.shards_sha256(vectors.shard_vectors(BUILTIN))


def test_the_fed_server_refuses_a_device_whose_pipeline_differs_and_says_what_differs(tmp_path):
    config = load_run_config({"algorithm": "fedavg", "rounds": 1, "data": BUILTIN.model_dump()})
    coordinator = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    other = model_fingerprint(build_model("cnn", 10, (1, 28, 28)), BUILTIN.model_copy(update={"seed": 2}))
    request = RegisterRequest(device_id="d0", shard=0, num_samples=coordinator.enrolment.shard_sizes[0],
                              profile=DeviceProfileMsg(flops=1e9, rate=1e6), fingerprint=other)
    with pytest.raises(Conflict, match=r"d0: the device's model or data pipeline differs from the run's "
                                       r"\(model 'cnn'\): data.seed: 2 on the device, 0 in the run$"):
        coordinator.enrolment.register(request)
    assert coordinator.core.devices.devices == {}
    coordinator.enrolment.register(request.model_copy(update={"fingerprint": coordinator.enrolment.run_info().fingerprint}))
    assert list(coordinator.core.devices.devices) == ["d0"]


def test_the_published_state_dict_keys_are_the_fingerprints_tensor_names(capsys):
    describe.main(["--keys", "resnet8"])
    printed = capsys.readouterr().out.splitlines()
    tensors = model_fingerprint(build_model("resnet8", 10, (3, 32, 32)), DataSpec(dataset="local", num_classes=10,
                                                                                    input_shape=[3, 32, 32])).tensors
    assert printed == [f"{t.name} {t.dtype} {t.shape}" for t in tensors]
    assert "blocks.stem.1.running_mean float32 [16]" in printed


def test_a_device_with_another_loss_or_task_has_another_fingerprint():
    model = build_model("cnn", 10, (1, 28, 28))
    run = model_fingerprint(model, SPEC)
    assert run == model_fingerprint(model, SPEC, "cross_entropy", "classification")
    other = model_fingerprint(model, SPEC, "mse", "regression")
    assert fingerprint_differences(other, run) == ["loss: 'mse' here, 'cross_entropy' on the server",
                                                   "task: 'regression' here, 'classification' on the server"]


@pytest.mark.parametrize("change,words", [
    (lambda fp: {k: v for k, v in fp.items() if k not in ("loss", "task")},
     "the fingerprint is in an older format (without loss, task): update the software that computed it"),
    (lambda fp: {**fp, "weights_sha256": "0" * 64},
     "the fingerprint is in a newer format (with weights_sha256 unknown here): update this side"),
    (lambda fp: {**{k: v for k, v in fp.items() if k != "task"}, "weights_sha256": "0" * 64},
     "the fingerprint is in another format (without task; with weights_sha256 unknown here): run the same version"),
])
def test_a_fingerprint_of_another_versions_format_says_what_to_update(change, words):
    # An older agent's fingerprint (before loss and task) was refused with pydantic's bare
    # "Field required" twice, which says nothing about what to do.
    received = change(_fp().model_dump(mode="json"))
    with pytest.raises(ValidationError) as refused:
        RegisterRequest(device_id="dev-000", shard=0, num_samples=10, profile=DeviceProfileMsg(flops=1e9),
                        fingerprint=received)
    message = str(refused.value)
    assert words in message and "Field required" not in message and "Extra inputs" not in message, message
    (error,) = refused.value.errors()
    assert error["loc"] == ("fingerprint",), error


def test_a_wrong_value_in_a_fingerprint_of_this_format_keeps_its_own_message():
    with pytest.raises(ValidationError, match="num_classes") as refused:
        ModelFingerprint.model_validate({**_fp().model_dump(mode="json"), "num_classes": "ten"})
    assert [e["type"] for e in refused.value.errors()] == ["int_parsing"]
