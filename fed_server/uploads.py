"""What devices and the Main Server send into the open attempt: two-phase reports and their
follow-ups, trained client portions, withdrawals and group portions, each fully checked before it
is stored. A device whose own upload is refused is taken out of the attempt."""
from __future__ import annotations

import logging

import torch

from fed_server.fed_round import (
    NO_REPORT, OVERDUE, WITHDREW, FedRound, ReceivedPortion, ReceivedUpdate, check_body_round,
)
from fed_server.replica_planning import ReplicaPlanning
from fed_server.run_core import RunCore
from fed_server.update_checks import check_claims
from shared.privacy.clipping import clip_update, update_norm
from shared.algorithms.base import parse_payload, trainable_parameters
from shared.algorithms.registry import uploads_member_states
from shared.algorithms.two_phase import TwoPhaseAlgorithm, two_phase
from shared.errors import Conflict, Invalid, NotAllowed
from shared.portions import decode_device_portion, decode_portion
from shared.schemas import Ack, ReportRequest, ServerPortionUpload, UpdateRequest, WithdrawRequest
from shared.secagg.protocol import masked_layout
from shared.wire import WireError, decode_state

log = logging.getLogger("fed_server")


class Uploads:
    """Checks and stores what arrives for the open attempt."""

    def __init__(self, core: RunCore, replicas: ReplicaPlanning) -> None:
        self.core = core
        self.replicas = replicas

    def _selected(self, round_id: int, device_id: str, report: bool = False) -> FedRound:
        """The open attempt ``round_id``, which selected the registered ``device_id``. ``report``:
        what is sent is a report, which only two-phase algorithms take."""
        self.core.devices.get(device_id)
        fed_round = self.core.open_round(round_id)
        if report:
            self._two_phase()
        if device_id not in fed_round.assignments:
            raise NotAllowed(f"device {device_id!r} was not selected for round {round_id}")
        return fed_round

    def accept_report(self, round_id: int, req: ReportRequest) -> Ack:
        """Two-phase algorithms: a device's post-training report."""
        check_body_round(req.round_id, round_id)
        fed_round = self._selected(round_id, req.device_id, report=True)
        if req.device_id in fed_round.reports:
            raise Conflict(f"round {round_id} already has the report of {req.device_id!r}")
        if fed_round.follow_ups is not None:
            raise Conflict(f"reports for round {round_id} are closed")
        fed_round.reports[req.device_id] = parse_payload(self._two_phase().Report, req.extras, "report")
        self.core.changed.set()
        return Ack(detail=f"report of {req.device_id} for round {round_id} stored")

    def cut_overdue(self, fed_round: FedRound, now: float) -> float:
        """Take out of the attempt every awaited device past its own deadline
        (:mod:`fed_server.device_pace`); the earliest own deadline of those still awaited
        (``inf``: none has one). Event loop."""
        registry, dropped = self.core.devices, fed_round.dropped()
        finishers = [(fed_round.upload_seconds(d), registry.work(d)) for d in fed_round.updates
                     if d in registry.devices and d not in dropped]
        waiting = fed_round.waiting()
        due = self.core.pace.deadlines(waiting, finishers, len(waiting) + len(finishers), registry.work)
        overdue = sorted(d for d, at in due.items() if at <= now)
        if overdue:
            self.core.exclude(fed_round, overdue, OVERDUE, tell_main_server=True)
        return min((at for d, at in due.items() if at > now), default=float("inf"))

    def _two_phase(self) -> TwoPhaseAlgorithm:
        """The run's algorithm as a two-phase one; Conflict when it takes no reports."""
        phases = two_phase(self.core.algorithm)
        if phases is None:
            raise Conflict(f"algorithm {self.core.config.algorithm} takes no reports")
        return phases

    def plan_follow_ups(self, fed_round: FedRound) -> None:
        """Close reporting: devices that did not report are dropped; the algorithm answers the rest."""
        core = self.core
        phases = self._two_phase()
        core.exclude(fed_round, set(fed_round.assignments) - set(fed_round.reports), NO_REPORT)
        try:
            fed_round.follow_ups = phases.plan_follow_ups(fed_round.context, fed_round.reports)
        except ValueError as exc:
            log.error("round %d (attempt %d): follow-ups could not be planned: %s", fed_round.index,
                      fed_round.round_id, exc)
            fed_round.follow_ups = {}
            core.exclude(fed_round, fed_round.assignments, f"follow-ups could not be planned: {exc}")
        core.post_work()

    def _decode(self, weights, start: int, end: int) -> dict[str, torch.Tensor]:
        try:
            return decode_portion(weights, self.core.model, start, end)
        except WireError as exc:
            raise Invalid(str(exc)) from None

    def _checked_update(self, device_id: str, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Apply ``updates.max_norm``: refuse (422) or clip an update that is too large."""
        limit = self.core.config.updates.max_norm
        if limit is None:
            return state
        global_state = self.core.model.state_dict()
        norm = update_norm(state, global_state)
        if norm <= limit:
            return state
        if self.core.config.updates.action == "reject":
            raise Invalid(f"update norm {norm:.4g} of {device_id!r} exceeds updates.max_norm={limit:.4g}")
        log.warning("clipping the update of %s from norm %.4g to %.4g", device_id, norm, limit)
        return clip_update(state, global_state, limit, norm)

    def accept_update(self, round_id: int, req: UpdateRequest, body_bytes: int, upload_s: float = 0.0) -> Ack:
        """A device's trained portion. Fully checked before it is stored. ``upload_s``: how long
        its body took to arrive (part of the device's round time)."""
        check_body_round(req.round_id, round_id)
        fed_round = self._selected(round_id, req.device_id)
        if req.device_id in fed_round.updates:
            # A retried upload (the first answer was lost): accepted once, acknowledged again.
            return Ack(detail=f"update of {req.device_id} for round {round_id} was already stored")
        if req.device_id in fed_round.excluded:
            raise Conflict(f"device {req.device_id!r} was taken out of round {round_id}: "
                           f"{fed_round.excluded[req.device_id]}")
        if fed_round.secure is not None and (fed_round.secure.sharers is None or fed_round.secure.plan is not None
                                             or req.device_id not in fed_round.secure.sharers):
            raise Conflict(f"device {req.device_id!r} may upload a masked update only after sharing its secrets, "
                           f"before the unmasking stage of round {round_id}")
        if two_phase(self.core.algorithm) is not None and req.device_id not in fed_round.follow_ups_sent:
            raise Conflict(f"device {req.device_id!r} must report and receive its follow-up before uploading")
        try:
            fed_round.updates[req.device_id] = self._checked(fed_round, req, body_bytes, upload_s)
        except Invalid as refused:
            # The device's own upload is unusable and it has no other for this attempt: waiting for
            # it would hold every other device to the round deadline.
            self.core.exclude(fed_round, [req.device_id], f"upload refused: {refused.detail}", tell_main_server=True)
            raise
        self.core.changed.set()
        return Ack(detail=f"update of {req.device_id} for round {round_id} stored")

    def _checked(self, fed_round: FedRound, req: UpdateRequest, body_bytes: int, upload_s: float) -> ReceivedUpdate:
        """``req`` as it will be aggregated, once its claims, weights and extras passed; Invalid if not."""
        core = self.core
        check_claims(req, core.devices.devices[req.device_id].num_samples, fed_round.deadline_s)
        if fed_round.secure is not None:
            return self._checked_masked(fed_round, req, body_bytes, upload_s)
        split_point = fed_round.assignments[req.device_id].split_point
        head_start = core.head_start if fed_round.uses_main_server else core.num_blocks
        try:
            weights = decode_device_portion(req.weights, core.model, split_point, head_start)
        except WireError as exc:
            raise Invalid(str(exc)) from None
        state = self._checked_update(req.device_id, weights)
        extras = parse_payload(core.algorithm.UploadExtras, req.extras, "extras",
                               trainable_parameters(core.model.device_portion(split_point, head_start)))
        try:
            core.algorithm.accept_update(req.device_id, fed_round.context, state, extras, req.num_samples,
                                         core.model.state_dict())
        except ValueError as exc:
            raise Invalid(f"extras: {exc}") from None
        core.record_state(fed_round, f"{req.device_id}-upload", state)
        return ReceivedUpdate(req, state, body_bytes, extras, upload_s)

    def _checked_masked(self, fed_round: FedRound, req: UpdateRequest, body_bytes: int, upload_s: float
                        ) -> ReceivedUpdate:
        """A securely aggregated attempt's upload: every entry of the blocks the device masks
        (``[0, masked split)``: ``SecureRound.splits``, and U-shaped its head) as masked 64-bit words (int64 on the wire),
        which is all the Fed Server keeps of it; Invalid if not."""
        core, secure = self.core, fed_round.secure
        assert secure is not None
        if req.extras:
            raise Invalid("a masked update carries no extras")
        portion = core.device_portion(secure.splits[req.device_id])
        try:
            words = decode_state(req.weights, expect=masked_layout(portion), what="masked weights")
        except WireError as exc:
            raise Invalid(str(exc)) from None
        core.record_state(fed_round, f"{req.device_id}-upload", words)
        return ReceivedUpdate(req, words, body_bytes, core.algorithm.UploadExtras(), upload_s)

    def withdraw(self, round_id: int, req: WithdrawRequest) -> Ack:
        """A selected device cannot contribute to the open attempt (a task it cannot build or decode,
        a group that dropped it): it is taken out at once, so the attempt does not wait for its
        upload. Idempotent; Conflict, changing nothing, once its update is stored or for an
        attempt that is not open; NotAllowed for a device that was not selected."""
        check_body_round(req.round_id, round_id)
        fed_round = self._selected(round_id, req.device_id)
        if req.device_id in fed_round.updates:
            raise Conflict(f"the update of {req.device_id!r} for round {round_id} is already stored")
        self.core.exclude(fed_round, [req.device_id], f"{WITHDREW}{req.reason}", tell_main_server=True)
        return Ack(detail=f"{req.device_id} is out of round {round_id}: {fed_round.excluded[req.device_id]}")

    def accept_portion(self, round_id: int, upload: ServerPortionUpload, body_bytes: int) -> Ack:
        """A group's trained server-side copy from the Main Server."""
        core = self.core
        if upload.round_id != round_id or upload.run_id != core.run_id:
            raise Conflict(f"portion for run {upload.run_id} round {upload.round_id} does not belong to the open round")
        fed_round = core.open_round(round_id)
        if not fed_round.uses_main_server:
            raise Conflict(f"round {round_id} does not use the Main Server")
        members = self._check_group(fed_round, upload)
        splits = [fed_round.assignments[m].split_point for m in members]
        if splits and upload.start_block > min(splits):
            raise Invalid(f"portion starts at block {upload.start_block}, after a member's split point {min(splits)}")
        state = self._decode(upload.weights, upload.start_block, core.head_start)
        member_states = self._member_states(upload)
        core.record_state(fed_round, f"group-{upload.group_id}-portion", state)
        fed_round.portions[upload.group_id] = ReceivedPortion(upload, state, body_bytes, member_states)
        core.changed.set()
        return Ack(detail=f"group {upload.group_id} of round {round_id} stored")

    def _member_states(self, upload: ServerPortionUpload) -> dict[str, dict[str, torch.Tensor]]:
        """Each member's own state of the copy, checked as the copy is: exactly one per member
        where the run's member defences send them (``member_updates``), none otherwise."""
        wanted = uploads_member_states(self.core.config.grouping.member_defences)
        sent = set(upload.member_weights)
        if not wanted:
            if sent:
                raise Invalid("this run's member defences send no member states (grouping.member_defences)")
            return {}
        if sent != set(upload.members):
            raise Invalid(f"group {upload.group_id}: member states for {sorted(sent)}, where its members are "
                          f"{sorted(upload.members)}")
        return {d: self._decode(w, upload.start_block, self.core.head_start) for d, w in sorted(upload.member_weights.items())}

    def _check_group(self, fed_round: FedRound, upload: ServerPortionUpload) -> set[str]:
        """A group portion's members and dropped devices, once its group may come back: new, of
        this attempt's participants, as planned, from a replica not declared lost."""
        round_id = fed_round.round_id
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
        if any(r in fed_round.lost_replicas for r in self.replicas.portion_replicas(fed_round, upload.group_id)):
            # Its devices were excluded when the replica was declared lost: taking the portion now
            # would count a group the attempt already gave up.
            raise Conflict(f"group {upload.group_id} of round {round_id} belongs to a Main Server replica "
                           f"declared lost in this round")
        return members
