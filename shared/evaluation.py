"""Where and how the global model is evaluated: on the Fed Server's test set, or federated (every
device of the round evaluates it on its held-out part and reports counts, which this module
combines). Also the evaluation of one model over one data set (the Fed Server's global model,
per-domain and local evaluations, a device's held-out part), with the run's loss: accuracy for a
classification task, MSE and MAE for a regression task (docs/models.md, "Loss and task").
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch.func import functional_call

from shared.data import ArrayDataset, load_dataset
from shared.data.spec import DataSpec
from shared.losses import Loss, Task, build_loss
from shared.torch_device import model_device

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.schemas import EvaluationReport

EvaluationMode = Literal["server", "federated"]

#: Test images per forward pass. 128 rather than 500: the activations of 500 images of the
#: built-in cnn raised the Fed Server's peak memory, and the smaller batch was also faster on one
#: thread (measured: benchmarks/why-the-code-is-as-it-is.md, "Evaluation in batches of 128", and
#: its result files).
EVAL_BATCH = 128


@dataclass(frozen=True)
class EvaluationSums:
    """What one model scored over one data set, as sums over its samples: what a device reports, so
    that the server can weight every device by its sample count exactly. ``correct`` counts for a
    classification task, the error sums (each sample's error averaged over its targets) for a
    regression task; the other kind stays 0."""

    samples: int
    correct: int
    loss_sum: float
    squared_error_sum: float = 0.0
    absolute_error_sum: float = 0.0


@dataclass(frozen=True)
class Figures:
    """The means of :class:`EvaluationSums`: ``accuracy`` (classification) or ``mse`` and ``mae``
    (regression; None for the other task), and the mean loss."""

    accuracy: float | None
    loss: float
    mse: float | None = None
    mae: float | None = None


@torch.no_grad()
def evaluation_sums(model: torch.nn.Module, data: ArrayDataset, loss: Loss | None = None,
                    batch_size: int = EVAL_BATCH, device: torch.device | None = None) -> EvaluationSums:
    """:class:`EvaluationSums` of ``model`` over ``data``, in eval mode, with the run's ``loss``
    (None: cross-entropy, classification).

    Without ``device`` it runs where the model's weights are (a device agent's model on its
    ``--torch-device``). With ``device`` (the Fed Server's ``--torch-device``) the model itself
    stays where it is (the global model stays on the CPU, where uploads are aggregated): its
    parameters and buffers are copied to ``device`` once per call and used through
    ``torch.func.functional_call``, which is cheaper than copying the module (one copy of the
    weights, none of the structure; no copy at all when ``device`` is where they already are,
    so the CPU runs this same path bit for bit). The data set stays on the CPU and each batch
    follows the weights.
    """
    loss = loss if loss is not None else build_loss()
    was_training = model.training
    model.eval()
    weights = None
    if device is None:
        target = model_device(model)
    else:
        target = torch.device(device)
        weights = {name: t.to(target) for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}
    correct, loss_sum, squared, absolute = 0, 0.0, 0.0, 0.0
    try:
        for start in range(0, len(data), batch_size):
            x = data.x[start:start + batch_size].to(target)
            y = data.y[start:start + batch_size].to(target)
            output = model(x) if weights is None else functional_call(model, weights, (x,))
            loss_sum += float(loss.total(output, y))
            if loss.task == "classification":
                correct += int((output.argmax(dim=1) == y).sum())
            else:
                error = (loss.predictions(output) - loss.targets(output, y)).reshape(len(y), -1)
                squared += float(error.square().mean(dim=1).sum())
                absolute += float(error.abs().mean(dim=1).sum())
            if data.release_rows is not None:   # a mapped test set: hold one batch of it at a time
                data.release_rows(start, min(start + batch_size, len(data)) - 1)
    finally:
        model.train(was_training)
    return EvaluationSums(len(data), correct, loss_sum, squared, absolute)


def figures(sums: EvaluationSums, task: Task) -> Figures:
    """The means of ``sums`` over their samples, as the ``task`` reports them."""
    n = max(1, sums.samples)
    if task == "classification":
        return Figures(sums.correct / n, sums.loss_sum / n)
    return Figures(None, sums.loss_sum / n, sums.squared_error_sum / n, sums.absolute_error_sum / n)


def evaluate(model: torch.nn.Module, data: ArrayDataset, loss: Loss | None = None, batch_size: int = EVAL_BATCH,
             device: torch.device | None = None) -> Figures:
    """The :class:`Figures` of ``model`` over ``data`` with ``loss`` (None: cross-entropy), in eval
    mode (see :func:`evaluation_sums` for ``device``)."""
    loss = loss if loss is not None else build_loss()
    return figures(evaluation_sums(model, data, loss, batch_size, device), loss.task)


def classification_accuracy(model: torch.nn.Module, data: ArrayDataset, batch_size: int = EVAL_BATCH) -> float:
    """The accuracy in [0, 1] of a classifier over ``data`` (what the classification-only
    algorithms and the benchmarks compare)."""
    return evaluation_sums(model, data, batch_size=batch_size).correct / max(1, len(data))


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


def server_test_set(spec: DataSpec, task: Task = "classification") -> ArrayDataset | None:
    """The Fed Server's test set: a built-in data set's test split, ``data.test_file`` for a local
    run (loaded, checked and transformed like the devices' files, with the ``task``'s labels), or
    None when there is none."""
    if spec.dataset != "local":
        # Without its writer ids, which evaluation does not read (at 10,000 Synthetic devices, a
        # list of a million references held for the whole run).
        return dataclasses.replace(load_dataset(spec)[1], writers=None)
    if spec.test_file is None:
        return None
    # Imported here: the local loaders (Pillow, user functions) are only needed by local runs.
    from shared.data.local import load_data_file
    return load_data_file(spec.test_file, spec, task=task)


@dataclass(frozen=True)
class FederatedResult:
    """The sample-weighted means over the devices' evaluation reports."""

    figures: Figures | None     # None: no device evaluated any sample
    devices: int                # devices that evaluated at least one sample
    samples: int


def combine_reports(reports: Iterable["EvaluationReport"], task: Task = "classification") -> FederatedResult:
    """Sum correct predictions (or errors), losses and samples over the reports: the figures are
    then the means over every held-out sample of the round, i.e. each device weighted by its
    held-out size. Reports of devices that held out nothing count for nothing."""
    devices, samples, correct, loss_sum, squared, absolute = 0, 0, 0, 0.0, 0.0, 0.0
    for report in reports:
        if report.num_samples == 0:
            continue
        devices += 1
        samples += report.num_samples
        correct += report.correct
        loss_sum += report.loss_sum
        squared += report.squared_error_sum
        absolute += report.absolute_error_sum
    if samples == 0:
        return FederatedResult(None, 0, 0)
    return FederatedResult(figures(EvaluationSums(samples, correct, loss_sum, squared, absolute), task), devices, samples)
