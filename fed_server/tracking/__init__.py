"""Experiment tracking: the Fed Server sends every round's figures to TensorBoard, MLflow or
another registered backend as well as to ``metrics.jsonl`` (docs/tracking.md)."""
from fed_server.tracking.base import Tracker
from fed_server.tracking.registry import TRACKERS
from fed_server.tracking.tracking import Tracking

__all__ = ["TRACKERS", "Tracker", "Tracking"]
