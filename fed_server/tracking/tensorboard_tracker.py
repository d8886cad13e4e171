"""TensorBoard: event files that ``tensorboard --logdir`` reads (``torch.utils.tensorboard``, which
needs the ``tensorboard`` package)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fed_server.records import RoundRecord
from fed_server.tracking.base import Tracker, import_backend, round_figures
from shared.config import TrackingConfig


class TensorBoardTracker(Tracker):
    """Every round's figures as scalars at step = the logical round; the configuration and the
    summary as text. Writes to ``<run-dir>/tensorboard``, or ``<tensorboard_dir>/<run-dir name>``
    so that one ``tensorboard --logdir`` shows several runs side by side. A resumed run adds an
    event file to the same folder, which TensorBoard reads as one run."""

    name = "tensorboard"

    def __init__(self, config: TrackingConfig, run_dir: Path) -> None:
        super().__init__(config, run_dir)
        self._summary_writer = import_backend(self.name, "torch.utils.tensorboard", "tensorboard",
                                              "tensorboard>=2.14").SummaryWriter
        self.log_dir = (Path(config.tensorboard_dir) / run_dir.name if config.tensorboard_dir is not None
                        else run_dir / "tensorboard")
        self.writer: Any = None

    def start(self, run_id: str, config: Mapping[str, Any]) -> None:
        resumed = any(self.log_dir.glob("events.out.tfevents.*"))
        self.writer = self._summary_writer(str(self.log_dir))
        if not resumed:
            self.writer.add_text("config", _markdown_json({"run_id": run_id, **config}), 0)
            self.writer.flush()

    def log_round(self, record: RoundRecord) -> None:
        for key, value in round_figures(record, self.config.per_device).items():
            self.writer.add_scalar(key, value, record.round)
        self.writer.flush()

    def finish(self, summary: Mapping[str, Any]) -> None:
        self.writer.add_text("summary", _markdown_json(summary), int(summary.get("rounds") or 0))
        self.writer.close()


def _markdown_json(data: Mapping[str, Any]) -> str:
    """``data`` as an indented JSON block (TensorBoard renders text as Markdown)."""
    text = json.dumps(data, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())
