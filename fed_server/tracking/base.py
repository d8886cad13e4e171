"""The interface of an experiment-tracking backend, and what every backend logs of a round.

A backend gets the run's start (its id and configuration), every aggregated round's figures
(:func:`round_figures`, step = the logical round) and the run's summary. It is only ever called from
its own worker thread (``fed_server/tracking/tracking.py``), never from the event loop, so it may
block on a disk or a server; an exception it raises is reported once and never stops the run.
"""
from __future__ import annotations

import importlib
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from fed_server.records import RoundRecord
from shared.config import TrackingConfig


class Tracker(ABC):
    """One backend for one run. Construction imports the backend's package (a missing one is a
    ValueError naming what to install: the Fed Server refuses to start); ``start``, ``log_round``
    and ``finish`` write, and may raise on a full disk or a server that is down."""

    #: The name ``tracking.backends`` uses (the key in ``fed_server/tracking/registry.py``).
    name: ClassVar[str]

    def __init__(self, config: TrackingConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir

    @abstractmethod
    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        """Open the run's log, or reopen the one this run directory already has (a resumed run);
        ``config``: the run configuration as plain JSON values."""

    @abstractmethod
    def log_round(self, record: RoundRecord) -> None:
        """Log an aggregated round's :func:`round_figures` at step ``record.round``."""

    @abstractmethod
    def finish(self, summary: Mapping[str, Any]) -> None:
        """Log the run's summary (``summary.json``) and close the log."""


def import_backend(backend: str, module: str, package: str, install: str) -> ModuleType:
    """``module``, imported for ``backend``; ValueError, in one line, saying which package to
    install when it does not import."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"tracking backend {backend!r} needs the {package} package: pip install '{install}'") from None


def round_figures(record: RoundRecord, per_device: bool = False) -> dict[str, float]:
    """The numeric figures of a round record, under ``metrics.jsonl``'s field names where it has
    one: accuracy and losses, times, bytes, how many devices were selected, aggregated, dropped and
    evaluated, the mean split point (blocks on the device), and the algorithm's own numeric figures as ``algorithm/<key>``.
    With ``per_device``, each uploader's split point and timings as ``device/<id>/<name>``
    (:func:`device_figures`). A figure the record does not have (no test set, a failed evaluation) is left out."""
    figures: dict[str, float | int | None] = {
        "test_accuracy": record.test_accuracy, "test_loss": record.test_loss, "train_loss": record.train_loss,
        "test_mse": record.test_mse, "test_mae": record.test_mae,
        "round_time_s": record.round_time_s, "elapsed_s": record.elapsed_s, "aggregation_s": record.aggregation_s,
        "evaluation_s": record.evaluation_s,
        "bytes_up": record.bytes_up, "bytes_down": record.bytes_down, "bytes_server": record.bytes_server,
        "bytes_total": record.bytes_total, "cumulative_bytes": record.cumulative_bytes,
        "selected": len(record.selected), "participants": len(record.aggregated), "dropped": len(record.dropped),
        "evaluated_devices": record.evaluated_devices, "evaluated_samples": record.evaluated_samples,
        "split_point_mean": (sum(record.split_points.values()) / len(record.split_points)
                             if record.split_points else None),
    }
    for key, value in record.algorithm_metrics.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            figures[f"algorithm/{key}"] = value
    if per_device:
        figures.update(device_figures(record))
    return {key: float(value) for key, value in figures.items() if value is not None}


def device_figures(record: RoundRecord) -> dict[str, float]:
    """Each device that uploaded in the round: its split point, the timings it reported
    (``compute_s``, ``transfer_s``, ``wait_s``, ``server_s``, ``total_s``), the seconds its upload
    took to arrive (``upload_s``) and its entry in the client time table (``table_s``)."""
    out: dict[str, float] = {}
    for device, timings in record.device_times.items():
        prefix = f"device/{device}/"
        if device in record.split_points:
            out[prefix + "split_point"] = float(record.split_points[device])
        out.update({prefix + name: float(value) for name, value in timings.model_dump().items()})
        if device in record.upload_times:
            out[prefix + "upload_s"] = record.upload_times[device]
        if device in record.table_times:
            out[prefix + "table_s"] = record.table_times[device]
    return out


def summary_figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """The summary's numeric values (final and best accuracy, totals...), booleans left out."""
    return {key: float(value) for key, value in summary.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The configuration as dotted keys and text values (``train.lr`` -> ``"0.05"``), as a
    tracker's parameters; a list or an empty mapping is one value, as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out
