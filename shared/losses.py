"""The run's loss (``train.loss``) and task (``train.task``): what every party that computes a loss
uses (a device training its whole model, the Main Server's group step, the algorithms' local
objectives) and what the global model's figures are (accuracy, or MSE and MAE).

A loss is a built-in name of :data:`LOSSES` (a ``torch.nn.functional`` function, the task it
serves, and whether it expects raw logits) or an import path ``package.module:function`` from the
operator's configuration: code, imported only where the operator named it (the Fed Server's config,
the Main Server's and device agent's ``--loss``), never because a message did
(:func:`check_loss_origin`; docs/security.md). Adding a built-in loss is one line in
:data:`LOSSES` (docs/extending.md).

The task decides the labels and the figures: ``classification`` has integer class labels ``[N]``
and reports accuracy; ``regression`` has float targets ``[N]`` or ``[N, k]`` and reports the mean
squared and mean absolute error of the model's predictions. This module imports no torch at import
time: the run configuration (``shared.config``) resolves the task from it in processes that never
load torch (docs/configuration.md, ``python -m testbed``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from shared.imports import check_import_origin, import_callable, is_import_path

if TYPE_CHECKING:
    import torch

Task = Literal["classification", "regression"]
TASKS: tuple[str, ...] = get_args(Task)


@dataclass(frozen=True)
class BuiltinLoss:
    """A built-in loss: the ``torch.nn.functional`` function it calls, the task it serves, whether
    it expects raw scores (a head ending in a softmax or a sigmoid is then a mistake), and how the
    model's output becomes the prediction that MSE and MAE compare with the targets."""

    function: str
    task: Task
    expects_logits: bool = False
    prediction: Literal["output", "sigmoid"] = "output"


#: Built-in losses by name (``train.loss``). Targets of the regression losses are float
#: ``[N]`` (a model with one output) or ``[N, k]``; ``bce_with_logits`` is the multi-label loss:
#: 0/1 (or probability) targets ``[N, k]`` against k raw scores, with the regression task's float
#: targets and figures (MSE and MAE of sigmoid(output): the Brier score and its absolute twin).
LOSSES: dict[str, BuiltinLoss] = {
    "cross_entropy": BuiltinLoss("cross_entropy", "classification", expects_logits=True),
    "nll": BuiltinLoss("nll_loss", "classification"),            # for a head ending in LogSoftmax
    "mse": BuiltinLoss("mse_loss", "regression"),
    "l1": BuiltinLoss("l1_loss", "regression"),
    "mae": BuiltinLoss("l1_loss", "regression"),
    "smooth_l1": BuiltinLoss("smooth_l1_loss", "regression"),
    "huber": BuiltinLoss("huber_loss", "regression"),
    "bce_with_logits": BuiltinLoss("binary_cross_entropy_with_logits", "regression", expects_logits=True,
                                   prediction="sigmoid"),
}

DEFAULT_LOSS = "cross_entropy"


def resolve_task(loss: str, task: Task | None) -> Task:
    """The run's task: a built-in loss's own (an explicit ``task`` must agree with it), or for an
    import path the explicit one. ValueError, in one line, for an unknown name, an import path
    without a task, or a task the built-in loss does not serve."""
    builtin = LOSSES.get(loss)
    if builtin is None:
        if not is_import_path(loss):
            raise ValueError(f"unknown loss {loss!r}: use a built-in name ({', '.join(LOSSES)}) or an import path "
                             f"package.module:function")
        if task is None:
            raise ValueError(f"loss {loss!r} is an import path: set train.task to {' or '.join(TASKS)}")
        return task
    if task is not None and task != builtin.task:
        raise ValueError(f"loss {loss!r} is a {builtin.task} loss, but train.task is {task!r}: leave train.task "
                         f"unset or choose a {task} loss")
    return builtin.task


def label_bins(num_classes: int, task: Task) -> int:
    """How many entries a device's label counts have: one per class, or for a regression task one
    bin holding all its samples (nothing to balance; docs/models.md, "Loss and task")."""
    return num_classes if task == "classification" else 1


