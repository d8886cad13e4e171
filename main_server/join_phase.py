"""The joins of one round at the Main Server: who joined with which label counts, who left before
the groups were formed, when the groups form, and which.

The groups form as soon as every participant has joined or left. Otherwise they form once each
missing participant is past its own join deadline (:mod:`shared.own_deadline`, counted from the
plan's arrival: once half have joined, a missing one is waited for ``patience`` times the larger
of the slowest join so far (leaving out the plan's ``ignore_slowest`` slowest), scaled up for a
larger portion to download, and its own portion's download time, plus ``patience_grace_s``), and at the latest at the plan's ``join_deadline_s``.
A participant whose download time the Fed Server could not estimate (no link rate known in its
round: a run's first round of real devices) has no own deadline: a slow link is then the likely
reason for a late join, and cutting it would cut it again in every round, never measured. A
participant still missing then is absent: it is grouped with nobody, and the Fed Server takes it
out as one that never joined, which counts as a missed deadline. Without this, one device that
takes its task and never joins would hold its whole round to ``join_deadline_s``.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from shared.algorithms.grouping import Grouping, form_round_groups, group_candidate
from shared.own_deadline import expected_seconds
from shared.schemas import JoinRequest, RoundPlan


class JoinPhase:
    """The joins of one round, and the moment its groups form (``on_close``, called once)."""

    def __init__(self, plan: RoundPlan, on_close: Callable[[], None]) -> None:
        self.plan = plan
        self.participants = {p.device_id: p for p in plan.participants}
        self.joined: dict[str, JoinRequest] = {}
        # Participants the Fed Server took out of the attempt before groups were formed, with why:
        # the join no longer waits for them and they are grouped with nobody.
        self.departed: dict[str, str] = {}
        self.closed = False
        #: Why the groups formed while participants were missing (for the log).
        self.why_missing = f"the join deadline ({plan.join_deadline_s:g} s) passed"
        self._on_close = on_close
        self._loop = asyncio.get_running_loop()
        self.opened = self._loop.time()
        self._join_s: dict[str, float] = {}
        self._deadline = self._loop.call_later(plan.join_deadline_s, self._close)
        self._own_deadline: asyncio.TimerHandle | None = None

    def join(self, req: JoinRequest) -> None:
        """Record a participant's join (already validated); may form the groups."""
        self.joined[req.device_id] = req
        self._join_s[req.device_id] = self._loop.time() - self.opened
        self._review()

    def depart(self, reasons: Mapping[str, str]) -> None:
        """The Fed Server took these participants out before the groups formed, each with why."""
        for device, reason in reasons.items():
            self.joined.pop(device, None)
            self._join_s.pop(device, None)
            self.departed.setdefault(device, reason)
        self._review()

    def missing(self) -> list[str]:
        """Participants that neither joined nor left."""
        return sorted(set(self.participants) - set(self.joined) - set(self.departed))

    def due(self) -> float | None:
        """When (loop time) every missing participant is past its own join deadline; None while
        one has none (fewer than half joined, ``patience`` is off, or its download time is not
        known) or nobody is missing."""
        patience = self.plan.patience
        missing = self.missing()
        if patience is None or not missing:
            return None
        finishers = [(self._join_s[d], self._download_s(d)) for d in self.joined]
        latest = 0.0
        for device in missing:
            download_s = self.participants[device].download_s
            if download_s is None:
                return None
            expected = expected_seconds(download_s, finishers, download_s, len(finishers) + len(missing),
                                        max_scale=patience, ignore_slowest=self.plan.ignore_slowest)
            if expected is None:
                return None
            latest = max(latest, patience * expected + self.plan.patience_grace_s)
        return self.opened + latest

    def groups(self, grouping: Grouping) -> list[tuple[int, list[str]]]:
        """(group id, members) of this round: the plan's groups (several replicas: formed by the
        Fed Server), less the members that never joined (absent, as with one replica); or the
        groups ``grouping`` forms from the joins (one replica, as in the paper)."""
        if self.plan.groups is not None:
            planned = [(g.group_id, [m for m in g.members if m in self.joined]) for g in self.plan.groups]
            return [(gid, members) for gid, members in planned if members]
        members = {d: group_candidate(self.participants[d], r.label_counts) for d, r in self.joined.items()}
        return list(enumerate(form_round_groups(grouping, members, self.plan.group_size, self.plan.seed,
                                                self.plan.round_index)))

    def cancel(self) -> None:
        """Stop the timers (the round was replaced); the groups will not form."""
        self.closed = True
        self._deadline.cancel()
        if self._own_deadline is not None:
            self._own_deadline.cancel()

    def _download_s(self, device: str) -> float:
        return self.participants[device].download_s or 0.0

    def _review(self) -> None:
        """Form the groups if nobody is missing or every missing one is past its own deadline;
        else wake at the moment they will be (a later join may move it)."""
        if self.closed:
            return
        if self._own_deadline is not None:
            self._own_deadline.cancel()
            self._own_deadline = None
        if not self.missing():
            self._close()
            return
        due = self.due()
        if due is None:
            return
        if self._loop.time() >= due:
            self.why_missing = f"past their own join deadline, {due - self.opened:.1f} s after the plan"
            self._close()
        else:
            self._own_deadline = self._loop.call_at(due, self._review)

    def _close(self) -> None:
        if self.closed:
            return
        self.cancel()
        self._on_close()
