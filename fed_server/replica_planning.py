"""The Main Server replicas as the Fed Server sees them (docs/deployment.md, "Main Server
replicas"): each attempt's round plans and which replica holds which group, the replicas set aside
until they answer their health check, the devices a lost replica may still hold, and what a
replica's watch stream says (it spoke, members dropped, all groups ended, the replica lost).

With one replica it groups the devices that join, as in the paper; with several, the Fed Server
forms each attempt's groups and spreads them over the replicas.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence

from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from fed_server.split_planner import SplitPlanner
from shared.algorithms.grouping import form_round_groups, group_candidate
from shared.algorithms.registry import build_grouping
from shared.portions import portion_state
from shared.schemas import Participant, PlannedGroup, RoundPlan
from shared.wire import encode_state

log = logging.getLogger("fed_server")



def spread_groups(loads: Sequence[int], replicas: int) -> list[int]:
    """The replica (index into ``replicas`` live ones) of each group, by longest processing time
    first: the group with the largest load (members' total samples) goes first, to the least
    loaded replica; ties by group index, then by replica index. Deterministic.

    Why LPT: a replica's round lasts as long as its groups' steps; samples stand in for steps
    (every member runs ``local_epochs * ceil(samples / batch)``), and LPT keeps the largest
    replica within 4/3 of the best spread without a search.
    """
    if replicas < 1:
        raise ValueError(f"need at least one replica, got {replicas}")
    placed = [0] * len(loads)
    totals = [0] * replicas
    for g in sorted(range(len(loads)), key=lambda g: (-loads[g], g)):
        target = min(range(replicas), key=lambda r: (totals[r], r))
        placed[g] = target
        totals[target] += loads[g]
    return placed


def groups_per_replica(groups: Sequence[Sequence[str]], loads: Sequence[int], replicas: int) -> list[dict[int, list[str]]]:
    """Each replica's groups (group id -> members, in id order) when ``groups`` (their index is
    their id) are spread by :func:`spread_groups`; a replica may get none. What the Fed Server
    plans for its replicas, and what benchmark (c) does in its place."""
    mine: list[dict[int, list[str]]] = [{} for _ in range(replicas)]
    for g, replica in enumerate(spread_groups(loads, replicas)):
        mine[replica][g] = list(groups[g])
    return mine


class ReplicaPlanning:
    """Plans for, and bookkeeping of, the Main Server replicas at ``main_server_urls``; ``planner``
    gives each participant's split and, with its time table, its measured round times.

    ``device_urls``: the address the devices reach each replica at, one per URL of
    ``main_server_urls`` in the same order, where it is not the one this server uses (devices
    outside a cluster whose replicas this server reaches by their in-cluster names); None: the
    same. A replica is known by its ``main_server_urls`` entry everywhere but in the tasks
    (:meth:`device_url`)."""

    def __init__(self, core: RunCore, main_server_urls: Sequence[str] | None, input_shape: tuple[int, ...],
                 num_classes: int, planner: SplitPlanner, device_urls: Sequence[str] | None = None) -> None:
        self.core = core
        self.planner = planner
        self.urls = list(dict.fromkeys(main_server_urls or []))
        if device_urls and len(device_urls) != len(main_server_urls or []):
            raise ValueError(f"{len(device_urls)} Main Server URLs for the devices (--main-server-public-url) for "
                             f"{len(main_server_urls or [])} replicas (--main-server-url): give one per replica, "
                             f"in the same order")
        self._device_urls = dict(zip(main_server_urls or [], device_urls or main_server_urls or []))
        self.input_shape = input_shape
        self.num_classes = num_classes
        #: Replicas set aside, each with why: they did not accept a plan, or were lost during an
        #: attempt. No attempt is planned onto one until it answers its health check (:meth:`back`).
        self.down: dict[str, str] = {}
        #: Called with a replica's URL when it is set aside (the round driver probes its health).
        self.on_set_aside: Callable[[str], None] | None = None
        #: Devices that had taken their task on a replica when it was lost: device -> (the replica,
        #: when). Their calls to it may hang until it answers or their task's deadline passes, so
        #: they are not selected until they call the Fed Server again (:meth:`free`).
        self.held: dict[str, tuple[str, float]] = {}

    def device_url(self, url: str) -> str:
        """The address a device is told for replica ``url`` (its task's ``main_server_url``)."""
        return self._device_urls.get(url, url)

    @property
    def groups_at_fed_server(self) -> bool:
        """Several replicas: groups must be known before tasks go out, to tell each device its
        replica, so the Fed Server forms them (from label counts sent at registration)."""
        return len(self.urls) > 1

    def available(self) -> list[str]:
        """The configured replicas an attempt may be planned onto: those not set aside, in order."""
        return [url for url in self.urls if url not in self.down]

    def live(self) -> int:
        """How many replicas are not set aside."""
        return len(self.available())

    def set_aside(self, url: str, why: str) -> None:
        """Plan no attempt onto replica ``url`` until it answers its health check (:meth:`back`):
        a replica that did not accept a plan or was lost would otherwise cost every later attempt
        its timeout. Nothing for a replica already set aside."""
        if url in self.down:
            return
        self.down[url] = why
        log.warning("Main Server replica %s set aside (%s): no attempt is planned onto it until it answers its "
                    "health check", url, why)
        if self.on_set_aside is not None:
            self.on_set_aside(url)

    def back(self, url: str) -> None:
        """Replica ``url`` answered its health check: the next attempts are planned onto it again."""
        if self.down.pop(url, None) is not None:
            log.info("Main Server replica %s answers its health check again: attempts are planned onto it again", url)
            self.core.changed.set()   # a plan phase waiting for a replica goes on

    def free(self, devices: Sequence[str]) -> list[str]:
        """``devices`` less those a lost replica may still hold (:attr:`held`), unless fewer than
        the quorum would be left: then all of them (an attempt of fewer would fail anyway, and a
        deadline a held one misses is not charged: :meth:`plans` marks them). A held device is free
        again once it has called the Fed Server since (asked for work, uploaded, registered): its
        call to the lost replica has ended."""
        registry = self.core.devices.devices
        for device, (_, since) in list(self.held.items()):
            record = registry.get(device)
            if record is None or record.last_seen > since:
                del self.held[device]
        free = [d for d in devices if d not in self.held]
        return free if len(free) >= self.core.config.deadlines.min_participants else list(devices)

    def plans(self, fed_round: FedRound, live: Sequence[str]) -> dict[str, RoundPlan]:
        """The round plan of each replica in ``live`` that gets devices, and every assignment's
        replica. Called again with fewer replicas when one refused its plan: the groups stay, their
        spread is redone.

        One replica: one plan with every participant and no groups (the Main Server groups, as in
        the paper). Several: the groups are formed here, once per attempt, by the one grouping
        function the Main Server uses (same plug-in, group size and rng), from the label counts
        sent at registration and what the plans say of each participant (:meth:`participant`), and
        spread by :func:`groups_per_replica` (largest first, to the least loaded replica).
        """
        if not live:
            raise ValueError("no live Main Server replica to plan for")
        fed_round.held_by.update((d, self.held[d][0]) for d in fed_round.assignments if d in self.held)
        if len(self.urls) == 1:
            for assignment in fed_round.assignments.values():
                assignment.main_server_url = live[0]
            return {live[0]: self.round_plan(fed_round, sorted(fed_round.assignments))}
        planned = self._planned_groups(fed_round)
        loads = [sum(self.core.devices.weight(m) for m in members) for members in planned]
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

    def _planned_groups(self, fed_round: FedRound) -> list[list[str]]:
        """The attempt's groups in id order, formed at its first plan."""
        if fed_round.planned_groups is None:
            config = self.core.config
            # From the participant entries the plans carry, as the Main Server builds them from the
            # joins, so the groups are those one replica would form from the same devices' joins.
            members = {d: group_candidate(self.participant(fed_round, d), self.core.devices.label_counts(d))
                       for d in fed_round.assignments}
            groups = form_round_groups(build_grouping(self.core.algorithm.grouping()), members,
                                       config.grouping.group_size, config.seed, fed_round.index)
            fed_round.planned_groups = dict(enumerate(groups))
        return [fed_round.planned_groups[g] for g in range(len(fed_round.planned_groups))]

    def participant(self, fed_round: FedRound, device: str) -> Participant:
        """How a round plan describes ``device``, a participant of ``fed_round``, to the Main Server:
        what its checks need (split, samples, token nonce, download time) and everything else the
        Fed Server knows of the device that a grouping may use (kind, its time table row by split
        point, its measured link rate; shared/algorithms/grouping.py, ``group_candidate``)."""
        assignment = fed_round.assignments[device]
        devices, planner = self.core.devices, self.planner
        record = devices.devices.get(device)
        times = ((planner.split_points[j], planner.table.get(device, j)) for j in range(len(planner.split_points)))
        return Participant(device_id=device, split_point=assignment.split_point, num_samples=devices.weight(device),
                           token_nonce=assignment.token_nonce, download_s=assignment.download_s,
                           kind=record.kind if record is not None else None,
                           round_times=[(split, t) for split, t in times if t is not None],
                           link_rate=devices.measured_rate(device))

    def round_plan(self, fed_round: FedRound, members: Sequence[str],
                   groups: list[PlannedGroup] | None = None) -> RoundPlan:
        """What one Main Server needs: its participants (``members``), their splits, the groups
        when the Fed Server formed them, and the server-side weights from their smallest split (to
        the devices' head in U-shaped mode)."""
        core, config = self.core, self.core.config
        start = min(fed_round.assignments[d].split_point for d in members)
        return RoundPlan(
            run_id=core.run_id, round_id=fed_round.round_id, round_index=fed_round.index, model=config.model,
            model_params=config.model_params, num_classes=self.num_classes,
            input_shape=list(self.input_shape), seed=config.seed,
            participants=[self.participant(fed_round, d) for d in members],
            server_weights=encode_state(portion_state(core.model, start, core.head_start)), train=config.train,
            grouping=core.algorithm.grouping(), group_size=config.grouping.group_size,
            group_loss=config.grouping.group_loss, member_defences=config.grouping.member_defences,
            member_defence_params=config.grouping.member_defence_params, join_deadline_s=config.deadlines.join_s,
            step_deadline_s=config.deadlines.step_s, groups=groups,
            patience=config.deadlines.patience, patience_grace_s=config.deadlines.patience_grace_s,
            ignore_slowest=config.deadlines.ignore_slowest,
            max_activation=config.grouping.max_activation,
            head_start=core.head_start if core.head_start < core.num_blocks else None,
        )

    def heard(self, fed_round: FedRound, url: str, gap_s: float, silent_s: float) -> None:
        """A line of replica ``url``'s watch stream of the open attempt arrived, ``gap_s`` after the
        one before (or the stream's start). A gap over ``silent_s`` (missed heartbeats: frozen for a
        while, or cut off) is a failure of the replica: its devices' missed deadlines in this
        attempt are not theirs (:meth:`FedRound.left`)."""
        if self.core.round is not fed_round:
            return
        fed_round.heard[url] = time.monotonic()
        if gap_s > silent_s and url not in fed_round.failed_replicas:
            fed_round.failed_replicas[url] = f"fell silent for {gap_s:.1f}s"
            log.warning("round %d (attempt %d): Main Server replica %s fell silent for %.1fs; no device of it is "
                        "charged a missed deadline in this attempt", fed_round.index, fed_round.round_id, url, gap_s)
        self.core.changed.set()

    def lost(self, fed_round: FedRound, url: str, reason: str) -> None:
        """Replica ``url`` is gone during the open attempt (its watch stream broke or fell silent):
        its devices whose group portion has not arrived are excluded, so the attempt completes with
        the other replicas' groups (or fails below the quorum and is retried, the usual rules), and
        none of its devices is charged a missed deadline in it. Groups it already uploaded stay. The
        replica is set aside, and the excluded devices that had taken their task are held
        (:attr:`held`). Nothing for a closed attempt or a replica already lost."""
        if self.core.round is not fed_round or url in fed_round.lost_replicas:
            return
        fed_round.lost_replicas.append(url)
        fed_round.failed_replicas[url] = f"was lost ({reason})"
        label = f"round {fed_round.index} (attempt {fed_round.round_id})"
        log.warning("%s: Main Server replica %s lost (%s)", label, url, reason)
        uncovered = self._exclude_without_portion(fed_round, url, f"its Main Server replica {url} was lost ({reason})")
        stranded = sorted(d for d in uncovered if fed_round.assignments[d].dispatched_at is not None
                          and d not in fed_round.updates)
        now = time.monotonic()
        self.held.update((d, (url, now)) for d in stranded)
        if stranded:
            log.warning("%s: %s took their task on Main Server replica %s: not selected until they call the Fed "
                        "Server again", label, ", ".join(stranded), url)
        self.core.changed.set()   # a close waiting to know whether the replica was alive goes on
        self.set_aside(url, f"lost in {label}")

    def done(self, fed_round: FedRound, url: str, undelivered: Sequence[int]) -> None:
        """Replica ``url`` says every group of the open attempt has ended (its watch stream's
        ``done`` line, sent after each group's portion upload ended): its devices that no stored
        portion covers will get none, so they are taken out now, not at the round deadline.
        ``undelivered``: the groups whose portion it could not deliver (named in the reason)."""
        if self.core.round is not fed_round:
            return
        fed_round.finished_replicas.add(url)
        why = f" (groups {sorted(undelivered)} could not be delivered)" if undelivered else ""
        self._exclude_without_portion(fed_round, url, f"its group portion never arrived{why}")

    def dropped(self, fed_round: FedRound, url: str, dropped: Mapping[str, str]) -> None:
        """Replica ``url`` dropped these members of the open attempt (each with why, from its watch
        stream): they cannot be aggregated, so the attempt stops waiting for them. A replica speaks
        only for the devices planned on it."""
        if self.core.round is not fed_round:
            return
        for device, why in sorted(dropped.items()):
            assignment = fed_round.assignments.get(device)
            if assignment is not None and assignment.main_server_url == url:
                self.core.exclude(fed_round, [device], f"dropped by the Main Server: {why}")

    def _exclude_without_portion(self, fed_round: FedRound, url: str, reason: str) -> set[str]:
        """Take out replica ``url``'s devices of the attempt that no stored group portion covers:
        groups it already uploaded stay. Returns those devices, taken out now or before."""
        mine = {d for d, a in fed_round.assignments.items() if a.main_server_url == url}
        uncovered = mine - fed_round.covered_by_portions()
        self.core.exclude(fed_round, uncovered, reason)
        return uncovered

    def portion_replicas(self, fed_round: FedRound, group_id: int) -> list[str]:
        """The replicas a group portion of the attempt may come from: its planned replica, or with
        one replica every replica the attempt's devices went to."""
        if fed_round.planned_groups is not None:
            return [fed_round.group_replica[group_id]]
        return fed_round.replicas()
