"""Shared helpers of the integration tests (importable from test modules and conftest)."""
from __future__ import annotations

import json
from pathlib import Path

from shared.config import RunConfig


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
