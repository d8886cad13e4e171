"""The Fed Server's run logic: rounds, tasks, uploads, aggregation, evaluation, records.

Plain object, no HTTP: the FastAPI layer in ``app.py`` validates bodies and calls it; the round
driver there decides *when* (deadlines, Main Server calls). What an algorithm decides (selection,
split mode, grouping, aggregation) is asked of the algorithm object.
"""
from __future__ import annotations

import logging
import random
import statistics
import time
import uuid

import torch

from fed_server.devices import DeviceRegistry
from fed_server.evaluation import evaluate
from fed_server.round_state import Assignment, FedRound, ReceivedPortion, ReceivedUpdate
from fed_server.run_dir import RunDirectory
from fed_server.split_planner import SplitPlanner
from fed_server.time_table import ClientTimeTable
from shared.algorithms.aggregation import Contribution
from shared.algorithms.registry import build_algorithm
from shared.config import RunConfig
from shared.data import dataset_input_shape, dataset_num_classes, load_dataset
from shared.http_server import ApiError
from shared.models import build_model, profile_model
from shared.schemas import (
    Ack, DeviceTimings, Participant, RegisterRequest, RegisterResponse, ReportRequest, RoundPlan, RunInfo, ServerPortionUpload,
    TaskResponse, UpdateRequest,
)
from shared.portions import decode_portion, portion_state
from shared.wire import WireError, encode_state

log = logging.getLogger("fed_server")


def table_time(timings: DeviceTimings) -> float:
    """The time-table value of one device round: Eq. 1's terms, each measured.

    Client compute + transfer + the server-side training of the device's steps. Not included:
    waiting at the group barrier for slower members (not the device's own cost) and the
    host-process overhead between those sections, which on a testbed with many virtual devices in
    one Python process is mostly interpreter contention, a cost no real device has.
    """
    return max(1e-6, timings.compute_s + timings.transfer_s + timings.server_s)


