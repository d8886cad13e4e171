"""A device validates the algorithm payloads it receives (task extras, follow-ups) before it acts
on them: a malformed task is given up, naming the field, before any training or upload."""
from __future__ import annotations

import time

import pytest
import torch

from device_agent.device import Device
from device_agent.run_spec import build_run_model
from shared.config import TrainConfig
from shared.data import ArrayDataset, DataSpec
from shared.errors import Invalid
from shared.models import build_model, model_fingerprint
from shared.schemas import RunInfo, TaskResponse
from shared.wire import encode_state


class _NoServer:
    """A server interface that fails the test on any call: a malformed task must be refused
    before the device talks to anyone."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the device called {name} for a malformed task")


def _no_main(*args, **kwargs):
    raise AssertionError("the device connected to a Main Server for a malformed task")


def _device() -> Device:
    device = Device("dev-000", 0, _NoServer(), _no_main, kind=None, keep_model=False)
    spec = DataSpec(num_devices=1)
    info = RunInfo(run_id="r", algorithm="fedbc", model="logreg", num_classes=10, input_shape=[1, 1, 60],
                   data=spec, seed=3, fingerprint=model_fingerprint(build_model("logreg", 10, (1, 1, 60)), spec))
    data = ArrayDataset(torch.randn(10, 1, 1, 60), torch.arange(10) % 10, 10)
    device.prepare(info, build_run_model(info, layout=True), data, None)
    return device


def _task(extras: dict) -> TaskResponse:
    blocks = len(build_model("logreg", 10, (1, 1, 60), seed=3).blocks)
    # Refused before the weights are fetched: the server here answers nothing.
    return TaskResponse(status="train", round_id=1, split_point=blocks, num_blocks=blocks,
                        weights_id="0" * 32, train=TrainConfig(),
                        algorithm="fedbc", params={}, extras=extras)


@pytest.mark.parametrize("extras, message", [
    ({"lambda": -1.0, "gamma": 0.0, "split_seed": 1}, "lambda: Input should be greater than or equal to 0"),
    ({"gamma": 0.0, "split_seed": 1}, "lambda: Field required"),
    ({"lambda": 0.1, "gamma": 0.0, "split_seed": "1"}, "split_seed: Input should be a valid integer"),
])
def test_malformed_task_extras_are_refused_before_training(extras, message):
    device = _device()
    with pytest.raises(Invalid, match=f"^task extras: {message}$"):
        device.run_task(_task(extras), 0, time.monotonic())
    assert device.tasks_trained == 0


def _scaffold_task(c: dict) -> TaskResponse:
    return _task({}).model_copy(update={"algorithm": "scaffold", "extras": {"c": encode_state(c), "round_index": 1}})


@pytest.mark.parametrize("c, message", [
    ({"blocks.head.weight": torch.zeros(10, 60)},
     r"c: parameter names do not match the expected portion \(missing \['blocks.head.bias'\], unexpected \[\]\)"),
    ({"blocks.head.weight": torch.zeros(10, 60), "blocks.head.bias": torch.zeros(3)},
     r"c: c\[blocks.head.bias\]: shape \[3\] where \[10\] was expected"),
    ({"blocks.head.weight": torch.zeros(10, 60), "blocks.head.bias": torch.full((10,), float("nan"))},
     r"c: c\[blocks.head.bias\]: contains NaN or Inf"),
])
def test_task_tensors_that_do_not_fit_the_model_are_refused_before_training(c, message):
    device = _device()
    with pytest.raises(Invalid, match=f"^task extras: {message}$"):
        device.run_task(_scaffold_task(c), 0, time.monotonic())
    assert device.tasks_trained == 0


def test_a_task_cutting_the_model_outside_its_blocks_is_refused_in_one_line():
    device = _device()
    task = _task({"lambda": 0.1, "gamma": 0.0, "split_seed": 1}).model_copy(update={"split_point": 99})
    with pytest.raises(Invalid, match=r"^the task's split_point 99 is not within the model's 4 blocks$"):
        device.run_task(task, 0, time.monotonic())
