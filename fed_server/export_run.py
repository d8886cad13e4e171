"""``python -m fed_server export``: a run directory's global model as files plain PyTorch loads.

Reads the run's ``config.yaml`` (which model, which data) and ``checkpoint.msgpack`` (the global
model after the last completed round), and writes the formats of :mod:`shared.models.export`.
Nothing here comes from the network: the run directory is the operator's own.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.models.export import FORMATS, Exported, export_model
from shared.run_config import build_config_model, load_run_config


#: The figures of the global model a run records, by its task: what an export reports of it.
FIGURES = {"classification": ("test_accuracy",), "regression": ("test_mse", "test_mae")}


@dataclass(frozen=True)
class RunExport:
    """What was exported: the files, the round the model is from, and the figures recorded for it
    (:data:`FIGURES` of the run's task; None where the round has none)."""

    exported: Exported
    round: int
    figures: dict[str, float | None]

    def figures_text(self) -> str:
        """The recorded figures for a line: ``test accuracy 0.8890``, ``test mse 0.0412, test mae 0.1604``."""
        return ", ".join(f"{key.replace('_', ' ')} {value:.4f}" for key, value in self.figures.items()
                         if value is not None)


def export_run(run_dir: str | Path, out_dir: str | Path | None = None,
               formats: Sequence[str] = tuple(FORMATS)) -> RunExport:
    """Export ``run_dir``'s global model into ``out_dir`` (default: the run directory itself).
    ValueError, one line, for a folder that holds no run or no checkpoint yet."""
    from fed_server.records import read_round_records
    from fed_server.run_dir import RunDirectory

    path = Path(run_dir)
    if not (path / "config.yaml").is_file():
        raise ValueError(f"{path} holds no run (no config.yaml): give the run directory a Fed Server wrote")
    run = RunDirectory(path)
    if not run.checkpoint_path.is_file():
        raise ValueError(f"{path} has no checkpoint yet: no round of this run has completed")
    raw = run.read_config() or {}
    config = load_run_config({k: v for k, v in raw.items() if k != "run_id"})
    rounds_done, state, _ = run.read_checkpoint()
    model = build_config_model(config, layout=False)
    num_classes, input_shape = model.num_classes, model.input_shape
    records = [r for r in read_round_records(run.metrics_path) if r.status == "ok" and r.round == rounds_done]
    figures = {key: getattr(records[-1], key) if records else None for key in FIGURES[config.train.resolved_task]}
    description = {"model": config.model, "model_params": config.model_params, "num_classes": num_classes,
                   "input_shape": list(input_shape), "run_id": raw.get("run_id"), "round": rounds_done,
                   "task": config.train.resolved_task, **figures}
    exported = export_model(model, state, out_dir if out_dir is not None else path, formats, description)
    return RunExport(exported, rounds_done, figures)
