"""The Fed Server's run: :class:`Coordinator` builds the run's parts and runs its attempts (opens
one with its devices and split points, closes it, aggregates and counts it) and answers the run's
status. It passes no call on: the routes (``app.py``), the round driver (``driver.py``) and the
metrics (``metrics.py``) call the part whose job a call is, by its name (``coordinator.uploads
.accept_update``, ``coordinator.enrolment.register``, ``coordinator.progress.record``). Plain
objects, no HTTP; the driver decides *when* (deadlines, Main Server calls); what an algorithm
decides (selection, split mode, grouping, aggregation) is asked of the algorithm object.

The parts, each in its own module:

- ``run_core.py``: the state they share (model, algorithm, registry, open attempt, events)
- ``enrolment.py``: run info, registration and device tokens, when rounds may start
- ``task_dispatch.py``: what a polling device is told, the weights its task names
- ``agent_sessions.py``: one held task request per agent, for all its idle devices
- ``replica_planning.py``: the Main Server replicas: round plans, groups per replica, replicas down
- ``uploads.py``: reports and follow-ups, updates, withdrawals, group portions, and their checks
- ``federated_evaluation.py``: the devices' evaluation of each new global model
- ``aggregation.py``: the aggregation and the client time table
- ``progress.py``: counters, conclusions and records, checkpoint and resume, the summary
"""
from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Sequence

import torch

from fed_server.agent_sessions import AgentSessions
from fed_server.aggregation import Aggregation, Aggregator
from fed_server.devices import DeviceRegistry
from fed_server.enrolment import DeviceEnrolment
from fed_server.federated_evaluation import FederatedEvaluation
from fed_server.fed_round import Assignment, FedRound
from fed_server.device_pace import DevicePace
from fed_server.missed_deadlines import MissedDeadlines
from fed_server.privacy import RunPrivacy
from fed_server.sample_privacy import SampleLedger
from fed_server.secure_batches import SecureBatches
from fed_server.secure_stages import SecureStages, secure_round
from fed_server.progress import Progress
from fed_server.recorder import Recorder
from fed_server.records import RunStatus, finite_json
from fed_server.replica_planning import ReplicaPlanning
from fed_server.run_core import RunCore
from fed_server.run_dir import RunDirectory
from fed_server.split_planner import SplitPlanner
from fed_server.task_dispatch import TaskDispatch
from fed_server.time_table import ClientTimeTable
from fed_server.update_checks import shard_sizes
from fed_server.uploads import Uploads
from fed_server.broadcast import Broadcast
from shared.algorithms.base import RoundContext
from shared.algorithms.registry import build_algorithm, build_selector
from shared.config import RunConfig
from shared.recording import Recording
from shared.data.partition import release_loaded_data
from shared.evaluation import evaluation_mode, server_test_set
from shared.losses import build_loss
from shared.models import model_fingerprint, profile_model
from shared.run_config import build_config_model, run_warnings, split_candidates

log = logging.getLogger("fed_server")


