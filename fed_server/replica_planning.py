"""The Main Server replicas as the Fed Server sees them (docs/deployment.md, "Main Server
replicas"): each attempt's round plans and which replica holds which group, the replicas that are
down, and what a replica's watch stream says (members dropped, all groups ended, the replica lost).

With one replica it groups the devices that join, as in the paper; with several, the Fed Server
forms each attempt's groups and spreads them over the replicas.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from fed_server.fed_round import FedRound
from fed_server.run_core import RunCore
from shared.algorithms.grouping import GroupCandidate, form_round_groups
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
    """Plans for, and bookkeeping of, the Main Server replicas at ``main_server_urls``."""

    def __init__(self, core: RunCore, main_server_urls: Sequence[str] | None, input_shape: tuple[int, ...],
                 num_classes: int) -> None:
        self.core = core
        self.urls = list(dict.fromkeys(main_server_urls or []))
        self.input_shape = input_shape
        self.num_classes = num_classes
        # Replicas that refused the last plan sent to them or were lost during an attempt: their
        # plans get a single try (a dead replica must not cost the plan retries every round).
        self.down: set[str] = set()

    @property
    def groups_at_fed_server(self) -> bool:
        """Several replicas: groups must be known before tasks go out, to tell each device its
        replica, so the Fed Server forms them (from label counts sent at registration)."""
        return len(self.urls) > 1

    def live(self) -> int:
        """Configured replicas that accepted their last plan and were not lost since."""
        return len(set(self.urls) - self.down)

    def plan_tries(self, url: str, retries: int) -> int:
        """How often a plan is tried on ``url``: once for a replica that is down, else ``retries``."""
        return 1 if url in self.down else retries

    def plan_answered(self, url: str, accepted: bool) -> None:
        """Replica ``url`` accepted its plan (it is up) or did not (it is down)."""
        if accepted:
            self.down.discard(url)
        else:
            self.down.add(url)

    def plans(self, fed_round: FedRound, live: Sequence[str]) -> dict[str, RoundPlan]:
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
            devices = self.core.devices
            # As the round plan describes each participant to the Main Server (round_plan), so the
            # groups are those one replica would form from the same devices' joins.
            members = {d: GroupCandidate.of(devices.label_counts(d), a.split_point, devices.weight(d))
                       for d, a in fed_round.assignments.items()}
            groups = form_round_groups(build_grouping(self.core.algorithm.grouping()), members,
                                       config.grouping.group_size, config.seed, fed_round.round_id)
            fed_round.planned_groups = dict(enumerate(groups))
        return [fed_round.planned_groups[g] for g in range(len(fed_round.planned_groups))]

    def round_plan(self, fed_round: FedRound, members: Sequence[str],
                   groups: list[PlannedGroup] | None = None) -> RoundPlan:
        """What one Main Server needs: its participants (``members``), their splits, the groups
        when the Fed Server formed them, and the server-side weights from their smallest split."""
        core, config = self.core, self.core.config
        start = min(fed_round.assignments[d].split_point for d in members)
        return RoundPlan(
            run_id=core.run_id, round_id=fed_round.round_id, round_index=fed_round.index, model=config.model,
            model_params=config.model_params, num_classes=self.num_classes,
            input_shape=list(self.input_shape), seed=config.seed,
            participants=[Participant(device_id=d, split_point=fed_round.assignments[d].split_point,
                                      num_samples=core.devices.weight(d),
                                      token_nonce=fed_round.assignments[d].token_nonce,
                                      download_s=fed_round.assignments[d].download_s)
                          for d in members],
            server_weights=encode_state(portion_state(core.model, start, core.num_blocks)), train=config.train,
            grouping=core.algorithm.grouping(), group_size=config.grouping.group_size,
            group_loss=config.grouping.group_loss, member_defences=config.grouping.member_defences,
            member_defence_params=config.grouping.member_defence_params, join_deadline_s=config.deadlines.join_s,
            step_deadline_s=config.deadlines.step_s, groups=groups,
            patience=config.deadlines.patience, patience_grace_s=config.deadlines.patience_grace_s,
            max_activation=config.grouping.max_activation,
        )

    def lost(self, fed_round: FedRound, url: str, reason: str) -> None:
        """Replica ``url`` is gone during the open attempt (its watch stream broke or fell silent):
        its devices whose group portion has not arrived are excluded, so the attempt completes with
        the other replicas' groups (or fails below the quorum and is retried, the usual rules).
        Groups it already uploaded stay. Nothing for a closed attempt or a replica already lost."""
        if self.core.round is not fed_round or url in fed_round.lost_replicas:
            return
        fed_round.lost_replicas.append(url)
        self.down.add(url)
        log.warning("round %d (attempt %d): Main Server replica %s lost (%s)", fed_round.index, fed_round.round_id,
                    url, reason)
        self._exclude_without_portion(fed_round, url, f"its Main Server replica {url} was lost ({reason})")

    def done(self, fed_round: FedRound, url: str, undelivered: Sequence[int]) -> None:
        """Replica ``url`` says every group of the open attempt has ended (its watch stream's
        ``done`` line, sent after each group's portion upload ended): its devices that no stored
        portion covers will get none, so they are taken out now, not at the round deadline.
        ``undelivered``: the groups whose portion it could not deliver (named in the reason)."""
        if self.core.round is not fed_round:
            return
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

    def _exclude_without_portion(self, fed_round: FedRound, url: str, reason: str) -> None:
        """Take out replica ``url``'s devices of the attempt that no stored group portion covers:
        groups it already uploaded stay."""
        mine = {d for d, a in fed_round.assignments.items() if a.main_server_url == url}
        self.core.exclude(fed_round, mine - fed_round.covered_by_portions(), reason)

    def portion_replicas(self, fed_round: FedRound, group_id: int) -> list[str]:
        """The replicas a group portion of the attempt may come from: its planned replica, or with
        one replica every replica the attempt's devices went to."""
        if fed_round.planned_groups is not None:
            return [fed_round.group_replica[group_id]]
        return fed_round.replicas()
