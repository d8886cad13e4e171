"""One round at the Fed Server: who was selected, where each is cut, what has come back."""
from __future__ import annotations

import math
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fed_server.update_checks import table_time
from shared.algorithms.base import Payload, RoundContext
from shared.errors import Invalid
from shared.schemas import ServerPortionUpload, UpdateRequest

if TYPE_CHECKING:
    from fed_server.secure_stages import SecureRound


#: Why a device left an attempt when the attempt waited a deadline for it (``FedRound.left``).
NEVER_JOINED = "never joined a group at the Main Server"
NO_REPORT = "no report by the report deadline"
NO_UPLOAD = "no upload by the round deadline"
OVERDUE = "no upload by its own deadline"   # fed_server/device_pace.py
#: Why a device that registered again during an attempt left it: its agent restarted (or it
#: re-registers on purpose), so the task it took will never be uploaded, and before it took one
#: the Main Server's plan holds its previous enrolment. Once it had taken its task the attempt may
#: have waited for it, so that counts as a missed deadline.
REENROLLED_AFTER_TASK = "registered again after taking its task"
REENROLLED = "registered again before taking its task"
MISSED_DEADLINE = frozenset({NEVER_JOINED, NO_REPORT, NO_UPLOAD, OVERDUE, REENROLLED_AFTER_TASK})
#: How the reasons of a device that withdrew, and of one the Main Server dropped, begin.
WITHDREW = "withdrew: "
DROPPED_AT_MAIN_SERVER = "dropped by the Main Server from group "
#: Why a device left an attempt unfinished that shows it takes at least as long as the attempt had
#: waited for it (``FedRound.cut_short``): a deadline of either server passed for it. A withdrawal
#: and a drop by the Main Server count too (they begin as above): a join or a step past the Main
#: Server's deadline ends so; one that comes early for another reason bounds the device's time by
#: the few seconds it was waited for, which teaches the time table nothing.
CUT_SHORT = frozenset({NEVER_JOINED, NO_REPORT, NO_UPLOAD, OVERDUE})


@dataclass
class Assignment:
    """A selected device's task: its split (block count and candidate index), the Main Server
    replica that holds its group (None until the plans went out, and for split depth zero), and
    the nonce of the device's enrolment when the attempt began: the one the Main Server's plan
    carries, so a device that enrols again during the attempt cannot take part in it there."""

    device_id: str
    split_point: int
    candidate: int | None
    token_nonce: str | None = None
    dispatched_at: float | None = None
    main_server_url: str | None = None
    #: Seconds its client portion is expected to take to download (None: link rate not known).
    download_s: float | None = None


@dataclass
class ReceivedUpdate:
    request: UpdateRequest
    state: dict[str, torch.Tensor]
    body_bytes: int
    extras: Payload   # request.extras validated as the algorithm's UploadExtras
    #: Seconds the upload took to arrive, timed by the Fed Server (http_api.server.arrival_seconds).
    upload_s: float = 0.0
    #: When it was stored (monotonic): the end of the device's round as the Fed Server saw it.
    arrived_at: float = field(default_factory=time.monotonic)

    @property
    def round_time(self) -> float:
        """What the device's round cost it, for the time table (:func:`table_time`)."""
        return table_time(self.request.timings, self.upload_s)


@dataclass
class ReceivedPortion:
    upload: ServerPortionUpload
    state: dict[str, torch.Tensor]
    body_bytes: int
    #: With ``member_updates``: each member's own state of the copy, which its device is
    #: aggregated with instead of the group's (shared/algorithms/member_defence.py).
    member_states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: When it was stored (monotonic): when the Fed Server learnt of the members the group dropped.
    arrived_at: float = field(default_factory=time.monotonic)

    def server_state(self, device_id: str) -> dict[str, torch.Tensor]:
        """The server-side state ``device_id`` is aggregated with: its own, or its group's copy."""
        return self.member_states.get(device_id, self.state)


