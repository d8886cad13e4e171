"""device_agent.calibration: the host's training speed that ``--time-scale auto`` scales by."""
from __future__ import annotations

import itertools

import pytest
import torch

from device_agent import calibration
from device_agent.calibration import training_flops
from shared.models import build_model, profile_model


def test_flops_are_the_counted_work_of_a_batch_over_the_median_step(monkeypatch):
    model = build_model("cnn")
    x = torch.randn(8, 1, 28, 28)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ticks = itertools.count()
    durations = iter([9.0, 0.30, 0.10, 0.20, 5.0])   # the first, untimed step is slow; then 0.3, 0.1, 0.2
    now = [0.0]

    def fake_thread_time() -> float:   # called twice a step: start, then end after the step's duration
        if next(ticks) % 2:
            now[0] += next(durations)
        return now[0]

    monkeypatch.setattr(calibration.time, "thread_time", fake_thread_time)
    flops = training_flops(model, x, cpu_time=True, min_steps=3, max_steps=3)
    assert flops == pytest.approx(profile_model(model).total_flops * 8 / 0.20)   # median of 0.3, 0.1, 0.2
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "running" not in k and "num_batches" not in k)


def test_measures_this_host_training_the_model():
    model = build_model("cnn")
    flops = training_flops(model, torch.randn(32, 1, 28, 28), cpu_time=True)
    # A CPU core trains a small CNN at some GFLOP/s: not a figure of the batch's size alone.
    assert 1e8 < flops < 1e13
    half = training_flops(build_model("cnn"), torch.randn(16, 1, 28, 28), cpu_time=True)
    assert 0.25 < half / flops < 4   # FLOP/s, not FLOPs: about the same at half the batch


def test_a_model_without_counted_flops_is_refused():
    class Scale(torch.nn.Module):   # trains a weight, but no convolution or matrix product to count
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x * self.weight

    model = build_model("logreg")
    for name in model.block_names():
        model.blocks[name] = Scale()
    with pytest.raises(ValueError, match="no counted FLOPs.*--time-scale"):
        training_flops(model, torch.randn(4, 1, 28, 28), cpu_time=True)
