"""Federated evaluation phases (``evaluation.mode: federated``): after an aggregated round, its
aggregated devices evaluate the new global model on their held-out parts and report; what one
phase holds and checks is ``fed_server/evaluation_round.py``."""
from __future__ import annotations

import logging
from collections.abc import Callable

from fed_server.aggregation import Aggregation
from fed_server.evaluation_round import EvaluationRound
from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from fed_server.task_dispatch import TaskDispatch
from shared.errors import Conflict, Invalid
from shared.round_label import round_label
from shared.schemas import Ack, EvaluationReport

log = logging.getLogger("fed_server")


class FederatedEvaluation:
    """Opens, takes the reports of, and closes each round's evaluation phase.

    ``held_out_limit``: the most held-out samples a device may report over
    (``DeviceEnrolment.held_out_limit``)."""

    def __init__(self, core: RunCore, dispatch: TaskDispatch, held_out_limit: Callable[[str], int]) -> None:
        self.core = core
        self.dispatch = dispatch
        self.held_out_limit = held_out_limit

    def begin(self, fed_round: FedRound, aggregation: Aggregation) -> EvaluationRound | None:
        """Ask an aggregated round's aggregated devices to evaluate the new global model (their next
        poll answers ``status="evaluate"``). None when the round is not evaluated this way (server
        evaluation, or a failed round, which changed no model). Called on the event loop."""
        core = self.core
        if core.evaluation_mode != "federated" or not aggregation.ok:
            return None
        self.dispatch.release_evaluation_weights()
        core.evaluating = EvaluationRound(
            round_id=fed_round.round_id, index=fed_round.index, asked={d: self.held_out_limit(d) for d in aggregation.used},
            deadline_s=core.config.deadlines.evaluate_s, task=core.loss.task)
        log.info("%s: asking %d devices to evaluate the new global model",
                 round_label(fed_round.index, fed_round.round_id), len(aggregation.used))
        core.post_work()
        return core.evaluating

    def accept(self, report: EvaluationReport) -> Ack:
        """A device's evaluation of the open phase's global model; checked before it is stored."""
        core = self.core
        core.devices.get(report.device_id)
        evaluation = core.evaluating
        if evaluation is None or evaluation.round_id != report.round_id:
            current = evaluation.round_id if evaluation else None
            raise Conflict(f"round {report.round_id} is not being evaluated (evaluating: {current})")
        try:
            evaluation.accept(report)
        except Invalid:
            core.changed.set()   # a refused report may complete the phase (EvaluationRound.refused)
            raise
        core.changed.set()
        return Ack(detail=f"evaluation of {report.device_id} for round {report.round_id} stored")

    def close(self) -> EvaluationRound | None:
        """End the open evaluation phase (all reported, or its deadline passed): later reports are
        stale. Called on the event loop, so no report lands between this and the record."""
        core = self.core
        evaluation, core.evaluating = core.evaluating, None
        self.dispatch.release_evaluation_weights()
        if evaluation is not None:
            evaluation.closed = True
        return evaluation
