"""The Fed Server's run logic: rounds, tasks, uploads, aggregation, evaluation, records.

What a checkpoint holds and when a restart may resume from it: ``checkpoint.py``.

Plain object, no HTTP: the FastAPI layer in ``app.py`` validates bodies and calls it; the round
driver there decides *when* (deadlines, Main Server calls). What an algorithm decides (selection,
split mode, grouping, aggregation) is asked of the algorithm object.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import random
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from fed_server.broadcast import Broadcast
from fed_server.devices import DeviceRegistry
from fed_server.evaluation_round import EvaluationRound
from fed_server.update_checks import (
    check_claims, check_registered_samples, clip_update, held_out_count, max_held_out, shard_sizes,
    update_norm,
)
from shared.evaluation import combine_reports, evaluate, evaluation_mode, server_test_set
from fed_server.records import RoundRecord, round_record, run_summary
from fed_server.recorder import Recorder
from fed_server.missed_deadlines import MissedDeadlines
from fed_server.round_state import NO_REPORT, Assignment, FedRound, ReceivedPortion, ReceivedUpdate
from fed_server.checkpoint import RunProgress
from fed_server.run_dir import RunDirectory
from fed_server.split_planner import SplitPlanner
from fed_server.time_table import ClientTimeTable
from fed_server.weights_store import WeightsStore
from shared.algorithms.aggregation import Contribution
from shared.algorithms.grouping import form_round_groups, groups_per_replica
from shared.algorithms.base import RoundContext, parse_payload
from shared.algorithms.registry import build_algorithm, build_grouping, build_selector
from shared.config import RunConfig
from shared.data import dataset_input_shape, dataset_num_classes
from shared.errors import Conflict, Invalid, NotAllowed
from shared.models import build_model, fingerprint_differences, model_fingerprint, profile_model
from shared.schemas import (
    Ack, EvaluationReport, Participant, PlannedGroup, RegisterRequest, RegisterResponse, ReportRequest, RoundPlan, RunInfo,
    ServerPortionUpload, TaskResponse, UpdateRequest, WeightsId, WithdrawRequest,
)
from shared.portions import decode_portion, portion_state
from shared.wire import WireError, encode_state

log = logging.getLogger("fed_server")


# How soon a waiting device should poll again. Devices not in the running round have nothing to do
# until the next one: with 100 devices and 10 per round, polling them as often as the participants
# cost more CPU than the training on a small machine.
IDLE_RETRY_S = 1.0
SOON_RETRY_S = 0.2


@dataclass
class Aggregation:
    """What aggregating a round attempt left for its record (``Coordinator.aggregate_round``)."""

    used: list[str]              # devices whose updates were aggregated
    dropped: set[str]
    ok: bool                     # the quorum was met and the global model changed
    extras: dict                 # the aggregated devices' validated upload extras
    aggregation_s: float


#: The longest a device's task request may wait for work (``GET .../task?wait_s=``): long enough that
#: an idle device asks a few times a minute, short enough that a server shutting down is not held.
MAX_TASK_WAIT_S = 30.0


@dataclass
class Conclusion:
    """A round attempt whose outcome is fixed, waiting for its record (``Coordinator.conclude_round``).

    Everything the record and the checkpoint need is taken here, when the attempt's model is final,
    so that the next attempt may begin (select, draw from the rng, change algorithm state) while
    the server's evaluation of this one runs beside it (``Coordinator.record``)."""

    # Not the FedRound: it holds the round's uploads, which must not live on beside the next
    # round's (the record below already took what it needs from them).
    record: RoundRecord          # complete but for the new model's evaluation (an aggregated attempt)
    progress: RunProgress        # the checkpoint's progress as of the conclusion, whether the run ends with it

    @property
    def finished(self) -> bool:
        return self.progress.finished


