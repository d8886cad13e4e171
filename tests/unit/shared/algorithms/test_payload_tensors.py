"""Tensors in algorithm payloads: a ``ParameterTensors`` field travels as a portion does, through a
task or an upload's msgpack body, and is checked as the weights are (dtype, the portion's names and
shapes, finite, byte length, size); everything else of a payload stays JSON."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import Field, ValidationError

from shared.algorithms.base import ParameterTensors, Payload, parse_payload, trainable_parameters
from shared.errors import Invalid
from shared.schemas import TaskResponse, UpdateRequest
from shared.wire import encode_state, encode_tensor, packb, unpackb


class Extras(Payload):
    """A payload as an algorithm declares one: tensors beside plain values."""

    c: ParameterTensors
    pending: ParameterTensors | None = None
    round_index: int = Field(ge=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    model[1].weight.requires_grad_(False)   # frozen: not a trainable parameter
    return model


PARAMETERS = trainable_parameters(_model())


def _tensors(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {name: torch.full_like(p, scale) for name, p in PARAMETERS.items()}


def _over_the_wire(payload: Payload) -> dict:
    """The payload's map as a receiver parses it out of a msgpack body."""
    return unpackb(packb(payload.to_wire()))


def test_trainable_parameters_are_the_named_parameters_that_train_in_order():
    assert list(PARAMETERS) == ["0.weight", "0.bias", "1.bias"]


def test_a_payload_with_tensors_arrives_bit_for_bit_and_its_other_fields_as_json():
    sent = Extras(c={n: torch.randn_like(p) for n, p in PARAMETERS.items()}, round_index=3)
    wire = sent.to_wire()
    assert set(wire) == {"c", "round_index"}   # the unset optional tensors are left out
    assert wire["c"]["0.bias"] == encode_tensor(sent.c["0.bias"])
    received = parse_payload(Extras, _over_the_wire(sent), "task extras", PARAMETERS)
    assert received.round_index == 3 and received.pending is None
    assert list(received.c) == list(PARAMETERS)
    for name in PARAMETERS:
        assert torch.equal(received.c[name], sent.c[name])


def test_tensors_travel_in_a_task_and_an_upload_body():
    extras = Extras(c=_tensors(0.5), round_index=1).to_wire()
    task = TaskResponse.model_validate(unpackb(packb(TaskResponse(status="train", extras=extras).model_dump())))
    assert torch.equal(parse_payload(Extras, task.extras, "task extras", PARAMETERS).c["0.weight"], _tensors(0.5)["0.weight"])
    upload = UpdateRequest.model_validate(unpackb(packb({
        "device_id": "dev-000", "round_id": 1, "num_samples": 1, "steps": 1, "train_loss": 0.0, "weights": {},
        "timings": {"compute_s": 0, "transfer_s": 0, "wait_s": 0, "server_s": 0, "total_s": 0},
        "bytes_up": 0, "bytes_down": 0, "extras": extras})))
    assert parse_payload(Extras, upload.extras, "extras", PARAMETERS).c.keys() == PARAMETERS.keys()


def _refused(c: object, parameters=PARAMETERS) -> str:
    with pytest.raises(Invalid) as refused:
        parse_payload(Extras, {"c": c, "round_index": 1}, "extras", parameters)
    message = str(refused.value)
    assert "\n" not in message and "Value error" not in message
    return message


def test_a_non_finite_tensor_is_refused_naming_the_field_and_the_parameter():
    bad = _tensors()
    bad["0.bias"] = torch.tensor([1.0, math.nan])
    assert _refused(encode_state(bad)) == "extras: c: c[0.bias]: contains NaN or Inf"


def test_a_tensor_of_another_shape_or_dtype_than_its_parameter_is_refused():
    wrong_shape = {**_tensors(), "0.bias": torch.zeros(3)}
    assert _refused(encode_state(wrong_shape)) == "extras: c: c[0.bias]: shape [3] where [2] was expected"
    wrong_dtype = {**_tensors(), "0.bias": torch.zeros(2, dtype=torch.float64)}
    assert _refused(encode_state(wrong_dtype)) == "extras: c: c[0.bias]: dtype float64 where float32 was expected"


def test_names_other_than_the_trainable_parameters_are_refused():
    frozen_too = {**_tensors(), "1.weight": torch.zeros(2)}
    assert "unexpected ['1.weight']" in _refused(encode_state(frozen_too))
    missing = {n: t for n, t in _tensors().items() if n != "1.bias"}
    assert "missing ['1.bias']" in _refused(encode_state(missing))
    reordered = dict(reversed(list(_tensors().items())))
    assert "do not match" in _refused(encode_state(reordered))


@pytest.mark.parametrize("c, reason", [
    ([1.0, 2.0], "expected a map of parameter name -> tensor"),
    ({"0.weight": [1.0]}, "expected a map with exactly the keys dtype, shape, data"),
    ({"0.weight": {"dtype": "float32", "shape": [2, 3], "data": b"\x00" * 4}}, "data bytes do not match shape"),
    ({"0.weight": {"dtype": "bfloat16", "shape": [1], "data": b"\x00\x00"}}, "unsupported dtype"),
    ({"0.weight": {"dtype": "float32", "shape": [1 << 40], "data": b""}}, "shape must be a list"),
])
def test_a_malformed_tensor_map_is_refused_as_a_malformed_weight_is(c, reason):
    assert reason in _refused(c, parameters=None)


def test_a_payload_built_in_this_process_is_checked_too():
    with pytest.raises(ValidationError, match="contains NaN or Inf"):
        Extras(c={**_tensors(), "0.weight": torch.full((2, 3), math.inf)}, round_index=1)
    with pytest.raises(ValidationError, match="dtype torch.complex64 cannot be sent"):
        Extras(c={"0.weight": torch.zeros(2, dtype=torch.complex64)}, round_index=1)


def test_decoded_tensors_view_the_received_bytes_and_built_ones_are_not_copied():
    built = _tensors()
    assert Extras(c=built, round_index=1).c["0.weight"].data_ptr() == built["0.weight"].data_ptr()
    raw = unpackb(packb(Extras(c=built, round_index=1).to_wire()))
    received = parse_payload(Extras, raw, "extras", PARAMETERS)
    # A view of the received body's bytes (clone it before changing it), as a decoded weight is.
    assert received.c["0.weight"].data_ptr() == np.frombuffer(raw["c"]["0.weight"]["data"], "<f4").ctypes.data
