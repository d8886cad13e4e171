"""What a device sends the Fed Server once a task is over: the round's upload, federated
evaluation's counts, or, for a task it gave up, the reason and its withdrawal."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pydantic import ValidationError

from device_agent.api import FedApi, Unreachable
from device_agent.device_model import DeviceModel
from device_agent.task_expired import TaskExpired
from shared.data import ArrayDataset
from shared.errors import DomainError
from shared.evaluation import EvaluationSums, evaluation_sums
from shared.losses import Loss
from shared.round_label import round_label
from shared.schemas import EvaluationReport, TaskResponse, UpdateRequest, WithdrawRequest
from shared.secagg.crypto import ShareError
from shared.wire import WireError

log = logging.getLogger("device_agent")

#: What a training task may fail with that is no fault of this process: a task it cannot build or
#: decode (Invalid; WireError: weights or a Main Server's gradient that do not decode; pydantic's
#: ValidationError: parameters the algorithm's device logic refuses, or an upload a diverged
#: training made invalid), a refusal by either server (a Main Server group that dropped the device
#: answers its join or step with 409 or 422), a server it cannot reach, a secure aggregation share
#: that does not verify (ShareError, naming its sender).
TASK_FAILURES: tuple[type[Exception], ...] = (DomainError, Unreachable, WireError, ValidationError, ShareError)

#: The longest reason a withdrawal may give (``WithdrawRequest.reason``'s limit).
WITHDRAW_REASON_MAX: int = next(m.max_length for m in WithdrawRequest.model_fields["reason"].metadata
                                if hasattr(m, "max_length"))

#: Called after every successful upload with the body and the round's split point (the agent's
#: optional metrics port uses it).
UploadHook = Callable[[UpdateRequest, int], None]


def upload(fed: FedApi, task: TaskResponse, body: UpdateRequest, received_at: float,
           on_upload: UploadHook | None) -> None:
    """Send the round's trained portion, tell ``on_upload``, and log the round's line (its time
    spent counts from ``received_at``, when the task arrived)."""
    fed.upload(body)
    spent_s = time.monotonic() - received_at
    assert task.split_point is not None
    if on_upload is not None:
        try:
            on_upload(body, task.split_point)
        except Exception:  # observability must never break training
            log.debug("%s: on_upload hook failed", body.device_id, exc_info=True)
    log.info("%s: %s done (split %d, %d steps, loss %.3f, spent %.2fs, %.2fs waiting)", body.device_id,
             round_label(task.round_index, task.round_id), task.split_point, body.steps, body.train_loss, spent_s, body.timings.wait_s)


def report_evaluation(fed: FedApi, device_id: str, task: TaskResponse, model: DeviceModel,
                      held_out: ArrayDataset | None, loss: Loss) -> None:
    """Federated evaluation: run the task's global model on the held-out part with the run's
    ``loss`` and report the sums (correct predictions, or a regression task's errors). A device
    that held nothing out reports zero samples, so the round need not wait for it (it sends no
    figures)."""
    assert task.round_id is not None
    sums = EvaluationSums(0, 0, 0.0)
    if held_out is not None and len(held_out) > 0:
        with model.task_scope():
            sums = evaluation_sums(model.whole_model_of(task), held_out, loss)
    fed.evaluation(EvaluationReport(device_id=device_id, round_id=task.round_id, num_samples=sums.samples,
                                    correct=sums.correct, loss_sum=sums.loss_sum,
                                    squared_error_sum=sums.squared_error_sum,
                                    absolute_error_sum=sums.absolute_error_sum))
    log.info("%s: evaluated %s on %d held-out samples (%s)", device_id, round_label(task.round_index, task.round_id),
             sums.samples, f"{sums.correct} correct" if loss.task == "classification" else f"loss {sums.loss_sum:.4g} in sum")


def abandon(fed: FedApi, device_id: str, task: TaskResponse, exc: Exception) -> None:
    """Give up a task that failed and say why in one line; from a training task, withdraw,
    so its attempt need not wait for this device.

    An expected failure (:data:`TASK_FAILURES`) is one WARNING line. Anything else is a fault
    in this process (a bug, memory running out): an ERROR with its traceback, and the device
    is still withdrawn and goes on, since it keeps nothing of the failed task and one task's
    fault need not cost it every later round. A task past its deadline (:class:`TaskExpired`)
    is not withdrawn: the Fed Server has closed its attempt already.
    """
    expected = isinstance(exc, (*TASK_FAILURES, TaskExpired))
    reason = " ".join(str(exc).split())   # one line: pydantic's messages span several
    if not expected:
        reason = f"{type(exc).__name__}: {reason}"
    # The attempt to withdraw from; none for an evaluation, an expired task or a malformed one.
    attempt = task.round_id if task.status == "train" and not isinstance(exc, TaskExpired) else None
    label = round_label(task.round_index, task.round_id)
    log.log(logging.WARNING if expected else logging.ERROR, "%s: %s%s abandoned%s: %s", device_id,
            "evaluation of " if task.status == "evaluate" else "", label,
            "" if attempt is None else ", withdrawing", reason, exc_info=not expected)
    if attempt is None:
        return
    try:
        fed.withdraw(WithdrawRequest(device_id=device_id, round_id=attempt, reason=reason[:WITHDRAW_REASON_MAX]))
    except (DomainError, Unreachable) as failed:   # best effort: the attempt's deadline ends it anyway
        log.warning("%s: %s: withdrawal not taken: %s", device_id, label, failed)
