"""What a round and a run leave behind: the typed record of one round attempt and the run summary.

A ``RoundRecord`` is held in ``Progress.history`` (``fed_server/progress.py``), served by ``GET /v1/status``, folded into
the Prometheus metrics and written as one line of ``metrics.jsonl``. The line's keys are the
model's field names, unchanged from the dict records this model replaced, so ``experiments/`` and
committed results still parse (docs/metrics.md lists the fields). Whoever reads ``metrics.jsonl``
(benchmarks, experiments, the testbed, a resumed Fed Server) reads it with :func:`read_round_records`.

The module imports no torch, so the testbed's launcher can type the records it follows.
"""
from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from shared.losses import Task
from shared.timings import DeviceTimings

if TYPE_CHECKING:   # both import torch, which the readers of records (the testbed's launcher) never load
    from fed_server.fed_round import FedRound
    from shared.evaluation import Figures


def finite_json(value: Any) -> Any:
    """``value`` with every non-finite float (inf, -inf, nan) replaced by None, at any depth.

    Why: ``json.dumps`` writes such floats as ``Infinity``/``NaN``, which is not JSON; a train
    loss of 1e308 averaged over samples overflows to inf, and every metrics reader must still parse.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def json_line(data: Mapping[str, Any]) -> str:
    """One standard-JSON line (non-finite numbers as null; ``allow_nan=False`` guards the rest)."""
    return json.dumps(finite_json(data), allow_nan=False) + "\n"


class GroupRecord(BaseModel):
    """One Main Server group of a round: who trained in it, who was dropped, its cost."""

    model_config = ConfigDict(extra="forbid")

    group_id: int
    members: list[str]
    dropped: list[str]
    label_distance: float | None
    start_block: int
    train_time_s: float | None


class PrivacyRecord(BaseModel):
    """A private round's privacy figures (``RoundRecord.privacy``)."""

    model_config = ConfigDict(extra="forbid")

    clip_norm: float
    epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    # The devices the round selected over those it selected from: the rate the ledger spent.
    sample_rate: float | None = None
    unclipped_fraction: float | None = None


class SamplePrivacyRecord(BaseModel):
    """DP-SGD's figures after a round (``RoundRecord.sample_privacy``; fed_server/sample_privacy.py)."""

    model_config = ConfigDict(extra="forbid")

    #: The largest sample-level epsilon of any device so far, at ``delta``, and that device.
    epsilon: float
    device: str | None = None
    delta: float
    noise_multiplier: float
    max_grad_norm: float


class RoundRecord(BaseModel):
    """The record of one round attempt. ``round`` is the logical round (1..rounds, repeated by a
    retried attempt); ``round_id`` the attempt's wire id (never reused)."""

    model_config = ConfigDict(extra="forbid")

    round: int
    round_id: int
    algorithm: str
    status: Literal["ok", "failed"]
    test_accuracy: float | None
    test_loss: float | None
    train_loss: float | None
    # A regression task's figures (docs/metrics.md): the mean squared and mean absolute error of the
    # global model's predictions; None for a classification task (whose figure is test_accuracy).
    test_mse: float | None = None
    test_mae: float | None = None
    round_time_s: float
    elapsed_s: float
    selected: list[str]
    aggregated: list[str]
    dropped: list[str]
    split_points: dict[str, int]
    device_times: dict[str, DeviceTimings]
    device_kinds: dict[str, str]
    # Per device: seconds its upload took to arrive, timed by the Fed Server (not in its own
    # device_times, which travel inside that upload), and its round time for the client time
    # table (compute + transfer + server + upload; fed_server/update_checks.py table_time).
    upload_times: dict[str, float] = {}
    table_times: dict[str, float] = {}
    # ... and of that time, the [transfer, compute] seconds the time table took as its parts
    # (FedRound.table_parts): with table_times, all a run's split choices are replayed from.
    table_parts: dict[str, tuple[float, float]] = {}
    groups: list[GroupRecord]
    bytes_up: int
    bytes_down: int
    bytes_server: int
    bytes_total: int
    cumulative_bytes: int
    plan_error: str | None
    aggregation_s: float = 0.0
    # Seconds the Fed Server took to evaluate this round's model on its test set, beside the next
    # round's training (docs/configuration.md); None when it did not evaluate (federated, failed).
    evaluation_s: float | None = None
    # Main Server replicas lost during this attempt (their unfinished groups' devices were dropped).
    lost_replicas: list[str] = []
    # Why each selected device that was not aggregated was left out (a refused upload with the
    # refusal, a withdrawal with its reason, dropped by the Main Server, no upload by the deadline...).
    left: dict[str, str] = {}
    # Federated evaluation (docs/metrics.md): how many devices reported an evaluation of this
    # round's global model and over how many held-out samples; None when the Fed Server evaluated.
    evaluated_devices: int | None = None
    evaluated_samples: int | None = None
    # Each algorithm's own per-round figures (FNR-FL's public accuracies, HiCS-FL's entropies...):
    # their shapes belong to the algorithms, so the record keeps them as the JSON they are.
    algorithm_metrics: dict[str, Any] = {}
    # Differential privacy (docs/privacy.md), for an aggregated round: the epsilon spent so far at
    # delta, the round's noise multiplier and clip bound, and (adaptive clipping) the noised fraction
    # of devices whose update was inside it. None without privacy.clipping.
    privacy: PrivacyRecord | None = None
    # Sample-level DP-SGD (train.dp_sgd; docs/privacy.md), for every attempt: the worst device's
    # epsilon over the tasks handed out so far. None without train.dp_sgd.
    sample_privacy: SamplePrivacyRecord | None = None
    # Secure aggregation (docs/privacy.md), for an aggregated attempt: the entries of the unmasked
    # sum beyond what the survivors' clipped updates can add up to, clamped to it (0 unless some
    # survivor uploaded outside value_range). None without secure aggregation.
    secure_clamped: int | None = None

    @field_validator("test_accuracy", "test_loss", "train_loss", "test_mse", "test_mae", "aggregation_s", "evaluation_s")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        return value if value is None or math.isfinite(value) else None

    @field_validator("algorithm_metrics")
    @classmethod
    def _finite_metrics(cls, value: dict[str, Any]) -> dict[str, Any]:
        return finite_json(value)

    def to_json(self) -> dict[str, Any]:
        """The record as plain JSON values: the ``metrics.jsonl`` line and the status payload."""
        return finite_json(self.model_dump(mode="json"))


