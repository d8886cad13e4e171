"""Where and how the global model is evaluated: on the Fed Server's test set, or federated (every
device of the round evaluates it on its held-out part and reports counts, which this module
combines). Also the evaluation of one model over one data set (the Fed Server's global model,
per-domain and local evaluations, a device's held-out part).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from shared.data import ArrayDataset, load_dataset
from shared.data.spec import DataSpec

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.schemas import EvaluationReport

EvaluationMode = Literal["server", "federated"]


@torch.no_grad()
def evaluation_counts(model: torch.nn.Module, data: ArrayDataset, batch_size: int = 500) -> tuple[int, float]:
    """(correct predictions, summed cross-entropy) over ``data``, in eval mode: what a device
    reports, so that the server can weight every device by its sample count exactly."""
    was_training = model.training
    model.eval()
    correct, loss_sum = 0, 0.0
    for start in range(0, len(data), batch_size):
        x, y = data.x[start:start + batch_size], data.y[start:start + batch_size]
        logits = model(x)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(dim=1) == y).sum())
    model.train(was_training)
    return correct, loss_sum


def evaluate(model: torch.nn.Module, data: ArrayDataset, batch_size: int = 500) -> tuple[float, float]:
    """(accuracy in [0, 1], mean cross-entropy) over ``data``, in eval mode."""
    correct, loss_sum = evaluation_counts(model, data, batch_size)
    n = max(1, len(data))
    return correct / n, loss_sum / n


def has_server_test_set(spec: DataSpec) -> bool:
    """Whether the Fed Server holds a test set: every built-in data set does; ``local`` only with
    ``data.test_file``."""
    return spec.dataset != "local" or spec.test_file is not None


def evaluation_mode(config: "RunConfig") -> EvaluationMode:
    """The run's evaluation: ``evaluation.mode``, with ``auto`` resolved to ``server`` when the Fed
    Server has a test set and ``federated`` when it has none."""
    if config.evaluation.mode != "auto":
        return config.evaluation.mode
    return "server" if has_server_test_set(config.data) else "federated"


def server_test_set(spec: DataSpec) -> ArrayDataset | None:
    """The Fed Server's test set: a built-in data set's test split, ``data.test_file`` for a local
    run (loaded, checked and transformed like the devices' files), or None when there is none."""
    if spec.dataset != "local":
        return load_dataset(spec)[1]
    if spec.test_file is None:
        return None
    # Imported here: the local loaders (Pillow, user functions) are only needed by local runs.
    from shared.data.local import load_npz
    return load_npz(spec.test_file, spec)


@dataclass(frozen=True)
class FederatedResult:
    """The sample-weighted mean over the devices' evaluation reports."""

    accuracy: float | None      # None: no device evaluated any sample
    loss: float | None
    devices: int                # devices that evaluated at least one sample
    samples: int


def combine_reports(reports: Iterable["EvaluationReport"]) -> FederatedResult:
    """Sum correct predictions, losses and samples over the reports: the accuracy and loss are
    then the means over every held-out sample of the round, i.e. each device weighted by its
    held-out size. Reports of devices that held out nothing count for nothing."""
    devices, samples, correct, loss_sum = 0, 0, 0, 0.0
    for report in reports:
        if report.num_samples == 0:
            continue
        devices += 1
        samples += report.num_samples
        correct += report.correct
        loss_sum += report.loss_sum
    if samples == 0:
        return FederatedResult(None, None, 0, 0)
    return FederatedResult(correct / samples, loss_sum / samples, devices, samples)
