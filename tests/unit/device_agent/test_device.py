"""A device's model lifetime: kept for the run (a real board) or built per task (virtual devices)."""
from __future__ import annotations

import pytest
import torch

from device_agent import device_model as device_model_module
from device_agent.clients import HttpFedClient, main_connector
from device_agent.device import Device
from device_agent.run_spec import build_run_model
from shared.data import DataSpec
from shared.data import ArrayDataset
from shared.models import build_model, model_fingerprint
from shared.portions import load_portion, portion_state
from shared.profiles import EmulatedKind, TimeScale, auto_time_scale, parse_kind
from shared.schemas import RunInfo, TaskResponse


def _device(keep_model: bool, model: str = "cnn", kind: EmulatedKind | None = None,
            time_scale: TimeScale = 1.0, emulate_links: bool = True) -> Device:
    device = Device("dev-000", 0, HttpFedClient("http://127.0.0.1:9"), main_connector(), kind=kind,
                    time_scale=time_scale, keep_model=keep_model, emulate_links=emulate_links)
    spec = DataSpec(num_devices=1)
    info = RunInfo(run_id="r", algorithm="s2fl", model=model, num_classes=10, input_shape=[1, 28, 28],
                   data=spec, seed=3, fingerprint=model_fingerprint(build_model(model, 10, (1, 28, 28)), spec))
    data = ArrayDataset(torch.randn(16, 1, 28, 28), torch.arange(16) % 10, 10)
    device.prepare(info, build_run_model(info, layout=True), data, None)
    return device


def test_per_task_model_allocates_only_the_trained_blocks_when_their_weights_are_loaded():
    device = _device(keep_model=False)
    split = build_model("cnn").split_points[0]
    model = device.device_model.for_task()
    assert all(t.is_meta for t in model.state_dict().values())  # nothing allocated before the weights
    reference = build_model("cnn", seed=3)
    portion = model.portion(0, split)
    # The task's weights overwrite every parameter and buffer of the trained blocks.
    load_portion(portion, portion_state(reference, 0, split))
    names = model.block_names()
    for i, name in enumerate(names):
        devices = {t.device.type for t in model.blocks[name].state_dict().values()}
        assert devices == ({"cpu"} if i < split else {"meta"}), (name, devices)
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(portion(x), reference.portion(0, split)(x))
    assert device.device_model.for_task() is model  # one model per task, reused within it


def test_kept_model_is_the_same_full_model_every_task():
    device = _device(keep_model=True)
    model = device.device_model.for_task()
    assert model is device.model and device.device_model.for_task() is model
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@pytest.mark.parametrize("keep_model", [False, True])
def test_model_is_released_after_a_task_only_without_keep_model(keep_model):
    device = _device(keep_model)
    kept = device.model

    def fail(*args, **kwargs):  # stands in for a round that fails after the model was built
        device.device_model.for_task()
        raise RuntimeError("round failed")

    device.trainer.train = fail
    with pytest.raises(RuntimeError):
        device.run_task(TaskResponse(status="train", round_id=1), 0, 0.0)
    assert device.model is (kept if keep_model else None)


def test_auto_time_scale_is_measured_once_per_process_and_reported_in_the_rate(monkeypatch):
    monkeypatch.setattr(device_model_module, "_HOST_FLOPS", {})
    measured: list[int] = []

    def fake_training_flops(model, x, cpu_time):
        measured.append(len(x))
        return 1e11

    monkeypatch.setattr(device_model_module, "training_flops", fake_training_flops)
    high, low = (_device(False, kind=parse_kind(k), time_scale="auto") for k in ("high", "low"))
    for device in (high, low):
        assert device.time_scale == 1.0   # not yet known before setup
        device._resolve_time_scale()
        assert device.time_scale == pytest.approx(auto_time_scale(1e11))
    assert measured == [32]   # one measurement (a batch of 32, the device's 16 samples twice) serves the agent's devices
    assert high.profile().rate == pytest.approx(parse_kind("high").rate * auto_time_scale(1e11))


@pytest.mark.parametrize("kind,time_scale", [("high", 60.0), (None, "auto")])
def test_no_measurement_for_a_given_factor_or_a_real_device(monkeypatch, kind, time_scale):
    monkeypatch.setattr(device_model_module, "_HOST_FLOPS", {})
    monkeypatch.setattr(device_model_module, "training_flops", lambda *a: pytest.fail("measured"))
    device = _device(False, kind=parse_kind(kind) if kind else None, time_scale=time_scale)
    device._resolve_time_scale()
    assert device.time_scale == (60.0 if kind else 1.0)


def test_auto_time_scale_with_the_real_measurement(monkeypatch):
    monkeypatch.setattr(device_model_module, "_HOST_FLOPS", {})
    device = _device(False, kind=parse_kind("mid"), time_scale="auto")
    device._resolve_time_scale()
    host_flops = device_model_module._HOST_FLOPS[("cnn", 10, (1, 28, 28), "cpu")]
    assert 1e8 < host_flops < 1e13 and device.time_scale == pytest.approx(auto_time_scale(host_flops))


@pytest.mark.parametrize("kind,emulate_links,rate", [
    ("low", True, parse_kind("low").rate * 60.0),   # an emulated link: its (compressed) rate
    ("low", False, None),                           # a real link shaped like the kind: not known yet
    (None, True, None),                             # a real device: not known until measured
])
def test_a_device_registers_the_rate_of_an_emulated_link_only(kind, emulate_links, rate):
    device = _device(False, kind=parse_kind(kind) if kind else None, time_scale=60.0, emulate_links=emulate_links)
    profile = device.profile()
    assert profile.rate == (pytest.approx(rate) if rate else None)
    assert profile.flops > 0