def check_body_round(body_round_id: int, round_id: int) -> None:
    """Invalid unless a body's ``round_id`` is its path's: a message meant for another attempt."""
    if body_round_id != round_id:
        raise Invalid(f"body round_id {body_round_id} does not match the path's round {round_id}")


@dataclass
class FedRound:
    """Bookkeeping of the open round; decisions are made by the coordinator and the algorithm.

    ``index`` is the logical round (1..rounds); ``round_id`` identifies this *attempt* on the wire
    and is never reused, so uploads for a failed attempt, or from before a restart, are stale.
    """

    round_id: int
    index: int
    split_mode: str
    assignments: dict[str, Assignment]
    deadline_s: float
    report_deadline_s: float     # two-phase algorithms: when reporting closes (seconds after the start)
    # The devices selected over those they were selected from (what a private round spends).
    sample_rate: float = 0.0
    started_at: float = field(default_factory=time.monotonic)
    updates: dict[str, ReceivedUpdate] = field(default_factory=dict)
    portions: dict[int, ReceivedPortion] = field(default_factory=dict)
    task_bytes: int = 0
    plan_bytes: int = 0
    plan_failed: str | None = None
    ready: bool = False          # tasks are handed out only once the Main Server accepted the plan
    ready_at: float | None = None   # when the tasks went out (monotonic)
    closed_at: float | None = None  # when it stopped accepting uploads (monotonic)
    # Two-phase algorithms: reports, the follow-up instructions once planned, who got theirs.
    reports: dict[str, Payload] = field(default_factory=dict)
    follow_ups: dict[str, Payload] | None = None
    follow_ups_sent: set[str] = field(default_factory=set)
    # Taken out of the attempt by the Fed Server, each with why (no report, a refused upload, a
    # withdrawal, dropped at the Main Server, no group portion): the attempt waits for none of them.
    excluded: dict[str, str] = field(default_factory=dict)
    excluded_at: dict[str, float] = field(default_factory=dict)   # when each was taken out (monotonic)
    # Several Main Server replicas: the groups the Fed Server formed (group id -> members) and the
    # replica each one went to; None with one replica (it forms the groups from the joins).
    planned_groups: dict[int, list[str]] | None = None
    group_replica: dict[int, str] = field(default_factory=dict)
    lost_replicas: list[str] = field(default_factory=list)   # replicas lost during this attempt, in order
    # Replicas that failed during this attempt (lost, or silent past a heartbeat), each with what
    # happened: their devices' missed deadlines in it are the replica's, not the devices'.
    failed_replicas: dict[str, str] = field(default_factory=dict)
    # When each replica's watch stream last spoke in this attempt (monotonic), and the replicas
    # whose stream ended with ``done``: what tells that a replica was alive at a given moment.
    heard: dict[str, float] = field(default_factory=dict)
    finished_replicas: set[str] = field(default_factory=set)
    # Devices selected while a replica lost in an earlier attempt may still hold them (selected only
    # to reach the quorum), each with that replica: a deadline they miss is the replica's.
    held_by: dict[str, str] = field(default_factory=dict)
    # Secure aggregation's stages (secure_aggregation.enabled): the uploads are masked words.
    secure: SecureRound | None = None

    @property
    def context(self) -> RoundContext:
        """The algorithm hooks' view of this attempt: logical round and attempt id."""
        return RoundContext(index=self.index, attempt=self.round_id)

    @property
    def uses_main_server(self) -> bool:
        return self.split_mode != "zero"

    def dropped_at_main_server(self) -> set[str]:
        return {d for p in self.portions.values() for d in (*p.upload.dropped, *p.upload.absent)}

    def covered_by_portions(self) -> set[str]:
        """Devices some stored group portion accounts for (as a member, dropped or absent)."""
        return {d for p in self.portions.values() for d in (*p.upload.members, *p.upload.dropped, *p.upload.absent)}

    def dropped(self) -> set[str]:
        """Selected devices that will not be aggregated: dropped by either server."""
        return self.dropped_at_main_server() | set(self.excluded)

    def exclude(self, devices: Iterable[str], reason: str) -> set[str]:
        """Take selected ``devices`` out of the attempt for ``reason``; the ones newly taken out.
        A device keeps the first reason it was taken out for: that is what stopped it."""
        new = {d for d in devices if d in self.assignments and d not in self.excluded}
        now = time.monotonic()
        for device in sorted(new):
            self.excluded[device] = reason
            self.excluded_at[device] = now
        return new

    def left(self, used: Collection[str]) -> dict[str, str]:
        """Why each selected device that is not in ``used`` (the aggregated ones) was left out."""
        at_main_server: dict[str, str] = {}
        for group_id, portion in sorted(self.portions.items()):
            for device in portion.upload.dropped:
                at_main_server.setdefault(device, f"{DROPPED_AT_MAIN_SERVER}{group_id}")
            for device in portion.upload.absent:
                at_main_server.setdefault(device, NEVER_JOINED)
        missing = "no Main Server replica accepted the round plan" if self.plan_failed is not None else NO_UPLOAD
        # Every uploader that is not aggregated was dropped by one server or the other, so a
        # device with neither reason never uploaded.
        left = {d: self.excluded.get(d) or at_main_server.get(d) or missing
                for d in sorted(set(self.assignments) - set(used))}
        for device, why in left.items():   # a deadline a failed replica made it miss is the replica's
            url = self.assignments[device].main_server_url
            if why not in MISSED_DEADLINE:
                continue
            if url in self.failed_replicas:
                left[device] = f"its Main Server replica {url} {self.failed_replicas[url]}"
            elif device in self.held_by:
                left[device] = f"still held by Main Server replica {self.held_by[device]}, lost in an earlier attempt"
        return left

    def missed_deadline(self, used: Collection[str]) -> set[str]:
        """The selected devices the attempt had to wait a deadline for: they never joined their
        group, never reported or never uploaded (:data:`MISSED_DEADLINE`), their replica alive."""
        return {d for d, why in self.left(used).items() if why in MISSED_DEADLINE}

    def cut_short(self, used: Collection[str]) -> dict[str, float]:
        """The selected devices that left the attempt unfinished at a deadline (:data:`CUT_SHORT`),
        withdrew or were dropped by the Main Server, each with the seconds the attempt had waited for
        it when it left: its round at its split takes at least that (a censored entry of the time
        table, fed_server/time_table.py). A device the Main Server left out is known to have left
        when its group's portion arrived; a device still awaited, when the attempt closed."""
        out: dict[str, float] = {}
        for device, why in self.left(used).items():
            if why in CUT_SHORT or why.startswith((WITHDREW, DROPPED_AT_MAIN_SERVER)):
                out[device] = max(0.0, self._left_at(device) - self.wait_began(device))
        return out

    def _left_at(self, device_id: str) -> float:
        """When the attempt stopped waiting for a device that never uploaded (monotonic)."""
        if device_id in self.excluded_at:
            return self.excluded_at[device_id]
        for portion in self.portions.values():
            if device_id in portion.upload.dropped or device_id in portion.upload.absent:
                return portion.arrived_at
        return self.closed_at if self.closed_at is not None else time.monotonic()

    def unconfirmed_misses(self, now: float) -> dict[str, float]:
        """Per Main Server replica, the latest moment one of its devices missed a deadline (taken
        out for one, or still awaited ``now``, when the attempt ends), for the replicas not known to
        have been alive then (:meth:`replica_known_at`): their failure may yet explain the miss."""
        misses: dict[str, float] = {}
        waiting = self.waiting()
        for device, assignment in self.assignments.items():
            url = assignment.main_server_url
            if url is None:
                continue
            if device in waiting:
                at = now
            elif self.excluded.get(device) in MISSED_DEADLINE:
                at = self.excluded_at[device]
            else:
                continue
            misses[url] = max(at, misses.get(url, at))
        return {url: at for url, at in misses.items() if not self.replica_known_at(url, at)}

    def replica_known_at(self, url: str, at: float) -> bool:
        """Whether replica ``url``'s state at the moment ``at`` is known: its watch stream spoke at or
        after it, or ended with ``done``, or the replica failed in this attempt."""
        return (url in self.failed_replicas or url in self.finished_replicas
                or self.heard.get(url, -math.inf) >= at)

    def wait_began(self, device_id: str) -> float:
        """When the attempt began waiting for the device's upload: when it took its task, or when
        the tasks went out for one that has not asked for it."""
        assignment = self.assignments[device_id]
        return assignment.dispatched_at or self.ready_at or self.started_at

    def waiting(self) -> dict[str, tuple[int, float]]:
        """The selected devices whose upload is still awaited: device -> (split point, when the
        wait began)."""
        dropped = self.dropped()
        return {d: (a.split_point, self.wait_began(d)) for d, a in self.assignments.items()
                if d not in self.updates and d not in dropped}

    def upload_seconds(self, device_id: str) -> float:
        """Seconds from the device's task to its stored upload."""
        return self.updates[device_id].arrived_at - self.wait_began(device_id)

    def table_parts(self, device_id: str) -> tuple[float, float]:
        """(transfer, compute) seconds of the device's round time as the client time table takes
        them: its own transfer figures plus its upload, and its compute, each counting at most the
        round's time on the Fed Server's clock."""
        update = self.updates[device_id]
        seconds = update.round_time
        transfer_s = min(update.request.timings.transfer_s + update.upload_s, self.upload_seconds(device_id), seconds)
        return transfer_s, min(update.request.timings.compute_s, seconds - transfer_s)

    def replicas(self) -> list[str]:
        """The Main Server replicas this attempt's devices were sent to, in first-use order."""
        return list(dict.fromkeys(a.main_server_url for a in self.assignments.values() if a.main_server_url))

    def all_reported(self) -> bool:
        """Every selected device reported or was taken out of the attempt (two-phase algorithms)."""
        return all(d in self.reports or d in self.excluded for d in self.assignments)

    def portion_of(self, device_id: str) -> ReceivedPortion | None:
        """The stored group portion that ``device_id`` is a member of; None before it arrived."""
        for portion in self.portions.values():
            if device_id in portion.upload.members:
                return portion
        return None

    def reenrolled(self, device_id: str) -> str | None:
        """Why ``device_id``, which registered again just now, leaves this attempt; None where it
        stays (not a participant, already out or uploaded, or at split depth zero before its task:
        it takes its task with its new token)."""
        assignment = self.assignments.get(device_id)
        if assignment is None or device_id in self.excluded or device_id in self.updates:
            return None
        if assignment.dispatched_at is not None:
            return REENROLLED_AFTER_TASK
        return REENROLLED if self.uses_main_server else None

    def remaining_s(self) -> float:
        """Seconds a task sent now has until the attempt's deadline (at least one)."""
        return max(1.0, self.deadline_s - (time.monotonic() - self.started_at))

    def complete(self) -> bool:
        """Every selected device has uploaded or was dropped, and every uploader's group is back
        (or the Main Server refused the plan, which ends the round at once as failed)."""
        if self.plan_failed is not None:
            return True
        dropped = self.dropped()
        for device in self.assignments:
            if device not in self.updates and device not in dropped:
                return False
        if self.uses_main_server:
            return all(self.portion_of(d) is not None for d in self.updates if d not in dropped)
        return True

    def deadline(self) -> float:
        """The monotonic time at which the attempt closes with whatever arrived."""
        return self.started_at + self.deadline_s

    def report_deadline(self) -> float:
        """The monotonic time at which reporting closes (two-phase algorithms)."""
        return self.started_at + min(self.report_deadline_s, self.deadline_s)
