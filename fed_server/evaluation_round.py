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

    ``train_samples``: each asked device's registered (training-part) sample count, which bounds
    the held-out size it may claim: the split holds out ``floor(n * holdout)`` of ``n`` samples,
    so ``held_out <= train * holdout / (1 - holdout)``. A device cannot outweigh the others by
    claiming more samples than it can hold.
    """

    round_id: int
    asked: dict[str, int]        # device id -> its training-part sample count
    holdout: float
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
        limit = self.asked[report.device_id] * self.holdout / (1 - self.holdout)
        if report.num_samples > limit + 1e-6:
            raise Invalid(f"{report.num_samples} evaluated samples exceed what a device training on "
                          f"{self.asked[report.device_id]} holds out (holdout {self.holdout})")
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