class Coordinator:
    """Owns the global model, the client time table and the round lifecycle.

    ``torch_device`` (``--torch-device``) is where the global model is evaluated; the model itself
    stays on the CPU, where uploads arrive from the wire and are aggregated (a round's
    aggregation is a weighted sum, cheap next to moving every upload to a GPU and back).

    ``main_server_urls``: the Main Server replicas (docs/deployment.md, "Main Server replicas").
    With one, it groups the devices that join, as in the paper; with several, this server forms
    each round's groups and spreads them over the replicas.
    """

    def __init__(self, config: RunConfig, run_dir: RunDirectory, main_server_urls: Sequence[str] | None,
                 run_id: str | None = None, torch_device: torch.device | None = None) -> None:
        self.config = config
        self.torch_device = torch_device
        self.run_dir = run_dir
        self.recorder = Recorder(run_dir)
        self.main_server_urls = list(dict.fromkeys(main_server_urls or []))
        # Replicas that refused the last plan sent to them or were lost during an attempt: their
        # plans get a single try (a dead replica must not cost the plan retries every round).
        self.replicas_down: set[str] = set()
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.algorithm = build_algorithm(config)
        self.num_classes = dataset_num_classes(config.data)
        self.input_shape = dataset_input_shape(config.data)
        self.model = build_model(config.model, self.num_classes, self.input_shape, seed=config.seed,
                                 params=config.model_params)
        self.fingerprint = model_fingerprint(self.model, config.data)
        self.num_blocks = len(self.model.blocks)
        self.algorithm.bind_model(self.model)
        # The selection policy is composed here, beside the algorithm: every algorithm gets it
        # without having to call it (HiCS-FL learns from every aggregated upload).
        self.selector = build_selector(config, output_layer=self.algorithm.output_layer)
        self.missed = MissedDeadlines(config.deadlines.max_skip_rounds)
        self.profile = profile_model(self.model, config.model)
        self.evaluation_mode = evaluation_mode(config)
        # Federated evaluation does not use a server test set even where one exists.
        self.test_set = server_test_set(config.data) if self.evaluation_mode == "server" else None
        self.evaluating: EvaluationRound | None = None   # the open federated evaluation phase
        self.devices = DeviceRegistry(config.data.num_devices, local_data=config.data.dataset == "local")
        #: Each shard's size, which its device's registered count must match (None: ``dataset: local``).
        self.shard_sizes = shard_sizes(config.data)
        # A model without split points runs only split-depth-zero algorithms (validate_run_config),
        # which never consult the table: one placeholder candidate keeps it well-formed.
        self.table = ClientTimeTable(max(1, len(self.model.split_points)), config.split.smoothing)
        self.planner = SplitPlanner(self.algorithm.split_mode(), self.model.split_points, self.num_blocks, self.profile,
                                    self.table, self.devices, config.train.local_epochs, config.split.server_flops)
        # Groups must be known before tasks go out to tell each device its replica, so with
        # several replicas the Fed Server groups, from label counts sent at registration.
        self.label_counts_at_registration = len(self.main_server_urls) > 1 and self.planner.mode != "zero"
        self.rng = random.Random(config.seed)
        self.round: FedRound | None = None
        self.rounds_done = 0          # completed logical rounds (aggregated; recorded or about to be)
        self.rounds_recorded = 0      # of those, the ones whose record and checkpoint are written
        self._unrecorded: Conclusion | None = None   # a concluded attempt whose record is not written yet
        self.attempts = 0             # round attempts started; each one's wire round_id
        self.failed_in_a_row = 0
        self.history: list[RoundRecord] = []
        self.finished = False
        #: The weights tasks name, packed once each and fetched by id (fed_server/weights_store.py).
        self.weights = WeightsStore()
        self._evaluation_weights: WeightsId | None = None  # the evaluated global model, once per phase
        # The open attempt's client portions by split point, published once for all the devices that
        # train it (FedAvg: one encoding of the whole model a round, not one per device).
        self._task_weights: tuple[int, dict[int, WeightsId]] = (0, {})
        self._done_answer: TaskResponse | None = None  # the final answer, polled by every device
        self.stop_reason: str | None = None
        self.started_at: float | None = None
        self.elapsed_before = 0.0     # run time before a restart
        self.cumulative_bytes = 0
        # With federated evaluation nothing evaluates the initial model: the devices are asked only
        # after aggregating a round, so there is no round-0 accuracy (None).
        initial_acc, initial_loss = evaluate(self.model, self.test_set, device=self.torch_device) if self.test_set is not None else (None, None)
        self.initial: dict[str, float | None] = {"test_accuracy": initial_acc, "test_loss": initial_loss}
        self.resumed = self.resume()
        run_dir.write_config(config, self.run_id)
        if self.finished:  # a finished run killed before its summary was written gets it now
            self.recorder.write_summary(self.summary())
        self.created_at = time.monotonic()
        # Set whenever something a waiting round driver checks may have changed (a device
        # registered, a report, an update or a group portion arrived): the driver wakes on it
        # instead of polling. Methods run on the event loop, so setting it needs no lock.
        self.changed = asyncio.Event()
        # Posted whenever a waiting device's answer may have changed (a round's tasks went out,
        # follow-ups were planned, an evaluation phase began, the run finished): devices wait for
        # work on it (long-poll, :meth:`next_task`) instead of polling.
        self.work_posted = Broadcast()
        # Posted whenever a round record was written (the run's "finished" comes with its last
        # record) or the round driver stopped: ``/v1/status?wait_s=`` holds its answer on it.
        self.status_posted = Broadcast()
        # Called with (attempt, replica URL, device -> why) when devices of a split attempt leave
        # it at the Fed Server (a refused upload, a withdrawal), so that replica stops waiting for
        # them at its join or group barrier; the round driver sends it (``driver.send_departures``).
        self.on_departure: Callable[[FedRound, str, dict[str, str]], None] | None = None

    # --- devices ------------------------------------------------------------------------------
    def register(self, req: RegisterRequest) -> RegisterResponse:
        """Register a device; Conflict (409), changing nothing, when the fingerprint it sends says
        its model or data pipeline differs from the run's (None: not checked, docs/models.md);
        Invalid (422), changing nothing, for a sample count the run rules out."""
        if self.label_counts_at_registration:
            if req.label_counts is None:
                raise Invalid(f"{req.device_id}: this run has several Main Server replicas and groups at the Fed "
                              f"Server: register with label_counts (RunInfo.label_counts_at_registration)")
            if len(req.label_counts) != self.num_classes:
                raise Invalid(f"label_counts has {len(req.label_counts)} entries; the model has {self.num_classes} classes")
        elif req.label_counts is not None:
            raise Invalid("this run takes label counts at the Main Server only (RunInfo.label_counts_at_registration "
                          "is false): register without label_counts")
        check_registered_samples(req, self.shard_sizes, self._holdout(), self.config.data.max_device_samples)
        if req.fingerprint is not None:
            differences = fingerprint_differences(req.fingerprint, self.fingerprint, "on the device", "in the run")
            if differences:
                raise Conflict(f"{req.device_id}: the device's model differs from the run's "
                               f"(model {self.config.model!r}): " + "; ".join(differences))
        record = self.devices.register(req)
        self.missed.answered([req.device_id])   # a restarted agent's device is tried again at once
        self.changed.set()
        if self.round is not None and self._sits_out(self.round, req.device_id):
            log.warning("%s enrolled again during attempt %d: it sits that attempt out (the Main Server's plan "
                        "carries its previous enrolment)", req.device_id, self.round.round_id)
        log.info("registered %s (%s %d, %d samples, %s)", req.device_id, "slot" if self.devices.local_data else "shard",
                 record.shard, req.num_samples, req.profile.kind)
        return RegisterResponse(run_id=self.run_id, device_id=record.device_id, shard=record.shard)

    def run_info(self) -> RunInfo:
        """The run's model and data spec, so a device can load its shard before registering."""
        return RunInfo(run_id=self.run_id, algorithm=self.config.algorithm, model=self.config.model,
                       model_params=self.config.model_params, fingerprint=self.fingerprint,
                       num_classes=self.num_classes, input_shape=list(self.input_shape),
                       data=self.config.data, seed=self.config.seed,
                       holdout=self._holdout(),
                       label_counts_at_registration=self.label_counts_at_registration)

    def ready(self) -> bool:
        """Rounds start once every shard has a registered device, or, after the registration
        deadline, once the quorum has (a resumed run whose devices did not all come back)."""
        if len(self.devices) >= self.config.data.num_devices:
            return True
        return time.monotonic() >= self.registration_deadline() and len(self.devices) >= self.config.deadlines.min_participants

    def registration_deadline(self) -> float:
        """The monotonic time after which the quorum of registered devices suffices."""
        return self.created_at + self.config.deadlines.registration_s

    # --- round lifecycle ----------------------------------------------------------------------
    def begin_round(self) -> FedRound:
        """Select devices and split points for the next round."""
        if self.started_at is None:
            self.started_at = time.monotonic()
        self.attempts = self.recorder.reserve_attempt(self.attempts + 1)
        index = self.rounds_done + 1
        ctx = RoundContext(index=index, attempt=self.attempts)
        pool = self._selectable(self.algorithm.eligible(self.devices.ids()))
        selected = self.selector.select(ctx, pool, min(self.config.per_round, len(pool)), self.rng)
        splits = self.planner.choose(index, selected)
        self.round = FedRound(
            round_id=self.attempts, index=index, split_mode=self.planner.mode,
            assignments={d: Assignment(d, k, j, self.devices.token_nonce(d)) for d, (j, k) in splits.items()},
            deadline_s=self.config.deadlines.round_s,
            report_deadline_s=self.config.deadlines.report_s or self.config.deadlines.round_s / 2,
        )
        log.info("round %d (attempt %d): %d devices, splits %s", index, self.attempts, len(selected), {d: a.split_point for d, a in self.round.assignments.items()})
        return self.round

    def _selectable(self, eligible: list[str]) -> list[str]:
        """``eligible`` less the devices sitting out after a missed deadline
        (:mod:`fed_server.missed_deadlines`), unless that would leave fewer than the quorum."""
        skipped = self.missed.skipped(self.attempts)
        pool = [d for d in eligible if d not in skipped]
        if skipped & set(eligible) and len(pool) >= self.config.deadlines.min_participants:
            log.info("attempt %d: %s sit out after missing a deadline", self.attempts, sorted(skipped & set(eligible)))
            return pool
        return eligible

    def replica_plans(self, fed_round: FedRound, live: Sequence[str]) -> dict[str, RoundPlan]:
        """The round plan of each replica in ``live`` that gets devices, and every assignment's
        replica. Called again with fewer replicas when one refused its plan: the groups stay, their
        spread is redone.

        One replica: one plan with every participant and no groups (the Main Server groups, as in
        the paper). Several: the groups are formed here, once per attempt, by the one grouping
        function the Main Server uses (same plug-in, group size and rng), from the label counts
        sent at registration, and spread by :func:`groups_per_replica` (largest first, to the least
        loaded replica).
        """
        if not live:
            raise ValueError("no live Main Server replica to plan for")
        if len(self.main_server_urls) == 1:
            for assignment in fed_round.assignments.values():
                assignment.main_server_url = live[0]
            return {live[0]: self.round_plan(fed_round, sorted(fed_round.assignments))}
        if fed_round.planned_groups is None:
            counts = {d: self.devices.devices[d].label_counts or [] for d in fed_round.assignments}
            groups = form_round_groups(build_grouping(self.algorithm.grouping()), counts,
                                       self.config.grouping.group_size, self.config.seed, fed_round.round_id)
            fed_round.planned_groups = dict(enumerate(groups))
        planned = [fed_round.planned_groups[g] for g in range(len(fed_round.planned_groups))]
        loads = [sum(max(1, self.devices.devices[m].num_samples) for m in members) for members in planned]
        fed_round.group_replica = {}
        plans: dict[str, RoundPlan] = {}
        for url, mine in zip(live, groups_per_replica(planned, loads, len(live))):
            if not mine:   # more replicas than groups
                continue
            for g, members in mine.items():
                fed_round.group_replica[g] = url
                for m in members:
                    fed_round.assignments[m].main_server_url = url
            plans[url] = self.round_plan(fed_round, sorted(m for members in mine.values() for m in members),
                                         [PlannedGroup(group_id=g, members=members) for g, members in mine.items()])
        return plans

    def round_plan(self, fed_round: FedRound, members: Sequence[str],
                   groups: list[PlannedGroup] | None = None) -> RoundPlan:
        """What one Main Server needs: its participants (``members``), their splits, the groups
        when the Fed Server formed them, and the server-side weights from their smallest split."""
        start = min(fed_round.assignments[d].split_point for d in members)
        return RoundPlan(
            run_id=self.run_id, round_id=fed_round.round_id, model=self.config.model,
            model_params=self.config.model_params, num_classes=self.num_classes,
            input_shape=list(self.input_shape), seed=self.config.seed,
            participants=[Participant(device_id=d, split_point=fed_round.assignments[d].split_point,
                                      num_samples=max(1, self.devices.devices[d].num_samples),
                                      token_nonce=fed_round.assignments[d].token_nonce)
                          for d in members],
            server_weights=encode_state(portion_state(self.model, start, self.num_blocks)), train=self.config.train,
            grouping=self.algorithm.grouping(), group_size=self.config.grouping.group_size,
            group_loss=self.config.grouping.group_loss, join_deadline_s=self.config.deadlines.join_s,
            step_deadline_s=self.config.deadlines.step_s, groups=groups,
            max_activation=self.config.grouping.max_activation,
        )

    def replica_lost(self, fed_round: FedRound, url: str, reason: str) -> None:
        """Replica ``url`` is gone during the open attempt (its watch stream broke or fell silent):
        its devices whose group portion has not arrived are excluded, so the attempt completes with
        the other replicas' groups (or fails below the quorum and is retried, the usual rules).
        Groups it already uploaded stay. Nothing for a closed attempt or a replica already lost."""
        if self.round is not fed_round or url in fed_round.lost_replicas:
            return
        fed_round.lost_replicas.append(url)
        self.replicas_down.add(url)
        log.warning("round %d (attempt %d): Main Server replica %s lost (%s)", fed_round.index, fed_round.round_id,
                    url, reason)
        self._exclude_without_portion(fed_round, url, f"its Main Server replica {url} was lost ({reason})")

    def replica_done(self, fed_round: FedRound, url: str, undelivered: Sequence[int]) -> None:
        """Replica ``url`` says every group of the open attempt has ended (its watch stream's
        ``done`` line, sent after each group's portion upload ended): its devices that no stored
        portion covers will get none, so they are taken out now, not at the round deadline.
        ``undelivered``: the groups whose portion it could not deliver (named in the reason)."""
        if self.round is not fed_round:
            return
        why = f" (groups {sorted(undelivered)} could not be delivered)" if undelivered else ""
        self._exclude_without_portion(fed_round, url, f"its group portion never arrived{why}")

    def main_server_dropped(self, fed_round: FedRound, url: str, dropped: Mapping[str, str]) -> None:
        """Replica ``url`` dropped these members of the open attempt (each with why, from its watch
        stream): they cannot be aggregated, so the attempt stops waiting for them. A replica speaks
        only for the devices planned on it."""
        if self.round is not fed_round:
            return
        for device, why in sorted(dropped.items()):
            assignment = fed_round.assignments.get(device)
            if assignment is not None and assignment.main_server_url == url:
                self._exclude(fed_round, [device], f"dropped by the Main Server: {why}")

    def _exclude_without_portion(self, fed_round: FedRound, url: str, reason: str) -> None:
        """Take out replica ``url``'s devices of the attempt that no stored group portion covers:
        groups it already uploaded stay."""
        mine = {d for d, a in fed_round.assignments.items() if a.main_server_url == url}
        self._exclude(fed_round, mine - fed_round.covered_by_portions(), reason)

    def _exclude(self, fed_round: FedRound, devices: Iterable[str], reason: str, tell_main_server: bool = False) -> None:
        """Take ``devices`` out of the attempt (:meth:`FedRound.exclude`) and wake the driver, which
        may now find the attempt complete. ``tell_main_server``: the Main Server does not know yet
        (the device left at the Fed Server), so its replica is told (:attr:`on_departure`)."""
        new = fed_round.exclude(devices, reason)
        if not new:
            return
        log.warning("round %d (attempt %d): %s taken out: %s", fed_round.index, fed_round.round_id,
                    ", ".join(sorted(new)), reason)
        self.changed.set()
        if tell_main_server and fed_round.uses_main_server and self.on_departure is not None:
            by_replica: dict[str, dict[str, str]] = {}
            for device in sorted(new):
                url = fed_round.assignments[device].main_server_url
                if url is not None:
                    by_replica.setdefault(url, {})[device] = reason
            for url, reasons in by_replica.items():
                self.on_departure(fed_round, url, reasons)

    def post_work(self) -> None:
        """Wake every device waiting in :meth:`next_task`: its answer may have changed. Called on
        the event loop."""
        self.work_posted.post()

    def open_tasks(self, fed_round: FedRound) -> None:
        """The round's plans are out (or it has none): its devices may now get their tasks."""
        fed_round.ready = True
        self.post_work()

    async def next_task(self, device_id: str, wait_s: float = 0.0) -> TaskResponse:
        """:meth:`task_for`, but a ``wait`` answer is held for up to ``wait_s`` seconds until work is
        posted for the device (long-poll): a device learns of its task when the round opens, not at
        its next poll (:meth:`Broadcast.hold`: work posted while the answer is computed is never
        missed)."""
        if not 0.0 <= wait_s <= MAX_TASK_WAIT_S:
            raise Invalid(f"wait_s must be between 0 and {MAX_TASK_WAIT_S:g} seconds, got {wait_s}")
        return await self.work_posted.hold(lambda: self.task_for(device_id), lambda answer: answer.status != "wait", wait_s)

    def task_for(self, device_id: str) -> TaskResponse:
        """A polling device's next instruction.

        Every device, selected or not, is told the final global model's ``weights_id`` when the
        run is done; a device that keeps its model fetches it, a virtual one does not.
        """
        self.devices.get(device_id)
        if self.finished:
            if self._done_answer is None:
                self._done_answer = TaskResponse(status="done", num_blocks=self.num_blocks,
                                                 weights_id=self.weights.publish(self._portion(self.num_blocks)))
            return self._done_answer
        if self.evaluating is not None and device_id in self.evaluating.asked:
            return self._evaluation_task(self.evaluating, device_id)
        fed_round = self.round
        if fed_round is None or not fed_round.ready:
            # Before the first round nothing is imminent; between rounds the next task is.
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S if self.started_at is None else SOON_RETRY_S)
        if device_id not in fed_round.assignments:
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S)
        if fed_round.follow_ups is not None:
            return self._follow_up_for(fed_round, device_id)
        assignment = fed_round.assignments[device_id]
        if assignment.dispatched_at is not None:  # one task per device and round; a follow-up may come
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        if self._sits_out(fed_round, device_id):
            return TaskResponse(status="wait", retry_after_s=IDLE_RETRY_S)
        assignment.dispatched_at = time.monotonic()
        return TaskResponse(
            status="train", round_id=fed_round.round_id, split_point=assignment.split_point, num_blocks=self.num_blocks,
            weights_id=self._client_portion(fed_round, assignment.split_point), train=self.config.train,
            main_server_url=assignment.main_server_url if fed_round.uses_main_server else None,
            deadline_s=self._remaining(fed_round), half_precision=self.config.half_precision,
            algorithm=self.config.algorithm, params=self.algorithm.device_params(),
            extras=self.algorithm.task_extras(device_id, fed_round.context).to_wire(),
            report=self.algorithm.needs_report,
        )

    def _sits_out(self, fed_round: FedRound, device_id: str) -> bool:
        """Whether ``device_id``, selected for ``fed_round`` and not yet sent its task, enrolled
        again since the attempt began (a restarted agent): the Main Server's plan carries the
        enrolment the device had then and would refuse its new token, so it sits this attempt out;
        the next attempt's plan carries its new one."""
        assignment = fed_round.assignments.get(device_id)
        return (fed_round.uses_main_server and assignment is not None and assignment.dispatched_at is None
                and assignment.token_nonce != self.devices.token_nonce(device_id))

    def _portion(self, end: int) -> dict[str, torch.Tensor]:
        return portion_state(self.model, 0, end)

    def _client_portion(self, fed_round: FedRound, split_point: int) -> WeightsId:
        """Blocks ``[0, split_point)`` of the global model, published once per attempt and split
        point (the model does not change while an attempt is open)."""
        round_id, portions = self._task_weights
        if round_id != fed_round.round_id:
            self._release_task_weights()
            portions = {}
            self._task_weights = (fed_round.round_id, portions)
        if split_point not in portions:
            portions[split_point] = self.weights.publish(self._portion(split_point))
        return portions[split_point]

    def _release_task_weights(self) -> None:
        """The attempt's portions are no longer served: its tasks have ended (or the model is about
        to change)."""
        for weights_id in self._task_weights[1].values():
            self.weights.release(weights_id)
        self._task_weights = (0, {})

    def _release_evaluation_weights(self) -> None:
        if self._evaluation_weights is not None:
            self.weights.release(self._evaluation_weights)
            self._evaluation_weights = None

    def _follow_up_for(self, fed_round: FedRound, device_id: str) -> TaskResponse:
        assert fed_round.follow_ups is not None
        if device_id not in fed_round.follow_ups or device_id in fed_round.follow_ups_sent:
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        fed_round.follow_ups_sent.add(device_id)
        return TaskResponse(status="train", phase="follow_up", round_id=fed_round.round_id,
                            deadline_s=self._remaining(fed_round), algorithm=self.config.algorithm,
                            extras=fed_round.follow_ups[device_id].to_wire())

    def _evaluation_task(self, evaluation: EvaluationRound, device_id: str) -> TaskResponse:
        """Federated evaluation: the whole new global model, once per asked device."""
        if device_id in evaluation.dispatched or device_id in evaluation.reports:
            return TaskResponse(status="wait", retry_after_s=SOON_RETRY_S)
        evaluation.dispatched.add(device_id)
        if self._evaluation_weights is None:   # published once for every asked device
            self._evaluation_weights = self.weights.publish(self._portion(self.num_blocks))
        remaining = max(1.0, evaluation.deadline() - time.monotonic())
        return TaskResponse(status="evaluate", round_id=evaluation.round_id, num_blocks=self.num_blocks,
                            weights_id=self._evaluation_weights, deadline_s=remaining)

    @staticmethod
    def _remaining(fed_round: FedRound) -> float:
        return max(1.0, fed_round.deadline_s - (time.monotonic() - fed_round.started_at))

    def accept_report(self, round_id: int, req: ReportRequest) -> Ack:
        """Two-phase algorithms: a device's post-training report."""
        if req.round_id != round_id:
            raise Invalid(f"body round_id {req.round_id} does not match the path's round {round_id}")
        self.devices.get(req.device_id)
        fed_round = self._open_round(round_id)
        if not self.algorithm.needs_report:
            raise Conflict(f"algorithm {self.config.algorithm} takes no reports")
        if req.device_id not in fed_round.assignments:
            raise NotAllowed(f"device {req.device_id!r} was not selected for round {round_id}")
        if req.device_id in fed_round.reports:
            raise Conflict(f"round {round_id} already has the report of {req.device_id!r}")
        if fed_round.follow_ups is not None:
            raise Conflict(f"reports for round {round_id} are closed")
        fed_round.reports[req.device_id] = parse_payload(self.algorithm.Report, req.extras, "report")
        self.changed.set()
        return Ack(detail=f"report of {req.device_id} for round {round_id} stored")

    def plan_follow_ups(self, fed_round: FedRound) -> None:
        """Close reporting: devices that did not report are dropped; the algorithm answers the rest."""
        self._exclude(fed_round, set(fed_round.assignments) - set(fed_round.reports), NO_REPORT)
        try:
            fed_round.follow_ups = self.algorithm.plan_follow_ups(fed_round.context, fed_round.reports)
        except ValueError as exc:
            log.error("round %d (attempt %d): follow-ups could not be planned: %s", fed_round.index,
                      fed_round.round_id, exc)
            fed_round.follow_ups = {}
            self._exclude(fed_round, fed_round.assignments, f"follow-ups could not be planned: {exc}")
        self.post_work()

    def _open_round(self, round_id: int) -> FedRound:
        if self.round is None or self.round.round_id != round_id:
            current = self.round.round_id if self.round else None
            raise Conflict(f"round {round_id} is not open (open round: {current})")
        return self.round

    def _decode(self, weights, start: int, end: int) -> dict[str, torch.Tensor]:
        try:
            return decode_portion(weights, self.model, start, end)
        except WireError as exc:
            raise Invalid(str(exc)) from None

    def _checked_update(self, device_id: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply ``updates.max_norm``: refuse (422) or clip an update that is too large."""
        limit = self.config.updates.max_norm
        if limit is None:
            return state
        global_state = self.model.state_dict()
        norm = update_norm(state, global_state)
        if norm <= limit:
            return state
        if self.config.updates.action == "reject":
            raise Invalid(f"update norm {norm:.4g} of {device_id!r} exceeds updates.max_norm={limit:.4g}")
        log.warning("clipping the update of %s from norm %.4g to %.4g", device_id, norm, limit)
        return clip_update(state, global_state, limit, norm)

    def accept_update(self, round_id: int, req: UpdateRequest, body_bytes: int, upload_s: float = 0.0) -> Ack:
        """A device's trained portion. Fully checked before it is stored. ``upload_s``: how long
        its body took to arrive (part of the device's round time)."""
        if req.round_id != round_id:
            raise Invalid(f"body round_id {req.round_id} does not match the path's round {round_id}")
        record = self.devices.get(req.device_id)
        fed_round = self._open_round(round_id)
        assignment = fed_round.assignments.get(req.device_id)
        if assignment is None:
            raise NotAllowed(f"device {req.device_id!r} was not selected for round {round_id}")
        if req.device_id in fed_round.updates:
            # A retried upload (the first answer was lost): accepted once, acknowledged again.
            return Ack(detail=f"update of {req.device_id} for round {round_id} was already stored")
        if req.device_id in fed_round.excluded:
            raise Conflict(f"device {req.device_id!r} was taken out of round {round_id}: "
                           f"{fed_round.excluded[req.device_id]}")
        if self.algorithm.needs_report and req.device_id not in fed_round.follow_ups_sent:
            raise Conflict(f"device {req.device_id!r} must report and receive its follow-up before uploading")
        try:
            check_claims(req, record.num_samples, fed_round.deadline_s)
            state = self._checked_update(req.device_id, self._decode(req.weights, 0, assignment.split_point))
            extras = parse_payload(self.algorithm.UploadExtras, req.extras, "extras")
            try:
                self.algorithm.accept_update(req.device_id, fed_round.context, state, extras, req.num_samples,
                                             self.model.state_dict())
            except ValueError as exc:
                raise Invalid(f"extras: {exc}") from None
        except Invalid as refused:
            # The device's own upload is unusable and it has no other for this attempt: waiting for
            # it would hold every other device to the round deadline.
            self._exclude(fed_round, [req.device_id], f"upload refused: {refused.detail}", tell_main_server=True)
            raise
        fed_round.updates[req.device_id] = ReceivedUpdate(req, state, body_bytes, extras, upload_s)
        self.changed.set()
        return Ack(detail=f"update of {req.device_id} for round {round_id} stored")

    def withdraw(self, round_id: int, req: WithdrawRequest) -> Ack:
        """A selected device cannot contribute to the open attempt (a task it cannot build or decode,
        a group that dropped it): it is taken out at once, so the attempt does not wait for its
        upload. Idempotent; Conflict, changing nothing, once its update is stored or for an
        attempt that is not open; NotAllowed for a device that was not selected."""
        if req.round_id != round_id:
            raise Invalid(f"body round_id {req.round_id} does not match the path's round {round_id}")
        self.devices.get(req.device_id)
        fed_round = self._open_round(round_id)
        if req.device_id not in fed_round.assignments:
            raise NotAllowed(f"device {req.device_id!r} was not selected for round {round_id}")
        if req.device_id in fed_round.updates:
            raise Conflict(f"the update of {req.device_id!r} for round {round_id} is already stored")
        self._exclude(fed_round, [req.device_id], f"withdrew: {req.reason}", tell_main_server=True)
        return Ack(detail=f"{req.device_id} is out of round {round_id}: {fed_round.excluded[req.device_id]}")

    def accept_portion(self, round_id: int, upload: ServerPortionUpload, body_bytes: int) -> Ack:
        """A group's trained server-side copy from the Main Server."""
        if upload.round_id != round_id or upload.run_id != self.run_id:
            raise Conflict(f"portion for run {upload.run_id} round {upload.round_id} does not belong to the open round")
        fed_round = self._open_round(round_id)
        if not fed_round.uses_main_server:
            raise Conflict(f"round {round_id} does not use the Main Server")
        members = set(upload.members) | set(upload.dropped)
        unknown = (members | set(upload.absent)) - set(fed_round.assignments)
        if unknown:
            raise Invalid(f"group members {sorted(unknown)} are not participants of round {round_id}")
        if upload.group_id in fed_round.portions:
            raise Conflict(f"group {upload.group_id} of round {round_id} was already received")
        if fed_round.planned_groups is not None:
            planned = fed_round.planned_groups.get(upload.group_id)
            if planned is None:
                raise Invalid(f"round {round_id} has no planned group {upload.group_id}")
            if not members <= set(planned):
                raise Invalid(f"group {upload.group_id} of round {round_id} was planned as {planned}; "
                              f"{sorted(members - set(planned))} are not in it")
            replicas = [fed_round.group_replica[upload.group_id]]
        else:
            replicas = fed_round.replicas()
        if any(r in fed_round.lost_replicas for r in replicas):
            # Its devices were excluded when the replica was declared lost: taking the portion now
            # would count a group the attempt already gave up.
            raise Conflict(f"group {upload.group_id} of round {round_id} belongs to a Main Server replica "
                           f"declared lost in this round")
        splits = [fed_round.assignments[m].split_point for m in members]
        if splits and upload.start_block > min(splits):
            raise Invalid(f"portion starts at block {upload.start_block}, after a member's split point {min(splits)}")
        state = self._decode(upload.weights, upload.start_block, self.num_blocks)
        fed_round.portions[upload.group_id] = ReceivedPortion(upload, state, body_bytes)
        self.changed.set()
        return Ack(detail=f"group {upload.group_id} of round {round_id} stored")

    # --- federated evaluation -----------------------------------------------------------------
    def begin_evaluation(self, fed_round: FedRound, aggregation: Aggregation) -> EvaluationRound | None:
        """Federated evaluation of an aggregated round: ask its aggregated devices to evaluate the
        new global model (their next poll answers ``status="evaluate"``). None when the round is
        not evaluated this way (server evaluation, or a failed round, which changed no model).
        Called on the event loop."""
        if self.evaluation_mode != "federated" or not aggregation.ok:
            return None
        self._release_evaluation_weights()
        self.evaluating = EvaluationRound(
            round_id=fed_round.round_id, asked={d: self.held_out_limit(d) for d in aggregation.used},
            deadline_s=self.config.deadlines.evaluate_s)
        log.info("round %d: asking %d devices to evaluate the new global model", fed_round.index, len(aggregation.used))
        self.post_work()
        return self.evaluating

    def _holdout(self) -> float | None:
        """The fraction every device holds out for federated evaluation; None: the server evaluates."""
        return self.config.evaluation.holdout if self.evaluation_mode == "federated" else None

    def held_out_limit(self, device_id: str) -> int:
        """The most held-out samples ``device_id`` may report an evaluation over: its shard's held-out
        part, or with its own data (``dataset: local``) the most a device training on its
        registered count can hold out."""
        holdout = self._holdout()
        assert holdout is not None, "asked only with federated evaluation"
        record = self.devices.devices[device_id]
        if self.shard_sizes is not None:
            return held_out_count(self.shard_sizes[record.shard], holdout)
        return max_held_out(record.num_samples, holdout)

    def accept_evaluation(self, report: EvaluationReport) -> Ack:
        """A device's evaluation of the open phase's global model; checked before it is stored."""
        self.devices.get(report.device_id)
        evaluation = self.evaluating
        if evaluation is None or evaluation.round_id != report.round_id:
            current = evaluation.round_id if evaluation else None
            raise Conflict(f"round {report.round_id} is not being evaluated (evaluating: {current})")
        try:
            evaluation.accept(report)
        except Invalid:
            self.changed.set()   # a refused report may complete the phase (EvaluationRound.refused)
            raise
        self.changed.set()
        return Ack(detail=f"evaluation of {report.device_id} for round {report.round_id} stored")

    def close_evaluation(self) -> EvaluationRound | None:
        """End the open evaluation phase (all reported, or its deadline passed): later reports are
        stale. Called on the event loop, so no report lands between this and the record."""
        evaluation, self.evaluating = self.evaluating, None
        self._release_evaluation_weights()
        if evaluation is not None:
            evaluation.closed = True
        return evaluation

    def close_round(self) -> FedRound:
        """Stop accepting uploads for the open round (called on the event loop)."""
        if self.round is None:
            raise RuntimeError("no open round")
        fed_round, self.round = self.round, None
        self._release_task_weights()   # the model is about to change
        return fed_round

    def aggregate_round(self, fed_round: FedRound) -> Aggregation:
        """Aggregate (Algorithm 1 or the algorithm's rule) and update the time table. A round below
        the quorum changes nothing (``ok`` False): the same logical round is retried. A split device
        whose group portion is missing is not aggregated: it is taken out with that reason. Nothing
        is written to disk here: a restart before :meth:`record_round` re-runs the round. CPU work:
        run off the event loop."""
        dropped = fed_round.dropped()
        contributions: dict[str, Contribution] = {}
        for device, update in sorted(fed_round.updates.items()):
            if device in dropped:
                continue
            portion = fed_round.group_of(device) if fed_round.uses_main_server else None
            if fed_round.uses_main_server and portion is None:
                # Its server-side layers never came back: its client layers alone would be averaged
                # against server layers trained without them. (Off the event loop: no driver to wake.)
                fed_round.exclude([device], "its group portion never arrived")
                log.warning("round %d (attempt %d): %s not aggregated: its group portion never arrived",
                            fed_round.index, fed_round.round_id, device)
                continue
            contributions[device] = Contribution(weight=update.request.num_samples, client_state=update.state,
                                                 server_state=portion.state if portion else None)
        dropped = fed_round.dropped()
        used = list(contributions)
        extras = {d: fed_round.updates[d].extras for d in used}
        ok = len(used) >= self.config.deadlines.min_participants
        aggregation_s = 0.0
        if ok:
            started = time.perf_counter()
            global_state = self.model.state_dict()
            for device, contribution in contributions.items():
                self.selector.observe(device, contribution, global_state)
            new_state = self.algorithm.aggregate(fed_round.context, global_state, contributions, extras)
            self.model.load_state_dict(new_state)
            aggregation_s = time.perf_counter() - started
            for device in used:
                assignment = fed_round.assignments[device]
                if assignment.candidate is not None:
                    update = fed_round.updates[device]
                    self.planner.observe(device, assignment.candidate, update.request.timings.transfer_s + update.upload_s)
                    try:
                        self.table.record(device, assignment.candidate, update.round_time)
                    except ValueError as exc:
                        # accept_update bounds the timings; should one device's figures still be
                        # unusable, that device's cell is not updated, and the round goes on.
                        log.error("round %d: time of %s not recorded: %s", fed_round.round_id, device, exc)
            self.rounds_done = fed_round.index
            self.failed_in_a_row = 0
        else:
            self.failed_in_a_row += 1
            log.warning("round %d (attempt %d) failed: %d of %d required participants; retrying", fed_round.index,
                        fed_round.round_id, len(used), self.config.deadlines.min_participants)
        return Aggregation(used, dropped, ok, extras, aggregation_s)

    def record_round(self, fed_round: FedRound, aggregation: Aggregation,
                     evaluation: EvaluationRound | None = None) -> RoundRecord:
        """Conclude and record an attempt in one go (:meth:`conclude_round`, then :meth:`record`)."""
        return self.record(self.conclude_round(fed_round, aggregation, evaluation))

    def conclude_round(self, fed_round: FedRound, aggregation: Aggregation,
                       evaluation: EvaluationRound | None = None) -> Conclusion:
        """Fix what an aggregated (or failed) attempt leaves: its record but for the server's
        evaluation, the checkpoint's progress, whether the run ends with it. Called on the event
        loop, before the next attempt begins; the previous conclusion must be recorded first (the
        records and checkpoints are written in order)."""
        if self._unrecorded is not None:
            raise RuntimeError(f"attempt {self._unrecorded.record.round_id} is concluded but not recorded yet")
        ok, used, extras = aggregation.ok, aggregation.used, aggregation.extras
        evaluated: tuple[int | None, int | None] = (None, None)   # federated: devices, samples
        if evaluation is not None:   # the evaluation tasks went down to the devices in this round
            fed_round.task_bytes += evaluation.task_bytes
        accuracy: float | None = None
        loss: float | None = None
        if not ok:   # the model did not change: its last evaluation stands
            last = self.history[-1] if self.history else None
            accuracy, loss = (last.test_accuracy, last.test_loss) if last else (self.initial["test_accuracy"], self.initial["test_loss"])
            if self.evaluation_mode == "federated":
                evaluated = (last.evaluated_devices or 0, last.evaluated_samples or 0) if last else (0, 0)
        elif self.evaluation_mode == "federated":
            # No report at all (or no phase): the round still counts, with no figures.
            result = evaluation.result() if evaluation is not None else combine_reports([])
            accuracy, loss, evaluated = result.accuracy, result.loss, (result.devices, result.samples)
        record = round_record(
            fed_round, self.config.algorithm, used, aggregation.dropped, "ok" if ok else "failed", accuracy, loss,
            time.monotonic() - fed_round.started_at, self._elapsed(), self.cumulative_bytes,
            {d: r.kind for d, r in self.devices.devices.items()}, aggregation.aggregation_s,
            {**self.selector.metrics(), **self.algorithm.round_metrics(fed_round.context, extras)} if ok else {},
            evaluated_devices=evaluated[0], evaluated_samples=evaluated[1])
        self.cumulative_bytes = record.cumulative_bytes
        self._note_deadlines(fed_round, used)
        finished, stop_reason = False, None
        if self.rounds_done >= self.config.rounds:
            finished, stop_reason = True, "completed"
        elif self.failed_in_a_row >= self.config.deadlines.max_failed_attempts:
            finished, stop_reason = True, f"{self.failed_in_a_row} failed attempts in a row"
        progress = copy.deepcopy(self._progress(finished, stop_reason))
        progress.history_len += 1   # the record this checkpoint will cover
        self._unrecorded = Conclusion(record, progress)
        return self._unrecorded

    def _note_deadlines(self, fed_round: FedRound, used: Sequence[str]) -> None:
        """Clear the record of every device that uploaded; make those the attempt waited a
        deadline for sit out (:mod:`fed_server.missed_deadlines`). A device that enrolled again
        meanwhile (a restarted agent, which sits out the attempt it restarted in) is not counted."""
        self.missed.answered(fed_round.updates)
        late = {d for d in fed_round.missed_deadline(used)
                if fed_round.assignments[d].token_nonce == self.devices.token_nonce(d)}
        for device, skip in self.missed.missed(late, fed_round.round_id).items():
            log.warning("round %d (attempt %d): %s missed a deadline; it sits out the next %d attempt%s",
                        fed_round.index, fed_round.round_id, device, skip, "" if skip == 1 else "s")

    def record(self, conclusion: Conclusion) -> RoundRecord:
        """Evaluate the concluded attempt's new model (on the server's test set with server
        evaluation, and the algorithm's own figures), then write its record and the checkpoint
        counting it (``fed_server/recorder.py``).

        CPU work: run off the event loop. It may run while the next attempt trains: the global
        model does not change until that attempt is aggregated, and the driver awaits this first."""
        if conclusion is not self._unrecorded:
            raise RuntimeError(f"attempt {conclusion.record.round_id} is not the one concluded last")
        record, progress = conclusion.record, conclusion.progress
        if record.status == "ok":   # the model changed: evaluate it
            update: dict = {"algorithm_metrics": {**record.algorithm_metrics, **self.algorithm.evaluate(self.model)}}
            if self.evaluation_mode == "server":
                assert self.test_set is not None
                started = time.perf_counter()
                update["test_accuracy"], update["test_loss"] = evaluate(self.model, self.test_set, device=self.torch_device)
                update["evaluation_s"] = time.perf_counter() - started
            record = RoundRecord.model_validate({**record.model_dump(), **update})   # validated like any record
        self.history.append(record)
        self.recorder.record_round(record, self.model.state_dict(), progress,
                                   self._summary(progress.finished, progress.stop_reason) if progress.finished else None)
        self._unrecorded = None
        self.rounds_recorded = progress.rounds_done
        # Only now, with the checkpoint and summary on disk, may /v1/status say "finished": a
        # testbed that stops the services on that answer must not kill the server mid-write.
        self.finished, self.stop_reason = progress.finished, progress.stop_reason
        return record

    def _elapsed(self) -> float:
        now = time.monotonic()
        return self.elapsed_before + (now - self.started_at if self.started_at is not None else 0.0)

    def _progress(self, finished: bool, stop_reason: str | None) -> RunProgress:
        """What the checkpoint holds besides the model (``fed_server/checkpoint.py``)."""
        return RunProgress(
            run_id=self.run_id, rounds_done=self.rounds_done, attempts=self.attempts,
            failed_in_a_row=self.failed_in_a_row, history_len=len(self.history),
            cumulative_bytes=self.cumulative_bytes, elapsed_s=self._elapsed(), rng_state=self.rng.getstate(),
            algorithm_state=self.algorithm.state_dict(), selector_state=self.selector.state_dict(), time_table=self.table.entries(),
            missed_deadlines=self.missed.state_dict(), finished=finished, stop_reason=stop_reason)

    def resume(self) -> bool:
        """Continue from the run directory's checkpoint, if there is one. Returns whether it did.

        Restores the global model, the round counters, the client time table, the algorithm's
        per-device state and the selection RNG, and the records the checkpoint covers, so the
        resumed run neither loses nor repeats a round. The attempt counter continues from the
        last id ever reserved, never reusing one (``fed_server/recorder.py``). ValueError for a
        checkpoint of a different configuration (``fed_server/checkpoint.py``).
        """
        loaded = self.recorder.resume(self.config)
        if loaded is None:
            # No checkpoint yet, but attempts may have been handed out (the server stopped during
            # its first attempt): their ids are never used again, so a device's stale upload for
            # one of them cannot land in a new attempt.
            self.attempts = self.recorder.last_attempt()
            return False
        state, progress, self.history = loaded
        self.model.load_state_dict(state)
        self.run_id = progress.run_id
        self.rounds_done = self.rounds_recorded = progress.rounds_done
        self.attempts = progress.attempts
        self.failed_in_a_row = progress.failed_in_a_row
        self.cumulative_bytes = progress.cumulative_bytes
        self.elapsed_before = progress.elapsed_s
        self.rng.setstate(progress.rng_state)
        self.algorithm.load_state_dict(progress.algorithm_state)
        self.selector.load_state_dict(progress.selector_state)
        self.table.load_entries(progress.time_table)
        self.missed.load_state_dict(progress.missed_deadlines)
        self.finished = progress.finished
        self.stop_reason = progress.stop_reason
        log.info("resumed run %s after round %d (attempt %d)", self.run_id, self.rounds_done, self.attempts)
        return True

    def summary(self) -> dict:
        """What the run achieved, for ``summary.json`` and the testbed's final line."""
        return self._summary(self.finished, self.stop_reason)

    def _summary(self, finished: bool, stop_reason: str | None) -> dict:
        base = {"run_id": self.run_id, "algorithm": self.config.algorithm, "model": self.config.model}
        return run_summary(self.history, base, self.initial["test_accuracy"], self.rounds_done,
                           self.cumulative_bytes, finished, stop_reason)