def label_counts_problem(entries: int, num_classes: int, task: Task) -> str | None:
    """Why label counts of ``entries`` entries do not fit the run (:func:`label_bins`), or None."""
    bins = label_bins(num_classes, task)
    if entries == bins:
        return None
    if task == "classification":
        return f"label_counts has {entries} entries; the model has {num_classes} classes"
    return f"label_counts has {entries} entries; a regression task counts all samples in 1 bin"


def check_loss_origin(run_loss: str, local_loss: str | None) -> None:
    """Refuse to import a loss named by the network: a run whose loss is an import path is used
    only if the operator gave this process the same reference (``--loss``). ValueError saying how
    to start the process."""
    check_import_origin("loss", run_loss, local_loss)


class Loss:
    """The run's loss, ready to use: :meth:`mean` is the training objective on one batch,
    :meth:`total` its sum over the batch's samples (for evaluation sums), :meth:`predictions` what
    the regression figures compare with the targets.

    A regression target ``[N]`` against a model with one output (``[N, 1]``) is compared as
    ``[N, 1]``, so a single-output model needs no squeeze of its own.
    """

    def __init__(self, name: str, task: Task) -> None:
        self.name = name
        self.task = task
        self.builtin = LOSSES.get(name)
        self._fn: Callable[..., torch.Tensor]
        if self.builtin is not None:
            import torch.nn.functional as F
            self._fn = getattr(F, self.builtin.function)
        else:
            self._fn = import_callable(name, f"loss {name!r}")

    @property
    def expects_logits(self) -> bool:
        """Whether the loss wants raw scores (a softmax or sigmoid at the end of the head is wrong)."""
        return self.builtin is not None and self.builtin.expects_logits

    def targets(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``target`` in the shape the loss compares with ``output`` (see the class docstring)."""
        if self.task == "regression" and target.dim() == 1 and output.dim() == 2 and output.shape[1] == 1:
            return target.unsqueeze(1)
        return target

    def mean(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss over the batch: the training objective."""
        return self._fn(output, self.targets(output, target))

    def total(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss summed over the batch's samples (each sample's loss averaged over its targets),
        so that sums over batches and devices divided by the samples give the mean."""
        target = self.targets(output, target)
        n = max(1, int(target.shape[0]))
        if self.builtin is None:
            return self._fn(output, target) * n
        per_sample = target.numel() / n   # targets per sample: 1 for class labels
        total = self._fn(output, target, reduction="sum")
        return total if per_sample == 1 else total / per_sample

    def predictions(self, output: torch.Tensor) -> torch.Tensor:
        """What the regression figures compare with the targets: the output, or its sigmoid for
        ``bce_with_logits``."""
        if self.builtin is not None and self.builtin.prediction == "sigmoid":
            return output.sigmoid()
        return output


def build_loss(name: str = DEFAULT_LOSS, task: Task | None = None) -> Loss:
    """The :class:`Loss` of a run's ``train.loss`` (and ``train.task``); ValueError for a name that
    is neither built in nor an import path that imports (the caller has checked the origin)."""
    return Loss(name, resolve_task(name, task))


def softmax_head_warning(model: torch.nn.Module, loss: Loss) -> str | None:
    """One line when ``model`` ends in a softmax, log-softmax or sigmoid while ``loss`` expects raw
    scores (it applies its own): the model then trains on doubly squashed outputs, slowly and to a
    worse accuracy. None when nothing is wrong."""
    from torch import nn

    last = list(model.modules())[-1]
    if not loss.expects_logits or not isinstance(last, (nn.Softmax, nn.LogSoftmax, nn.Sigmoid)):
        return None
    kind = type(last).__name__
    hint = ("or set train.loss: nll, which takes log-probabilities" if isinstance(last, nn.LogSoftmax) else
            "the loss applies it itself")
    return (f"the model ends in nn.{kind}, but train.loss {loss.name!r} expects raw scores (logits): remove the "
            f"final nn.{kind} from the model ({hint})")