class Coordinator:
    """Builds the run's parts (attributes named for their job) and runs its attempts.

    ``torch_device`` (``--torch-device``) is where the global model is evaluated; the model itself
    stays on the CPU, where uploads arrive from the wire and are aggregated (a round's
    aggregation is a weighted sum, cheap next to moving every upload to a GPU and back).

    main_server_urls: the Main Server replicas (replica_planning.py);
    main_server_device_urls: where the devices reach them, when not at those URLs.
    recording: what the run keeps of what it receives (--record-received; None: nothing).
    """

    def __init__(self, config: RunConfig, run_dir: RunDirectory, main_server_urls: Sequence[str] | None,
                 run_id: str | None = None, torch_device: torch.device | None = None,
                 main_server_device_urls: Sequence[str] | None = None,
                 recording: Recording | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.core = _build_core(config, run_id, torch_device, run_dir)
        core = self.core
        core.recording = recording
        num_classes, input_shape = core.model.num_classes, core.model.input_shape
        profile = profile_model(core.model, config.model)
        candidates = split_candidates(config, core.model)
        # A model without split points runs only split-depth-zero algorithms (validate_run_config),
        # which never consult the table: one placeholder candidate keeps it well-formed.
        self.table = ClientTimeTable(max(1, len(candidates)), config.split.smoothing, config.split.warm_up,
                                     config.split.bottleneck_cap, config.split.undominated)
        self.planner = SplitPlanner(core.algorithm.split_mode(), candidates, core.num_blocks, profile, self.table,
                                    core.devices, config.train.local_epochs, config.split.server_flops,
                                    config.split.pinned, head_start=core.head_start if config.split.u_shaped else None)
        self.replicas = ReplicaPlanning(core, main_server_urls, input_shape, num_classes, self.planner,
                                        main_server_device_urls)
        self.rng = random.Random(config.seed)
        # Federated evaluation does not use a server test set even where one exists.
        test_set = server_test_set(config.data, core.loss.task) if core.evaluation_mode == "server" else None
        self.progress = Progress(core, Recorder(run_dir), self.rng, self.table, test_set)
        self.resumed = self.progress.resume()
        run_dir.write_config(config, core.run_id)
        if core.finished:  # a finished run killed before its summary was written gets it now
            self.progress.recorder.write_summary(self.progress.summary())
        else:
            self.progress.tracking.start(core.run_id, config.model_dump(mode="json"))
        fingerprint = model_fingerprint(core.model, config.data, config.train.loss, config.train.resolved_task)
        self.enrolment = DeviceEnrolment(
            core, fingerprint, input_shape, num_classes, shard_sizes(config.data),
            label_counts_at_registration=self.replicas.groups_at_fed_server and self.planner.mode != "zero"
            and config.split_privacy.label_counts != "withheld")
        self.dispatch = TaskDispatch(core, self.replicas.device_url)
        self.agents = AgentSessions(core, self.dispatch, self.enrolment)
        self.uploads = Uploads(core, self.replicas)
        self.secure = SecureStages(core)
        self.secure_batches = SecureBatches(self.secure, self.enrolment)
        self.evaluation = FederatedEvaluation(core, self.dispatch, self.enrolment.held_out_limit)
        self.aggregator = Aggregator(core, self.table, self.planner)
        # The training set served the shard sizes and the fingerprint's shard vectors, computed
        # above; only the test set (held by ``progress``) is needed from here on, and a
        # population's training set grows with the population (benchmark (h), memory per device:
        # benchmarks/README.md, "(h) Large populations").
        release_loaded_data()
        # Posted whenever a round record was written (the run's "finished" comes with its last
        # record) or the round driver stopped: ``/v1/status?wait_s=`` holds its answer on it.
        self.status_posted = Broadcast()

    # --- round lifecycle ----------------------------------------------------------------------
    def begin_round(self) -> FedRound:
        """Select devices and split points for the next round."""
        core, config = self.core, self.config
        attempt = self.progress.next_attempt()
        index = self.progress.rounds_done + 1
        # A device a lost Main Server replica may still hold cannot take a task (replica_planning.py).
        pool = self._selectable(self.replicas.free(core.algorithm.eligible(core.devices.ids())), index, attempt)
        count = min(config.per_round, len(pool))
        kept = core.privacy.devices_for(len(pool), config.per_round, config.data.num_devices) if core.privacy else count
        if kept < count:
            log.info("round %d (attempt %d): %d of the %d selectable devices, keeping the sampling rate at %d of %d "
                     "(privacy)", index, attempt, kept, len(pool), config.per_round, config.data.num_devices)
            count = kept
        selected = core.selector.select(RoundContext(index=index, attempt=attempt), pool, count, self.rng)
        splits = self.planner.choose(index, selected)
        downloads = self.planner.download_seconds({d: j for d, (j, _) in splits.items()})
        core.round = FedRound(
            round_id=attempt, index=index, split_mode=self.planner.mode,
            assignments={d: Assignment(d, k, j, core.devices.token_nonce(d), download_s=downloads[d])
                         for d, (j, k) in splits.items()},
            deadline_s=config.deadlines.round_s,
            report_deadline_s=config.deadlines.report_s or config.deadlines.round_s / 2,
            sample_rate=len(selected) / len(pool) if pool else 0.0,
            secure=secure_round(core, list(splits)) if config.secure_aggregation.enabled else None,
        )
        if core.sample_privacy is not None:   # every task the attempt hands out, before it goes out
            core.sample_privacy.count({d: core.devices.weight(d) for d in core.round.assignments})
        log.info("round %d (attempt %d): %d devices, splits %s", index, attempt, len(selected),
                 {d: a.split_point for d, a in core.round.assignments.items()})
        core.record_state(core.round, "global", core.model.state_dict())   # what the round's tasks start from
        return core.round

    def _selectable(self, eligible: list[str], index: int, attempt: int) -> list[str]:
        """``eligible`` less the devices sitting out after a missed deadline
        (:mod:`fed_server.missed_deadlines`), unless that would leave fewer than the quorum."""
        skipped = self.core.missed.skipped(attempt)
        pool = [d for d in eligible if d not in skipped]
        if skipped & set(eligible) and len(pool) >= self.config.deadlines.min_participants:
            log.info("round %d (attempt %d): %s sit out after missing a deadline", index, attempt,
                     sorted(skipped & set(eligible)))
            return pool
        return eligible

    def close_round(self) -> FedRound:
        """Stop accepting uploads for the open round (called on the event loop)."""
        if self.core.round is None:
            raise RuntimeError("no open round")
        fed_round, self.core.round = self.core.round, None
        fed_round.closed_at = time.monotonic()
        self.dispatch.release_task_weights()   # the model is about to change
        self.agents.attempt_over(set(fed_round.assignments) - set(fed_round.updates), fed_round.round_id)
        return fed_round

    def aggregate_round(self, fed_round: FedRound) -> Aggregation:
        """Aggregate a closed attempt (:meth:`Aggregator.aggregate`) and count it; nothing is
        written to disk here: a restart before its record re-runs the round. CPU work: run off
        the event loop."""
        aggregation = self.aggregator.aggregate(fed_round)
        self.progress.count(fed_round, aggregation)
        return aggregation

    def status(self, since: int, driver_error: str | None) -> RunStatus:
        """The run's progress for ``GET /v1/status``: state, counts, and the records of the logical
        rounds after ``since``; ``driver_error``: why the round driver stopped, if it failed."""
        core, progress, config = self.core, self.progress, self.config
        state = "finished" if core.finished else ("running" if self.enrolment.ready() else "waiting_for_devices")
        return RunStatus(
            run_id=core.run_id, algorithm=config.algorithm, state=state, rounds_total=config.rounds,
            rounds_done=progress.rounds_recorded, registered=len(core.devices), expected_devices=config.data.num_devices,
            open_round=core.round.round_id if core.round else None, initial=progress.initial,
            records=len(progress.history), history=[r for r in progress.history if r.round > since],
            summary=finite_json(progress.summary()) if core.finished else None, driver_error=driver_error,
            resumed_after_round=progress.resumed_after[0] if progress.resumed_after else None,
            resumed_after_attempt=progress.resumed_after[1] if progress.resumed_after else None,
        )


def _build_core(config: RunConfig, run_id: str | None, torch_device: torch.device | None,
                run_dir: RunDirectory) -> RunCore:
    """The run's shared state as a new run starts it (a resume overwrites what its checkpoint holds)."""
    algorithm = build_algorithm(config)
    model = build_config_model(config, layout=False)
    algorithm.bind_model(model)
    loss = build_loss(config.train.loss, config.train.task)
    for warning in run_warnings(config, model):
        log.warning(warning)
    return RunCore(
        config=config, run_id=run_id or uuid.uuid4().hex[:12], model=model, algorithm=algorithm,
        # The selection policy is composed here, beside the algorithm: every algorithm gets it
        # without having to call it (HiCS-FL learns from every aggregated upload).
        selector=build_selector(config, output_layer=algorithm.output_layer),
        devices=DeviceRegistry(config.data.num_devices, local_data=config.data.dataset == "local"),
        missed=MissedDeadlines(config.deadlines.max_skip_rounds),
        pace=DevicePace(config.deadlines.patience, config.deadlines.patience_grace_s,
                        config.deadlines.ignore_slowest),
        evaluation_mode=evaluation_mode(config),
        torch_device=torch_device, loss=loss, privacy=RunPrivacy(config, run_dir) if config.privacy.enabled else None,
        sample_privacy=SampleLedger(config.train.dp_sgd, config.train, run_dir) if config.train.dp_sgd is not None else None)