class Coordinator:
    """Owns the global model, the client time table and the round lifecycle."""

    def __init__(self, config: RunConfig, run_dir: RunDirectory, main_server_url: str | None, run_id: str | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.main_server_url = main_server_url
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.algorithm = build_algorithm(config)
        self.num_classes = dataset_num_classes(config.data)
        self.input_shape = dataset_input_shape(config.data)
        self.model = build_model(config.model, self.num_classes, self.input_shape, seed=config.seed)
        self.num_blocks = len(self.model.blocks)
        self.algorithm.bind_model(self.model)
        self.profile = profile_model(self.model, config.model)
        self.test_set = load_dataset(config.data)[1]
        self.devices = DeviceRegistry(config.data.num_devices)
        self.table = ClientTimeTable(len(self.model.split_points), config.split.smoothing)
        self.planner = SplitPlanner(self.algorithm.split_mode(), self.model.split_points, self.num_blocks, self.profile,
                                    self.table, self.devices, config.train.local_epochs, config.split.server_flops)
        self.rng = random.Random(config.seed)
        self.round: FedRound | None = None
        self.rounds_done = 0
        self.history: list[dict] = []
        self.finished = False
        self.started_at: float | None = None
        self.cumulative_bytes = 0
        initial_acc, initial_loss = evaluate(self.model, self.test_set)
        self.initial = {"test_accuracy": initial_acc, "test_loss": initial_loss}
        run_dir.write_config(config, self.run_id)

    # --- devices ------------------------------------------------------------------------------
    def register(self, req: RegisterRequest) -> RegisterResponse:
        record = self.devices.register(req)
        log.info("registered %s (shard %d, %d samples, %s)", req.device_id, req.shard, req.num_samples, req.profile.kind)
        return RegisterResponse(run_id=self.run_id, device_id=record.device_id, shard=record.shard)

    def run_info(self) -> RunInfo:
        """The run's model and data spec, so a device can load its shard before registering."""
        return RunInfo(run_id=self.run_id, algorithm=self.config.algorithm, model=self.config.model,
                       num_classes=self.num_classes, input_shape=list(self.input_shape),
                       data=self.config.data, seed=self.config.seed)

    def ready(self) -> bool:
        """Rounds start once every shard of the run has a registered device."""
        return len(self.devices) >= self.config.data.num_devices

    # --- round lifecycle ----------------------------------------------------------------------
    def begin_round(self) -> FedRound:
        """Select devices and split points for the next round."""
        if self.started_at is None:
            self.started_at = time.monotonic()
        round_id = self.rounds_done + 1
        selected = self.algorithm.select_devices(round_id, self.devices.ids(), self.config.per_round, self.rng)
        splits = self.planner.choose(round_id, selected)
        self.round = FedRound(
            round_id=round_id, split_mode=self.planner.mode,
            assignments={d: Assignment(d, k, j) for d, (j, k) in splits.items()},
            deadline_s=self.config.deadlines.round_s,
        )
        log.info("round %d: %d devices, splits %s", round_id, len(selected), {d: a.split_point for d, a in self.round.assignments.items()})
        return self.round

    def round_plan(self, fed_round: FedRound) -> RoundPlan:
        """What the Main Server needs: participants, splits, and the server-side weights."""
        start = min(a.split_point for a in fed_round.assignments.values())
        return RoundPlan(
            run_id=self.run_id, round_id=fed_round.round_id, model=self.config.model, num_classes=self.num_classes,
            input_shape=list(self.input_shape), seed=self.config.seed,
            participants=[Participant(device_id=d, split_point=a.split_point, num_samples=max(1, self.devices.devices[d].num_samples))
                          for d, a in sorted(fed_round.assignments.items())],
            server_weights=encode_state(portion_state(self.model, start, self.num_blocks)), train=self.config.train,
            grouping=self.algorithm.grouping(), group_size=self.config.grouping.group_size,
            group_loss=self.config.grouping.group_loss, join_deadline_s=self.config.deadlines.join_s,
            step_deadline_s=self.config.deadlines.step_s,
        )

    def task_for(self, device_id: str) -> TaskResponse:
        """A polling device's next instruction."""
        self.devices.get(device_id)
        if self.finished:
            # Every device, selected or not, receives the final global model.
            return TaskResponse(status="done", num_blocks=self.num_blocks,
                                weights=encode_state(portion_state(self.model, 0, self.num_blocks)))
        fed_round = self.round
        if fed_round is None or not fed_round.ready or device_id not in fed_round.assignments:
            return TaskResponse(status="wait")
        if fed_round.follow_ups is not None:
            return self._follow_up_for(fed_round, device_id)
        assignment = fed_round.assignments[device_id]
        if assignment.dispatched_at is not None:  # one task per device and round
            return TaskResponse(status="wait")
        assignment.dispatched_at = time.monotonic()
        return TaskResponse(
            status="train", round_id=fed_round.round_id, split_point=assignment.split_point, num_blocks=self.num_blocks,
            weights=encode_state(portion_state(self.model, 0, assignment.split_point)), train=self.config.train,
            main_server_url=self.main_server_url if fed_round.uses_main_server else None,
            deadline_s=self._remaining(fed_round), half_precision=self.config.half_precision,
            algorithm=self.config.algorithm, params=self.algorithm.device_params(),
            extras=self.algorithm.task_extras(device_id, fed_round.round_id), report=self.algorithm.needs_report,
        )

    def _follow_up_for(self, fed_round: FedRound, device_id: str) -> TaskResponse:
        assert fed_round.follow_ups is not None
        if device_id not in fed_round.follow_ups or device_id in fed_round.follow_ups_sent:
            return TaskResponse(status="wait")
        fed_round.follow_ups_sent.add(device_id)
        return TaskResponse(status="train", phase="follow_up", round_id=fed_round.round_id,
                            deadline_s=self._remaining(fed_round), algorithm=self.config.algorithm,
                            extras=fed_round.follow_ups[device_id])

    @staticmethod
    def _remaining(fed_round: FedRound) -> float:
        return max(1.0, fed_round.deadline_s - (time.monotonic() - fed_round.started_at))

    def accept_report(self, round_id: int, req: ReportRequest) -> Ack:
        """Two-phase algorithms: a device's post-training report."""
        if req.round_id != round_id:
            raise ApiError(422, f"body round_id {req.round_id} does not match the path's round {round_id}")
        self.devices.get(req.device_id)
        fed_round = self._open_round(round_id)
        if not self.algorithm.needs_report:
            raise ApiError(409, f"algorithm {self.config.algorithm} takes no reports")
        if req.device_id not in fed_round.assignments:
            raise ApiError(403, f"device {req.device_id!r} was not selected for round {round_id}")
        if req.device_id in fed_round.reports:
            raise ApiError(409, f"round {round_id} already has the report of {req.device_id!r}")
        if fed_round.follow_ups is not None:
            raise ApiError(409, f"reports for round {round_id} are closed")
        fed_round.reports[req.device_id] = dict(req.extras)
        return Ack(detail=f"report of {req.device_id} for round {round_id} stored")

    def plan_follow_ups(self, fed_round: FedRound) -> None:
        """Close reporting: devices that did not report are dropped; the algorithm answers the rest."""
        fed_round.excluded |= set(fed_round.assignments) - set(fed_round.reports)
        try:
            fed_round.follow_ups = self.algorithm.plan_follow_ups(fed_round.round_id, fed_round.reports)
        except ValueError as exc:
            log.error("round %d: follow-ups could not be planned: %s", fed_round.round_id, exc)
            fed_round.follow_ups = {}
            fed_round.excluded |= set(fed_round.assignments)

    def _open_round(self, round_id: int) -> FedRound:
        if self.round is None or self.round.round_id != round_id:
            current = self.round.round_id if self.round else None
            raise ApiError(409, f"round {round_id} is not open (open round: {current})")
        return self.round

    def _decode(self, weights, start: int, end: int) -> dict[str, torch.Tensor]:
        try:
            return decode_portion(weights, self.model, start, end)
        except WireError as exc:
            raise ApiError(422, str(exc)) from None

    def accept_update(self, round_id: int, req: UpdateRequest, body_bytes: int) -> Ack:
        """A device's trained portion. Fully checked before it is stored."""
        if req.round_id != round_id:
            raise ApiError(422, f"body round_id {req.round_id} does not match the path's round {round_id}")
        self.devices.get(req.device_id)
        fed_round = self._open_round(round_id)
        assignment = fed_round.assignments.get(req.device_id)
        if assignment is None:
            raise ApiError(403, f"device {req.device_id!r} was not selected for round {round_id}")
        if req.device_id in fed_round.updates:
            raise ApiError(409, f"round {round_id} already has the update of {req.device_id!r}")
        if self.algorithm.needs_report and req.device_id not in fed_round.follow_ups_sent:
            raise ApiError(409, f"device {req.device_id!r} must report and receive its follow-up before uploading")
        state = self._decode(req.weights, 0, assignment.split_point)
        try:
            self.algorithm.accept_update(req.device_id, round_id, state, dict(req.extras), req.num_samples,
                                         self.model.state_dict())
        except ValueError as exc:
            raise ApiError(422, f"extras: {exc}") from None
        fed_round.updates[req.device_id] = ReceivedUpdate(req, state, body_bytes)
        return Ack(detail=f"update of {req.device_id} for round {round_id} stored")

    def accept_portion(self, round_id: int, upload: ServerPortionUpload, body_bytes: int) -> Ack:
        """A group's trained server-side copy from the Main Server."""
        if upload.round_id != round_id or upload.run_id != self.run_id:
            raise ApiError(409, f"portion for run {upload.run_id} round {upload.round_id} does not belong to the open round")
        fed_round = self._open_round(round_id)
        if not fed_round.uses_main_server:
            raise ApiError(409, f"round {round_id} does not use the Main Server")
        members = set(upload.members) | set(upload.dropped)
        unknown = (members | set(upload.absent)) - set(fed_round.assignments)
        if unknown:
            raise ApiError(422, f"group members {sorted(unknown)} are not participants of round {round_id}")
        if upload.group_id in fed_round.portions:
            raise ApiError(409, f"group {upload.group_id} of round {round_id} was already received")
        splits = [fed_round.assignments[m].split_point for m in members]
        if splits and upload.start_block > min(splits):
            raise ApiError(422, f"portion starts at block {upload.start_block}, after a member's split point {min(splits)}")
        state = self._decode(upload.weights, upload.start_block, self.num_blocks)
        fed_round.portions[upload.group_id] = ReceivedPortion(upload, state, body_bytes)
        return Ack(detail=f"group {upload.group_id} of round {round_id} stored")

    def close_round(self) -> FedRound:
        """Stop accepting uploads for the open round (called on the event loop)."""
        if self.round is None:
            raise RuntimeError("no open round")
        fed_round, self.round = self.round, None
        return fed_round

    def finish_round(self, fed_round: FedRound) -> dict:
        """Aggregate (Algorithm 1), update the time table, evaluate, record. CPU work: run off the loop."""
        dropped = fed_round.dropped()
        contributions: dict[str, Contribution] = {}
        for device, update in sorted(fed_round.updates.items()):
            if device in dropped:
                continue
            portion = fed_round.group_of(device) if fed_round.uses_main_server else None
            contributions[device] = Contribution(weight=update.request.num_samples, client_state=update.state,
                                                 server_state=portion.state if portion else None)
        used = list(contributions)
        extras = {d: dict(fed_round.updates[d].request.extras) for d in used}
        failed = not contributions
        aggregation_s = 0.0
        if not failed:
            started = time.perf_counter()
            new_state = self.algorithm.aggregate(fed_round.round_id, self.model.state_dict(), contributions, extras)
            self.model.load_state_dict(new_state)
            aggregation_s = time.perf_counter() - started
        for device in used:
            assignment = fed_round.assignments[device]
            timings = fed_round.updates[device].request.timings
            if assignment.candidate is not None:
                self.table.record(device, assignment.candidate, table_time(timings))
        accuracy, loss = evaluate(self.model, self.test_set)
        self.rounds_done = fed_round.round_id
        duration = time.monotonic() - fed_round.started_at
        record = self._round_record(fed_round, used, dropped, failed, accuracy, loss, duration)
        record["aggregation_s"] = aggregation_s
        record["algorithm_metrics"] = {**self.algorithm.round_metrics(fed_round.round_id, extras),
                                       **self.algorithm.evaluate(self.model)}
        self.history.append(record)
        self.run_dir.append_metrics(record)
        self.run_dir.write_checkpoint(self.rounds_done, self.model.state_dict(),
                                      {"run_id": self.run_id, "algorithm_state": self.algorithm.state_dict(),
                                       "time_table": {d: {str(j): t for j, t in row.items()} for d, row in self.table.entries().items()}})
        if self.rounds_done >= self.config.rounds:
            self.finished = True
            self.run_dir.write_summary(self.summary())
        return record

    def _round_record(self, fed_round: FedRound, used: list[str], dropped: set[str], failed: bool,
                      accuracy: float, loss: float, duration: float) -> dict:
        updates = fed_round.updates
        up = sum(u.request.bytes_up + u.body_bytes for u in updates.values())
        down = sum(u.request.bytes_down for u in updates.values()) + fed_round.task_bytes
        server = fed_round.plan_bytes + sum(p.body_bytes for p in fed_round.portions.values())
        self.cumulative_bytes += up + down + server
        total_samples = sum(updates[d].request.num_samples for d in used) or 1
        train_loss = sum(updates[d].request.train_loss * updates[d].request.num_samples for d in used) / total_samples
        missing = sorted(set(fed_round.assignments) - set(updates) - dropped)
        return {
            "round": fed_round.round_id,
            "algorithm": self.config.algorithm,
            "status": "failed" if failed else "ok",
            "test_accuracy": accuracy,
            "test_loss": loss,
            "train_loss": train_loss if used else None,
            "round_time_s": duration,
            "elapsed_s": time.monotonic() - (self.started_at or fed_round.started_at),
            "selected": sorted(fed_round.assignments),
            "aggregated": used,
            "dropped": sorted(dropped | set(missing)),
            "split_points": {d: a.split_point for d, a in sorted(fed_round.assignments.items())},
            "device_times": {d: u.request.timings.model_dump() for d, u in sorted(updates.items())},
            "device_kinds": {d: self.devices.devices[d].kind for d in sorted(fed_round.assignments)},
            "groups": [{"group_id": p.upload.group_id, "members": p.upload.members, "dropped": p.upload.dropped,
                        "label_distance": p.upload.label_distance, "start_block": p.upload.start_block,
                        "train_time_s": p.upload.train_time_s} for _, p in sorted(fed_round.portions.items())],
            "bytes_up": up,
            "bytes_down": down,
            "bytes_server": server,
            "bytes_total": up + down + server,
            "cumulative_bytes": self.cumulative_bytes,
            "plan_error": fed_round.plan_failed,
        }

    def summary(self) -> dict:
        """What the run achieved, for ``summary.json`` and the testbed's final line."""
        ok = [r for r in self.history if r["status"] == "ok"]
        accs = [r["test_accuracy"] for r in self.history]
        times = [r["round_time_s"] for r in self.history]
        return {
            "run_id": self.run_id,
            "algorithm": self.config.algorithm,
            "model": self.config.model,
            "rounds": self.rounds_done,
            "failed_rounds": len(self.history) - len(ok),
            "initial_accuracy": self.initial["test_accuracy"],
            "final_accuracy": accs[-1] if accs else None,
            "best_accuracy": max(accs) if accs else None,
            "final_loss": self.history[-1]["test_loss"] if self.history else None,
            "median_round_time_s": statistics.median(times) if times else None,
            "total_time_s": self.history[-1]["elapsed_s"] if self.history else 0.0,
            "total_bytes": self.cumulative_bytes,
            "finished": self.finished,
        }

    def global_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()
