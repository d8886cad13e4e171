"""Helpers for tests that start the real services as separate processes on loopback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.config import RunConfig
from testbed.runner import Testbed


def small_config(**overrides) -> RunConfig:
    """A run that finishes in seconds: few devices, short deadlines, fast emulated transfers."""
    data = {
        "algorithm": "s2fl",
        "rounds": 2,
        "data": {"num_devices": 4, "partition": "dirichlet", "alpha": 0.5, "seed": 1, "max_samples": 1200},
        "train": {"lr": 0.05, "batch_size": 64},
        "grouping": {"group_size": 2},
        "deadlines": {"round_s": 120, "join_s": 20, "step_s": 20},
        "devices": {"profiles": ["high"], "time_scale": 1000.0},
        "seed": 1,
    }
    for key, value in overrides.items():
        target = data
        parts = key.split(".")
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        target[parts[-1]] = value
    return RunConfig.model_validate(data)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(name="small_config")
def small_config_fixture():
    """The :func:`small_config` factory, for tests."""
    return small_config


@pytest.fixture
def run_testbed(tmp_path):
    """Run a config to completion on a real testbed; returns (final status, metrics, run dir)."""

    def run(config: RunConfig, agents: int = 1, timeout: float = 240.0, during=None):
        run_dir = tmp_path / f"run-{config.algorithm}"
        with Testbed(config, run_dir, agents=agents) as testbed:
            if during is not None:
                during(testbed)
            status = testbed.follow(timeout=timeout)
        return status, read_metrics(run_dir), run_dir

    return run
