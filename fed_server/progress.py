"""How far the run has come: the attempt and round counters, each attempt's conclusion and record
(with the server's evaluation of the new model), the checkpoint it is written with, the resume
from that checkpoint after a restart, and the run's summary.

What a checkpoint holds and when a restart may resume from it: ``fed_server/checkpoint.py``; the
order the files are written in: ``fed_server/recorder.py``.
"""
from __future__ import annotations

import copy
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fed_server.aggregation import Aggregation
from fed_server.checkpoint import RunProgress
from fed_server.evaluation_round import EvaluationRound
from fed_server.fed_round import FedRound
from fed_server.recorder import Recorder
from fed_server.records import RoundRecord, figure_fields, round_record, run_summary
from fed_server.run_core import RunCore
from fed_server.time_table import ClientTimeTable
from fed_server.tracking import Tracking
from shared.data import ArrayDataset
from shared.evaluation import Figures, combine_reports, evaluate

log = logging.getLogger("fed_server")


@dataclass
class Conclusion:
    """A round attempt whose outcome is fixed, waiting for its record (:meth:`Progress.conclude`).

    Everything the record and the checkpoint need is taken here, when the attempt's model is final,
    so that the next attempt may begin (select, draw from the rng, change algorithm state) while
    the server's evaluation of this one runs beside it (:meth:`Progress.record`)."""

    # Not the FedRound: it holds the round's uploads, which must not live on beside the next
    # round's (the record below already took what it needs from them).
    record: RoundRecord          # complete but for the new model's evaluation (an aggregated attempt)
    progress: RunProgress        # the checkpoint's progress as of the conclusion, whether the run ends with it

    @property
    def finished(self) -> bool:
        return self.progress.finished