def parse_round_record(raw: str | Mapping[str, Any]) -> RoundRecord:
    """A round record from a ``metrics.jsonl`` line or a status answer's decoded JSON; ValueError,
    one line, naming the first field that does not fit (a file or server of another version)."""
    try:
        return RoundRecord.model_validate_json(raw) if isinstance(raw, str) else RoundRecord.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"not a round record: {field + ': ' if field else ''}{first['msg']}") from None


def read_round_records(path: Path) -> list[RoundRecord]:
    """Every round record of the ``metrics.jsonl`` at ``path``, in order (empty when there is none
    yet); ValueError naming the file and line of one that is not a record."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(parse_round_record(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
    return records


class RunStatus(BaseModel):
    """``GET /v1/status``: the run's state and the records of the logical rounds after ``since``."""

    run_id: str
    algorithm: str
    state: Literal["waiting_for_devices", "running", "finished"]
    rounds_total: int
    rounds_done: int
    registered: int
    expected_devices: int
    open_round: int | None          # attempt id (``round_id``) of the round in progress
    initial: dict[str, float | None]  # the initial model's figure_fields (None values: federated evaluation)
    records: int                    # round records written so far, every attempt (``history`` may hold fewer)
    history: list[RoundRecord]
    summary: dict[str, Any] | None  # summary.json's contents once finished
    driver_error: str | None
    # A run resumed from its checkpoint: the rounds done and the last attempt id handed out before
    # the restart (the records with a round_id up to it were restored, not run again); None for a
    # run that did not resume.
    resumed_after_round: int | None = None
    resumed_after_attempt: int | None = None


def figure_fields(figures: Figures | None, task: Task) -> dict[str, float | None]:
    """A record's figures of the global model: ``test_accuracy`` and ``test_loss``, and for a
    regression task ``test_mse`` and ``test_mae`` too (all None when nothing was evaluated)."""
    fields = {"test_accuracy": figures.accuracy if figures else None, "test_loss": figures.loss if figures else None}
    if task == "regression":
        fields.update(test_mse=figures.mse if figures else None, test_mae=figures.mae if figures else None)
    return fields


