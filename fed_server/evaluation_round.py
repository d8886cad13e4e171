"""The federated evaluation phase of one round: after aggregating, the Fed Server asks the round's
aggregated devices to evaluate the new global model on their held-out parts and waits for their
reports until all arrived or ``deadlines.evaluate_s`` passed.

Bookkeeping and checks only; the coordinator opens and closes the phase, the round driver waits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.errors import Conflict, Invalid, NotAllowed
from shared.round_label import round_label
from shared.evaluation import FederatedResult, combine_reports
from shared.losses import Task
from shared.schemas import EvaluationReport


@dataclass
class EvaluationRound:
    """Who was asked to evaluate round ``round_id``'s global model, and what came back.

    ``asked``: each asked device's held-out size as the Fed Server knows it from the device's
    registration (``DeviceEnrolment.held_out_limit``): a report may not claim more samples, so a
    device cannot outweigh the others with samples it does not hold.
    """

    round_id: int
    index: int                   # the logical round (shared/round_label.py)
    asked: dict[str, int]        # device id -> the most held-out samples it may report
    deadline_s: float
    started_at: float = field(default_factory=time.monotonic)
    dispatched: set[str] = field(default_factory=set)
    reports: dict[str, EvaluationReport] = field(default_factory=dict)
    # Asked devices whose report was refused, with why: the phase does not wait for them.
    refused: dict[str, str] = field(default_factory=dict)
    task_bytes: int = 0          # evaluation task bodies sent (counted in the round's bytes_down)
    closed: bool = False
    task: Task = "classification"   # the run's (train.task): which figures the reports make

    def accept(self, report: EvaluationReport) -> None:
        """Store one device's report, after every check. A report claiming more samples than the
        device holds out is refused and ends that device's part in the phase (:attr:`refused`);
        any other refusal changes nothing."""
        if self.closed:
            raise Conflict(f"evaluation of {round_label(self.index, self.round_id)} is closed")
        if report.device_id not in self.asked:
            raise NotAllowed(f"device {report.device_id!r} was not asked to evaluate "
                             f"{round_label(self.index, self.round_id)}")
        if report.device_id in self.reports:
            raise Conflict(f"round {self.round_id} already has the evaluation of {report.device_id!r}")
        if report.device_id in self.refused:
            raise Conflict(f"the evaluation of {report.device_id!r} for round {self.round_id} was refused: "
                           f"{self.refused[report.device_id]}")
        if report.num_samples > self.asked[report.device_id]:
            reason = (f"{report.num_samples} evaluated samples exceed the {self.asked[report.device_id]} "
                      f"samples {report.device_id!r} holds out")
            # Its one report is unusable: waiting for another would hold the phase to its deadline.
            self.refused[report.device_id] = reason
            raise Invalid(reason)
        self.reports[report.device_id] = report

    def leave(self, device_id: str, reason: str) -> None:
        """``device_id`` can no longer be counted (its credential was revoked): its report, if one
        came, is dropped, and the phase does not wait for one."""
        if device_id in self.asked:
            self.reports.pop(device_id, None)
            self.refused[device_id] = reason

    def complete(self) -> bool:
        """Every asked device reported, or had its report refused."""
        return len(self.reports) + len(self.refused) == len(self.asked)

    def deadline(self) -> float:
        """The monotonic time at which the phase closes with the reports that arrived."""
        return self.started_at + self.deadline_s

    def result(self) -> FederatedResult:
        """The sample-weighted mean over the reports (None figures when none evaluated anything)."""
        return combine_reports(self.reports.values(), self.task)
