"""Checkpoint contents and the resume rule, without a coordinator."""
from __future__ import annotations

import random

import pytest
import torch

from fed_server.checkpoint import RunProgress, config_differences, load_checkpoint, save_checkpoint
from fed_server.run_dir import RunDirectory
from shared.config import RunConfig


def test_progress_round_trips_through_the_checkpoint(tmp_path):
    run_dir = RunDirectory(tmp_path)
    config = RunConfig()
    run_dir.write_config(config, "abc")
    rng = random.Random(5)
    rng.random()
    progress = RunProgress(run_id="abc", rounds_done=3, attempts=4, failed_in_a_row=1, history_len=4,
                           cumulative_bytes=123, elapsed_s=9.5, rng_state=rng.getstate(),
                           algorithm_state={"lambda": {"d0": 0.5}},
                           time_table={"cells": {"d0": {"1": [0.25, 0.0, 0.0]}}, "levels": {"d0": [2.0, 1.0]},
                                       "censored": {"d0": {"3": 9.5}}, "latest": {"d0": 1}, "noise": [0.1]},
                           finished=False, stop_reason=None)
    save_checkpoint(run_dir, {"w": torch.arange(3.0)}, progress)
    state, loaded = load_checkpoint(run_dir, config)
    assert torch.equal(state["w"], torch.arange(3.0))
    assert loaded == progress
    again = random.Random()
    again.setstate(loaded.rng_state)
    assert again.random() == rng.random()


def test_no_checkpoint_means_a_new_run(tmp_path):
    assert load_checkpoint(RunDirectory(tmp_path), RunConfig()) is None


def test_only_rounds_and_deadlines_may_change_on_resume(tmp_path):
    old = RunConfig().model_dump(mode="json")
    new = RunConfig(rounds=99, deadlines={"round_s": 5.0}, train={"lr": 0.2}, seed=7).model_dump(mode="json")
    assert config_differences({"run_id": "a", **old}, new) == ["seed", "train.lr"]
    run_dir = RunDirectory(tmp_path)
    run_dir.write_config(RunConfig(), "a")
    save_checkpoint(run_dir, {}, RunProgress("a", 0, 0, 0, 0, 0, 0.0, random.Random().getstate()))
    with pytest.raises(ValueError, match=r"seed, train\.lr differ"):
        load_checkpoint(run_dir, RunConfig(train={"lr": 0.2}, seed=7))
    assert load_checkpoint(run_dir, RunConfig(rounds=50)) is not None
