"""Tracking backends by name (``tracking.backends``). Adding one: write its module (a
:class:`~fed_server.tracking.base.Tracker` that imports its package in ``__init__``), add one line here."""
from __future__ import annotations

from pathlib import Path

from fed_server.tracking.base import Tracker
from fed_server.tracking.mlflow_tracker import MlflowTracker
from fed_server.tracking.tensorboard_tracker import TensorBoardTracker
from shared.config import TrackingConfig

TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MlflowTracker,
}


def build_trackers(config: TrackingConfig, run_dir: Path) -> list[Tracker]:
    """One tracker per configured backend, each with its package imported. ValueError (one line)
    for an unknown name or a missing package."""
    for name in config.backends:
        if name not in TRACKERS:
            raise ValueError(f"unknown tracking backend {name!r}; choose from {sorted(TRACKERS)}")
    return [TRACKERS[name](config, run_dir) for name in config.backends]