def round_record(fed_round: FedRound, algorithm: str, used: Sequence[str], dropped: set[str], status: str,
                 figures: Mapping[str, float | None], duration: float, elapsed: float, cumulative_bytes: int,
                 device_kinds: Mapping[str, str], aggregation_s: float, algorithm_metrics: Mapping[str, Any],
                 evaluated_devices: int | None = None, evaluated_samples: int | None = None,
                 privacy: Mapping[str, Any] | None = None,
                 sample_privacy: Mapping[str, Any] | None = None, secure_clamped: int | None = None) -> RoundRecord:
    """The record of one finished round attempt; ``figures`` are its :func:`figure_fields`."""
    updates = fed_round.updates
    up, down, server = round_bytes(fed_round)
    total_samples = sum(updates[d].request.num_samples for d in used) or 1
    train_loss = sum(updates[d].request.train_loss * updates[d].request.num_samples for d in used) / total_samples
    missing = sorted(set(fed_round.assignments) - set(updates) - dropped)
    return RoundRecord(
        round=fed_round.index, round_id=fed_round.round_id, algorithm=algorithm, status=status,
        **figures, train_loss=train_loss if used else None,
        round_time_s=duration, elapsed_s=elapsed,
        selected=sorted(fed_round.assignments), aggregated=list(used), dropped=sorted(dropped | set(missing)),
        split_points={d: a.split_point for d, a in sorted(fed_round.assignments.items())},
        device_times={d: u.request.timings for d, u in sorted(updates.items())},
        upload_times={d: u.upload_s for d, u in sorted(updates.items())},
        table_times={d: u.round_time for d, u in sorted(updates.items())},
        table_parts={d: fed_round.table_parts(d) for d in sorted(updates)},
        device_kinds={d: device_kinds.get(d, "unknown") for d in sorted(fed_round.assignments)},
        groups=[GroupRecord(group_id=p.upload.group_id, members=p.upload.members, dropped=p.upload.dropped,
                            label_distance=p.upload.label_distance, start_block=p.upload.start_block,
                            train_time_s=p.upload.train_time_s) for _, p in sorted(fed_round.portions.items())],
        bytes_up=up, bytes_down=down, bytes_server=server, bytes_total=up + down + server,
        cumulative_bytes=cumulative_bytes + up + down + server, plan_error=fed_round.plan_failed,
        aggregation_s=aggregation_s, algorithm_metrics=dict(algorithm_metrics), lost_replicas=list(fed_round.lost_replicas),
        left=fed_round.left(used),
        evaluated_devices=evaluated_devices, evaluated_samples=evaluated_samples,
        privacy=PrivacyRecord.model_validate(privacy) if privacy is not None else None,
        sample_privacy=SamplePrivacyRecord.model_validate(sample_privacy) if sample_privacy is not None else None,
        secure_clamped=secure_clamped,
    )


def round_bytes(fed_round: FedRound) -> tuple[int, int, int]:
    """(device uploads, device downloads, Fed <-> Main Server) body bytes of one round attempt."""
    updates = fed_round.updates.values()
    up = sum(u.request.bytes_up + u.body_bytes for u in updates)
    down = sum(u.request.bytes_down for u in updates) + fed_round.task_bytes
    server = fed_round.plan_bytes + sum(p.body_bytes for p in fed_round.portions.values())
    return up, down, server


def run_summary(history: Sequence[RoundRecord], base: Mapping[str, Any], initial: Mapping[str, float | None],
                rounds_done: int, cumulative_bytes: int, finished: bool, stop_reason: str | None) -> dict[str, Any]:
    """``summary.json``: what the run achieved. Accuracy figures come from completed rounds only;
    ``initial`` is the initial model's :func:`figure_fields`, whose ``test_mse`` marks a regression
    run (its summary adds the MSE and MAE figures, docs/metrics.md)."""
    ok = [r for r in history if r.status == "ok"]
    accs = [r.test_accuracy for r in ok if r.test_accuracy is not None]
    times = [r.round_time_s for r in ok]
    regression = {}
    if "test_mse" in initial:
        mses = [r.test_mse for r in ok if r.test_mse is not None]
        regression = {"initial_mse": initial["test_mse"], "final_mse": mses[-1] if mses else None,
                      "best_mse": min(mses) if mses else None, "final_mae": ok[-1].test_mae if ok else None}
    return {
        **base,
        "rounds": rounds_done,
        "failed_attempts": len(history) - len(ok),
        "initial_accuracy": initial["test_accuracy"],
        "final_accuracy": accs[-1] if accs else None,
        "best_accuracy": max(accs) if accs else None,
        "final_loss": ok[-1].test_loss if ok else None,
        "median_round_time_s": statistics.median(times) if times else None,
        "total_time_s": history[-1].elapsed_s if history else 0.0,
        "total_bytes": cumulative_bytes,
        "finished": finished,
        "stop_reason": stop_reason,
        # A run that evaluated on data it also trained on (FNR-FL's paper-reproduction option)
        # says so in its summary, not only in its round records.
        "leaky": any(r.algorithm_metrics.get("leaky") for r in history),
        "dropped_every_round": dropped_every_round(history),
        **regression,
    }


def dropped_every_round(history: Sequence[RoundRecord]) -> dict[str, str]:
    """Each device that was selected and never aggregated in any attempt -> why it was left out
    the last time (its ``left`` reason): a device that fails every task (a batch its model cannot
    train on, data it cannot read) must not hide behind a run that reports success."""
    aggregated = {d for r in history for d in r.aggregated}
    last: dict[str, str] = {}
    for record in history:
        for device in record.selected:
            if device not in aggregated:
                last[device] = record.left.get(device, "not aggregated")
    return dict(sorted(last.items()))
