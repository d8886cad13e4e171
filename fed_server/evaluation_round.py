"""The federated evaluation phase of one round: after aggregating, the Fed Server asks the round's
aggregated devices to evaluate the new global model on their held-out parts and waits for their
reports until all arrived or ``deadlines.evaluate_s`` passed.

Bookkeeping and checks only; the coordinator opens and closes the phase, the round driver waits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.errors import Conflict, Invalid, NotAllowed
from shared.evaluation import FederatedResult, combine_reports
from shared.schemas import EvaluationReport


@dataclass
class EvaluationRound:
    """Who was asked to evaluate round ``round_id``'s global model, and what came back.

    ``asked``: each asked device's held-out size as the Fed Server knows it from the device's
    registration (``Coordinator.held_out_limit``): a report may not claim more samples, so a
    device cannot outweigh the others with samples it does not hold.
    """

    round_id: int
    asked: dict[str, int]        # device id -> the most held-out samples it may report
    deadline_s: float
    started_at: float = field(default_factory=time.monotonic)
    dispatched: set[str] = field(default_factory=set)
    reports: dict[str, EvaluationReport] = field(default_factory=dict)
    task_bytes: int = 0          # evaluation task bodies sent (counted in the round's bytes_down)
    closed: bool = False

    def accept(self, report: EvaluationReport) -> None:
        """Store one device's report, after every check (a refused report changes nothing)."""
        if self.closed:
            raise Conflict(f"evaluation of round {self.round_id} is closed")
        if report.device_id not in self.asked:
            raise NotAllowed(f"device {report.device_id!r} was not asked to evaluate round {self.round_id}")
        if report.device_id in self.reports:
            raise Conflict(f"round {self.round_id} already has the evaluation of {report.device_id!r}")
        if report.num_samples > self.asked[report.device_id]:
            raise Invalid(f"{report.num_samples} evaluated samples exceed the {self.asked[report.device_id]} "
                          f"samples {report.device_id!r} holds out")
        self.reports[report.device_id] = report

    def complete(self) -> bool:
        """Every asked device reported."""
        return len(self.reports) == len(self.asked)

    def deadline(self) -> float:
        """The monotonic time at which the phase closes with the reports that arrived."""
        return self.started_at + self.deadline_s

    def result(self) -> FederatedResult:
        """The sample-weighted mean over the reports (None figures when none evaluated anything)."""
        return combine_reports(self.reports.values())