class Progress:
    """The run's counters, records and checkpoints. ``test_set``: the server's (None: federated
    evaluation, where nothing evaluates the initial model, so there is no round-0 accuracy)."""

    def __init__(self, core: RunCore, recorder: Recorder, rng: random.Random, table: ClientTimeTable,
                 test_set: ArrayDataset | None) -> None:
        self.core = core
        self.recorder = recorder
        # TensorBoard, MLflow...: started by the coordinator once the run id is known (resumed or new).
        self.tracking = Tracking(core.config.tracking, recorder.run_dir.path)
        self.rng = rng
        self.table = table
        self.test_set = test_set
        self.rounds_done = 0          # completed logical rounds (aggregated; recorded or about to be)
        self.rounds_recorded = 0      # of those, the ones whose record and checkpoint are written
        self._unrecorded: Conclusion | None = None   # a concluded attempt whose record is not written yet
        self.attempts = 0             # round attempts started; each one's wire round_id
        self.failed_in_a_row = 0
        self.history: list[RoundRecord] = []
        self.stop_reason: str | None = None
        self.elapsed_before = 0.0     # run time before a restart
        self.resumed_after: tuple[int, int] | None = None   # (rounds done, last attempt id) at the resume
        self.cumulative_bytes = 0
        self.initial = figure_fields(self.evaluate() if test_set is not None else None, core.loss.task)

    def next_attempt(self) -> int:
        """Reserve the next attempt's id (never reused, even across a restart) and return it."""
        if self.core.started_at is None:
            self.core.started_at = time.monotonic()
        self.attempts = self.recorder.reserve_attempt(self.attempts + 1)
        return self.attempts

    def count(self, fed_round: FedRound, aggregation: Aggregation) -> None:
        """An aggregated attempt completes its logical round; a failed one counts toward
        ``deadlines.max_failed_attempts``."""
        if aggregation.ok:
            self.rounds_done = fed_round.index
            self.failed_in_a_row = 0
        else:
            self.failed_in_a_row += 1
            why = aggregation.failure or (f"{len(aggregation.used)} of "
                                          f"{self.core.config.deadlines.min_participants} required participants")
            log.warning("round %d (attempt %d) failed: %s; retrying", fed_round.index, fed_round.round_id, why)

    def conclude(self, fed_round: FedRound, aggregation: Aggregation,
                 evaluation: EvaluationRound | None = None) -> Conclusion:
        """Fix what an aggregated (or failed) attempt leaves: its record but for the server's
        evaluation, the checkpoint's progress, whether the run ends with it. Called on the event
        loop, before the next attempt begins; the previous conclusion must be recorded first (the
        records and checkpoints are written in order)."""
        if self._unrecorded is not None:
            raise RuntimeError(f"attempt {self._unrecorded.record.round_id} is concluded but not recorded yet")
        core, config, ok = self.core, self.core.config, aggregation.ok
        if evaluation is not None:   # the evaluation tasks went down to the devices in this round
            fed_round.task_bytes += evaluation.task_bytes
        figures, evaluated = self._figures(ok, evaluation)
        sample_privacy = core.sample_privacy   # it counted the attempt's tasks as it began
        record = round_record(
            fed_round, config.algorithm, aggregation.used, aggregation.dropped, "ok" if ok else "failed", figures,
            time.monotonic() - fed_round.started_at, self.elapsed(), self.cumulative_bytes,
            core.devices.kinds(fed_round.assignments), aggregation.aggregation_s,
            {**core.selector.metrics(), **core.algorithm.round_metrics(fed_round.context, aggregation.extras)} if ok else {},
            evaluated_devices=evaluated[0], evaluated_samples=evaluated[1], privacy=aggregation.privacy,
            sample_privacy=sample_privacy.record() if sample_privacy is not None else None,
            secure_clamped=aggregation.secure_clamped)
        self.cumulative_bytes = record.cumulative_bytes
        self.note_deadlines(fed_round, aggregation.used)
        finished, stop_reason = False, None
        budget = core.privacy.exhausted() if core.privacy is not None else None
        if self.rounds_done >= config.rounds:
            finished, stop_reason = True, "completed"
        elif self.failed_in_a_row >= config.deadlines.max_failed_attempts:
            finished, stop_reason = True, f"{self.failed_in_a_row} failed attempts in a row"
        elif budget is not None:
            finished, stop_reason = True, budget
            log.warning("round %d (attempt %d): the run stops: %s", fed_round.index, fed_round.round_id, budget)
        progress = copy.deepcopy(self._snapshot(finished, stop_reason))
        progress.history_len += 1   # the record this checkpoint will cover
        self._unrecorded = Conclusion(record, progress)
        return self._unrecorded

    def _figures(self, ok: bool, evaluation: EvaluationRound | None
                 ) -> tuple[dict[str, float | None], tuple[int | None, int | None]]:
        """The record's figures (:func:`figure_fields`) and (federated) the devices and samples
        evaluated, as far as known at the conclusion: a failed attempt's model did not change, so
        its last evaluation stands; the server's evaluation of a new model comes with the record."""
        federated = self.core.evaluation_mode == "federated"
        if not ok:
            last = self.history[-1] if self.history else None
            if last is None:
                return dict(self.initial), ((0, 0) if federated else (None, None))
            evaluated = (last.evaluated_devices or 0, last.evaluated_samples or 0) if federated else (None, None)
            return {key: getattr(last, key) for key in self.initial}, evaluated
        if federated:
            # No report at all (or no phase): the round still counts, with no figures.
            result = evaluation.result() if evaluation is not None else combine_reports([], self.core.loss.task)
            return figure_fields(result.figures, self.core.loss.task), (result.devices, result.samples)
        return figure_fields(None, self.core.loss.task), (None, None)

    def evaluate(self) -> Figures:
        """The server's evaluation of the global model on its test set, with the run's loss."""
        assert self.test_set is not None
        return evaluate(self.core.model, self.test_set, self.core.loss, device=self.core.torch_device)

    def note_deadlines(self, fed_round: FedRound, used: Sequence[str]) -> None:
        """Clear the record of every device that uploaded; make those the attempt waited a
        deadline for sit out (:mod:`fed_server.missed_deadlines`), a device that registered again
        after taking its task included: the record is the device's, whatever its enrolment. In a
        secure attempt, so do those that held its unmasking up (``SecureRound.held_up``): a survivor
        that never answered it, one whose answer was false, an owner whose shares rebuilt no secret."""
        missed = self.core.missed
        late = fed_round.missed_deadline(used)
        held = fed_round.secure.held_up() - late if fed_round.secure is not None else set()
        # An uploader that held the unmasking up keeps its record: each time in a row it sits out longer.
        missed.answered(set(fed_round.updates) - held)
        for device, skip in missed.missed(late | held, fed_round.round_id).items():
            why = "held secure aggregation's unmasking up" if device in held else "missed a deadline"
            log.warning("round %d (attempt %d): %s %s; it sits out the next %d attempt%s", fed_round.index,
                        fed_round.round_id, device, why, skip, "" if skip == 1 else "s")

    def record(self, conclusion: Conclusion) -> RoundRecord:
        """Evaluate the concluded attempt's new model (on the server's test set with server
        evaluation, and the algorithm's own figures), then write its record and the checkpoint
        counting it (``fed_server/recorder.py``).

        CPU work: run off the event loop. It may run while the next attempt trains: the global
        model does not change until that attempt is aggregated, and the driver awaits this first."""
        if conclusion is not self._unrecorded:
            raise RuntimeError(f"attempt {conclusion.record.round_id} is not the one concluded last")
        core = self.core
        record, progress = conclusion.record, conclusion.progress
        if record.status == "ok":   # the model changed: evaluate it
            update: dict = {"algorithm_metrics": {**record.algorithm_metrics, **core.algorithm.evaluate(core.model)}}
            if core.evaluation_mode == "server":
                assert self.test_set is not None
                started = time.perf_counter()
                update.update(figure_fields(self.evaluate(), core.loss.task))
                update["evaluation_s"] = time.perf_counter() - started
            record = RoundRecord.model_validate({**record.model_dump(), **update})   # validated like any record
        self.history.append(record)
        summary = self._summary(progress.finished, progress.stop_reason) if progress.finished else None
        self.recorder.persist(record, core.model.state_dict(), progress, summary)
        self.tracking.log_round(record)   # queued: a slow or broken backend never holds the run
        if summary is not None:
            self.tracking.finish(summary)
        self._unrecorded = None
        self.rounds_recorded = progress.rounds_done
        # Only now, with the checkpoint and summary on disk, may /v1/status say "finished": a
        # testbed that stops the services on that answer must not kill the server mid-write.
        core.finished, self.stop_reason = progress.finished, progress.stop_reason
        return record

    def elapsed(self) -> float:
        """Run time so far, across restarts."""
        started_at = self.core.started_at
        return self.elapsed_before + (time.monotonic() - started_at if started_at is not None else 0.0)

    def _snapshot(self, finished: bool, stop_reason: str | None) -> RunProgress:
        """What the checkpoint holds besides the model (``fed_server/checkpoint.py``)."""
        core = self.core
        return RunProgress(
            run_id=core.run_id, rounds_done=self.rounds_done, attempts=self.attempts,
            failed_in_a_row=self.failed_in_a_row, history_len=len(self.history),
            cumulative_bytes=self.cumulative_bytes, elapsed_s=self.elapsed(), rng_state=self.rng.getstate(),
            algorithm_state=core.algorithm.state_dict(), selector_state=core.selector.state_dict(),
            time_table=self.table.state_dict(), missed_deadlines=core.missed.state_dict(),
            device_pace=core.pace.state_dict(), finished=finished, stop_reason=stop_reason,
            privacy=core.privacy.state_dict() if core.privacy is not None else {},
            sample_privacy=core.sample_privacy.state_dict() if core.sample_privacy is not None else {})

    def resume(self) -> bool:
        """Continue from the run directory's checkpoint, if there is one. Returns whether it did.

        Restores the global model, the round counters, the client time table, the algorithm's
        per-device state and the selection RNG, and the records the checkpoint covers, so the
        resumed run neither loses nor repeats a round. The attempt counter continues from the
        last id ever reserved, never reusing one (``fed_server/recorder.py``). ValueError for a
        checkpoint of a different configuration (``fed_server/checkpoint.py``).
        """
        core = self.core
        loaded = self.recorder.resume(core.config)
        if loaded is None:
            # No checkpoint yet, but attempts may have been handed out (the server stopped during
            # its first attempt): their ids are never used again, so a device's stale upload for
            # one of them cannot land in a new attempt.
            self.attempts = self.recorder.last_attempt()
            return False
        state, progress, self.history = loaded
        core.model.load_state_dict(state)
        core.run_id = progress.run_id
        self.rounds_done = self.rounds_recorded = progress.rounds_done
        self.attempts = progress.attempts
        self.failed_in_a_row = progress.failed_in_a_row
        self.cumulative_bytes = progress.cumulative_bytes
        self.elapsed_before = progress.elapsed_s
        self.rng.setstate(progress.rng_state)
        core.algorithm.load_state_dict(progress.algorithm_state)
        core.selector.load_state_dict(progress.selector_state)
        self.table.load_state_dict(progress.time_table)
        core.missed.load_state_dict(progress.missed_deadlines)
        core.pace.load_state_dict(progress.device_pace)
        if core.privacy is not None:
            core.privacy.load_state_dict(progress.privacy)
        if core.sample_privacy is not None:
            core.sample_privacy.load_state_dict(progress.sample_privacy)
        core.finished = progress.finished
        self.stop_reason = progress.stop_reason
        self.resumed_after = (self.rounds_done, self.attempts)
        log.info("resumed run %s after round %d (attempt %d)", core.run_id, self.rounds_done, self.attempts)
        return True

    def summary(self) -> dict:
        """What the run achieved, for ``summary.json`` and the testbed's final line."""
        return self._summary(self.core.finished, self.stop_reason)

    def _summary(self, finished: bool, stop_reason: str | None) -> dict:
        config, privacy = self.core.config, self.core.privacy
        base: dict[str, Any] = {"run_id": self.core.run_id, "algorithm": config.algorithm, "model": config.model}
        if privacy is not None and privacy.ledger is not None:
            # What the released models cost, as of the last record (docs/privacy.md says what it covers).
            base.update(epsilon=privacy.epsilon(), delta=privacy.ledger.delta,
                        noise_multiplier=privacy.noise_multiplier)
        if self.core.sample_privacy is not None:
            # DP-SGD: the worst device's sample-level epsilon over every task handed out.
            worst = self.core.sample_privacy.record()
            base.update(sample_epsilon=worst["epsilon"], sample_epsilon_device=worst["device"],
                        sample_delta=worst["delta"])
        return run_summary(self.history, base, self.initial, self.rounds_done,
                           self.cumulative_bytes, finished, stop_reason)
