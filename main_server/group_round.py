"""One round at the Main Server: the devices' joins, their groups, and each group's per-step
barrier, from the Fed Server's plan to the groups' server portions. What the plan builds is in
:mod:`main_server.round_plan`, one group's state and its timed step in :mod:`main_server.group`,
what each step must be before it joins a group's batch in :mod:`main_server.step_checks`.

The plan names the grouping and group-loss plug-ins (``shared/algorithms/registry.py``); this
module only runs them.

Waiting is async (the event loop stays free); training runs in a worker thread. Every request is
fully validated before it touches state, so a rejected request changes nothing.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, NoReturn

import torch

from main_server.group import Group, StepOutcome, TrainedStep, new_group, timed_step
from main_server.group_trainer import MemberBatch
from main_server.join_phase import JoinPhase
from main_server.metrics import MainMetrics
from main_server.round_plan import plan_model, server_weights
from main_server.step_checks import StepChecks
from shared.algorithms.registry import build_group_loss, build_grouping, build_member_defences
from shared.errors import Conflict, Failed, Invalid, NotFound
from shared.losses import build_loss, check_loss_origin, label_counts_problem
from shared.machine import release_free_memory
from shared.schemas import JoinRequest, JoinResponse, RoundPlan, StepRequest
from shared.round_label import round_label

log = logging.getLogger("main_server")


class GroupRound:
    """One round at the Main Server, from the Fed Server's plan to the groups' uploads.

    The template model, the plan's weights and the validation of every request stay on the CPU,
    where the wire delivers them; each group's copy trains on ``device`` (:class:`GroupTrainer`),
    in ``executor``'s threads (the Main Server's training workers; asyncio's default executor if
    None).
    """

    def __init__(self, plan: RoundPlan, on_group_done: Callable[["GroupRound", Group], Awaitable[None]],
                 metrics: MainMetrics | None = None, device: torch.device | None = None,
                 model_ref: str | None = None, executor: Executor | None = None, loss_ref: str | None = None) -> None:
        # Everything of the plan but its weights, which live in ``server_weights`` (views of the
        # plan's bytes) until the groups have loaded them into their copies (:meth:`_form_groups`).
        self.plan = plan.model_copy(update={"server_weights": {}})
        self.executor = executor
        self.metrics = metrics
        self.device = device
        self.round_id = plan.round_id
        #: How this round is named in the logs: ``round N (attempt A)`` (shared/round_label.py).
        self.label = round_label(plan.round_index, plan.round_id)
        self.participants = {p.device_id: p for p in plan.participants}
        try:
            self.grouping = build_grouping(plan.grouping)
            # The run's loss: an import path only when the operator named it (--loss), like a model.
            check_loss_origin(plan.train.loss, loss_ref)
            loss = build_loss(plan.train.loss, plan.train.task)
            self.group_loss = build_group_loss(plan.group_loss, loss)  # one instance serves every group
            self.defences = build_member_defences(plan.member_defences, plan.member_defence_params, self.group_loss)
        except ValueError as exc:
            log.error("refusing the plan of %s: %s", round_label(plan.round_index, plan.round_id), exc)
            raise Invalid(f"invalid plan: {exc}") from None
        self.template = plan_model(plan, model_ref)
        self.start, self.server_weights = server_weights(plan, self.template)
        #: What each step must be to join its group's batch.
        self.checks = StepChecks(self.plan, self.template)
        self.groups: list[Group] | None = None
        self.group_by_device: dict[str, Group] = {}
        self.groups_ready = asyncio.Event()
        self.on_group_done = on_group_done
        self.abandoned = False
        # Set once every group's portion went to the Fed Server (or the round was abandoned):
        # what ends a round watch stream (``MainServer.watch``).
        self.closed = asyncio.Event()
        # Every member dropped from its group so far, with why, and the groups whose portion did
        # not reach the Fed Server: what the watch stream reports (docs/api.md).
        self.dropped: dict[str, str] = {}
        self.undelivered: list[int] = []
        self._changed = asyncio.Event()
        self._uploads_left: int | None = None
        self._tasks: set[asyncio.Task] = set()
        #: The joins, and when the groups form (:mod:`main_server.join_phase`).
        self.joins = JoinPhase(self.plan, self._form_groups)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, holding the task until it ends (the loop keeps only weak
        references to tasks, so an unreferenced one may be collected before it finishes)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- joining and grouping -------------------------------------------------------------------
    async def join(self, req: JoinRequest) -> JoinResponse:
        """Record a device's label counts; answer once groups are formed."""
        if req.device_id not in self.participants:
            raise NotFound(f"device {req.device_id!r} is not a participant of round {self.round_id}")
        problem = label_counts_problem(len(req.label_counts), self.plan.num_classes, self.plan.train.resolved_task)
        if problem is not None:
            raise Invalid(problem)
        if req.device_id in self.joins.departed:
            raise Conflict(f"device {req.device_id!r} left round {self.round_id}: {self.joins.departed[req.device_id]}")
        if self.groups is not None:
            group = self.group_by_device.get(req.device_id)
            if group is None:
                raise Conflict(f"device {req.device_id!r} joined after the join deadline of round {self.round_id}")
            return self._join_answer(group)
        self.joins.join(req)
        await self.groups_ready.wait()
        if self.abandoned:
            raise Conflict(f"round {self.round_id} was abandoned")
        group = self.group_by_device.get(req.device_id)
        if group is None:   # it left the round while it waited for the groups
            raise Conflict(f"device {req.device_id!r} left round {self.round_id}: {self.joins.departed[req.device_id]}")
        return self._join_answer(group)

    def depart(self, reasons: Mapping[str, str]) -> None:
        """The Fed Server took these participants out of the attempt (a refused upload, a
        withdrawal), each with why: the round stops waiting for them. Before the groups are formed
        they are grouped with nobody (and the groups form at once if everyone else has joined);
        after, each leaves its group's barrier as a dropped member. NotFound, changing nothing,
        for a device that is no participant; a device already done or dropped stays as it is."""
        unknown = sorted(set(reasons) - set(self.participants))
        if unknown:
            raise NotFound(f"{unknown} are not participants of round {self.round_id}")
        if self.abandoned:
            return
        if self.groups is None:
            log.info("%s: %s left before the groups were formed", self.label, sorted(reasons))
            self.joins.depart(reasons)
            return
        for device, reason in sorted(reasons.items()):
            group = self.group_by_device.get(device)
            if group is None or device in group.done or device in group.dropped:
                continue
            waiting = group.pending.pop(device, None)
            if waiting is not None and not waiting[1].done():
                waiting[1].set_exception(Conflict(f"device {device!r} left round {self.round_id}: {reason}"))
            self._drop(group, {device: f"taken out by the Fed Server: {reason}"}, cause="departed")

    def _join_answer(self, group: Group) -> JoinResponse:
        return JoinResponse(group_id=group.group_id, members=group.members, label_distance=group.distance)

    def _form_groups(self) -> None:
        if self.groups is not None or self.abandoned:
            return
        self.joins.cancel()
        self.groups = []
        planned = self.joins.groups(self.grouping)
        self._uploads_left = len(planned)
        if not planned:
            self._close()
        for gid, members in planned:
            group = new_group(gid, [self.participants[m] for m in members], [self.joins.joined[m] for m in members],
                              self.template, self.server_weights, self.plan.train, self.group_loss, self.device,
                              self.defences)
            self.groups.append(group)
            for m in members:
                self.group_by_device[m] = group
            self._arm_step_timer(group)
        self.server_weights = {}   # loaded into every group's copy: the plan's bytes can go, and their pages
        release_free_memory()
        missing = self.joins.missing()
        if self.metrics is not None:
            self.metrics.groups_formed_with([g.distance for g in self.groups], len(missing))
        if missing:
            log.warning("%s: %d device(s) never joined (%s): %s", self.label, len(missing), self.joins.why_missing,
                        missing)
        log.info("%s: %d group(s) %s", self.label, len(self.groups),
                 [(g.members, round(g.distance, 3)) for g in self.groups])
        self.groups_ready.set()

    # --- the per-step barrier -------------------------------------------------------------------
    def validate_step(self, req: StepRequest) -> tuple[Group, MemberBatch]:
        """Check that a step request is this member's next step (:meth:`stepping_group`) and fits
        the round (:meth:`StepChecks.decode_batch`), without side effects. Its values are checked
        by :meth:`StepChecks.harmful_values`."""
        group = self.stepping_group(req)
        return group, self.checks.decode_batch(req, group.split[req.device_id])

    def stepping_group(self, req: StepRequest) -> Group:
        """The group of the step's sender if the step is its next one: NotFound for a stranger,
        Conflict for a member that may not send this step now (not joined, dropped, done, out of
        order, a duplicate). Nothing of the step's content is read."""
        group = self.group_by_device.get(req.device_id)
        if group is None:
            if req.device_id in self.participants:
                raise Conflict(f"device {req.device_id!r} has not joined round {self.round_id} (or joined too late)")
            raise NotFound(f"device {req.device_id!r} is not a participant of round {self.round_id}")
        if req.device_id in group.dropped:
            raise Conflict(f"device {req.device_id!r} was dropped from round {self.round_id}: {self.dropped[req.device_id]}")
        if req.device_id in group.done:
            raise Conflict(f"device {req.device_id!r} has already sent all its {group.num_steps[req.device_id]} steps")
        if req.step != group.step:
            raise Conflict(f"step {req.step} is out of order: the group is at step {group.step}")
        if req.device_id in group.pending or req.device_id in group.training:
            raise Conflict(f"step {req.step} of {req.device_id!r} was already received")
        return group

    async def step(self, req: StepRequest) -> StepOutcome:
        """Wait at the group's barrier for this step, train the copy once, return this device's dfx.

        A member's step that does not fit the group's batch (:meth:`StepChecks.decode_batch`: its
        encoding, dtypes or shapes) or whose values are harmful (:meth:`StepChecks.harmful_values`) drops its sender
        from the group (Invalid): left in it, the member would hold the barrier until the step
        deadline, as it could never send a step that fits; the others go on without it at this
        step. A request that is not the member's next step (:meth:`stepping_group`) drops nobody."""
        group = self.stepping_group(req)
        try:
            batch = self.checks.decode_batch(req, group.split[req.device_id])
        except Invalid as exc:
            self._refuse_step(group, req, exc.detail)
        harm = self.checks.harmful_values(batch)
        if harm is not None:
            self._refuse_step(group, req, harm)
        arrived = time.monotonic()
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        group.pending[req.device_id] = (batch, future, arrived)
        self._release(group)
        return await future

    def _refuse_step(self, group: Group, req: StepRequest, why: str) -> NoReturn:
        """Drop the step's sender from its group for ``why`` and refuse the step (Invalid)."""
        reason = f"step {req.step} refused: {why}"
        self._drop(group, {req.device_id: reason}, cause="checks")
        raise Invalid(f"{reason}; device {req.device_id!r} is dropped from round {self.round_id}")

    def _drop(self, group: Group, reasons: Mapping[str, str], cause: str) -> None:
        """Take members out of their group for the rest of the round, each with why (``cause``:
        see :meth:`MainMetrics.members_dropped`); the watch stream reports them at once, and the
        group goes on without them (its barrier may now be complete, or nobody may be left)."""
        for device, reason in reasons.items():
            log.warning("%s group %d: dropping %s: %s", self.label, group.group_id, device, reason)
            group.dropped.add(device)
            group.trainer.leave(device)   # the group trains on as if formed without it
            self.dropped[device] = reason
        if self.metrics is not None:
            self.metrics.members_dropped(cause, len(reasons))
        self._announce()
        self._release(group)

    def _release(self, group: Group) -> None:
        """Train the group's step once every member still owing it has sent it; finish the group
        once nobody owes a step. Nothing while a step trains (its end does this)."""
        if group.running or group.finished or self.abandoned:
            return
        if group.pending and group.expected() <= set(group.pending):
            self._spawn(self._run_step(group))
        elif not group.pending:
            self._check_finished(group)

    def changed(self) -> asyncio.Event:
        """An event set at the next change the watch stream reports (a member dropped, the round
        closed); take it before reading the state, so no change is missed."""
        return self._changed

    def _announce(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _close(self) -> None:
        self.closed.set()
        self._announce()
        # Every group's copy was freed once its portion was encoded (or the round was replaced):
        # the pages go back now, not at some later allocation.
        release_free_memory()

    def _arm_step_timer(self, group: Group) -> None:
        if group.timer is not None:
            group.timer.cancel()
        step = group.step
        group.timer = asyncio.get_running_loop().call_later(
            self.plan.step_deadline_s, lambda: self._on_deadline(group, step))

    def _on_deadline(self, group: Group, step: int) -> None:
        if group.finished or group.running or group.step != step or self.abandoned:
            return
        late = group.expected() - set(group.pending)
        if late:
            reason = f"missed the deadline of step {step} ({self.plan.step_deadline_s:g} s)"
            self._drop(group, {d: reason for d in sorted(late)}, cause="deadline")
        else:
            self._release(group)

    async def _run_step(self, group: Group) -> None:
        if group.running or not group.pending:
            return
        group.running = True
        if group.timer is not None:
            group.timer.cancel()
        pending, group.pending = group.pending, {}
        group.training = set(pending)
        step = group.step
        try:
            # In device order, not arrival order: the union batch, and so the step, is then the same
            # whatever order the members' requests came in (a replay, or a run with replicas,
            # trains the same copy bit for bit).
            batches = [pending[d][0] for d in sorted(pending)]
            # Ready group steps queue for the training workers first come, first served: a group's
            # step waits only for the steps that were ready before it. That wait counts as the
            # members' wait at the Main Server (wait_s), not as the step's server time.
            trained = await asyncio.get_running_loop().run_in_executor(
                self.executor, timed_step, group.trainer, batches)
        except Exception as exc:  # a training failure must not leave devices hanging, nor the group
            log.exception("%s group %d: step %d failed", self.label, group.group_id, step)
            if self.metrics is not None:
                self.metrics.step_failed()
            trained = TrainedStep(0.0, 0.0, {}, {d: Failed(f"server-side training of step {step} failed: {exc}")
                                                 for d in pending})
            cause = "failed_step"
        else:
            cause = "non_finite"
        finally:
            group.running = False
            group.training = set()
        if trained.results:
            self._answer(group, {d: pending[d] for d in trained.results}, trained)
        for device, error in trained.refused.items():
            fut = pending[device][1]
            if not fut.done():
                fut.set_exception(type(error)(f"{error.detail}; device {device!r} is dropped from round {self.round_id}"))
        if trained.refused:
            self._drop(group, {d: error.detail for d, error in trained.refused.items()}, cause=cause)
        if not self._check_finished(group):
            self._arm_step_timer(group)

    def _answer(self, group: Group, members: dict[str, tuple[MemberBatch, asyncio.Future, float]],
                trained: TrainedStep) -> None:
        """The step trained on ``members``: count it, advance the group, answer each its dfx."""
        server_s = trained.ended - trained.started
        group.train_time_s += server_s
        if self.metrics is not None:
            self.metrics.step_trained(
                server_s, fastest_wait_s=trained.started - min(arrived for _, _, arrived in members.values()),
                activation_bytes=sum(b.fx.numel() * b.fx.element_size() for b, _, _ in members.values()),
                gradient_bytes=sum(r.dfx.numel() * r.dfx.element_size() for r in trained.results.values()))
        group.step += 1
        for device, (_, fut, arrived) in members.items():
            if group.num_steps[device] <= group.step:
                group.done.add(device)
            if not fut.done():
                fut.set_result(StepOutcome(trained.results[device], wait_s=max(0.0, trained.started - arrived),
                                           server_s=server_s))

    def _check_finished(self, group: Group) -> bool:
        if group.finished:
            return True
        if all(m in group.done or m in group.dropped for m in group.members):
            group.finished = True
            if group.timer is not None:
                group.timer.cancel()
            if self.metrics is not None:
                self.metrics.group_finished(group.train_time_s)
            if not self.abandoned:
                self._spawn(self._upload(group))
            return True
        return False

    async def _upload(self, group: Group) -> None:
        """Hand a finished group to ``on_group_done`` (the upload); the last one closes the round."""
        try:
            await self.on_group_done(self, group)
        except Exception as exc:   # its members cannot be aggregated: the watch's done line says so
            log.error("%s group %d: server portion not delivered: %s", self.label, group.group_id, exc)
            self.undelivered.append(group.group_id)
        finally:
            assert self._uploads_left is not None
            self._uploads_left -= 1
            if self._uploads_left == 0:
                self._close()

    def abandon(self) -> None:
        """A newer plan replaced this round: release everyone who is waiting."""
        self.abandoned = True
        self.joins.cancel()
        self.groups_ready.set()
        self._close()
        for group in self.groups or []:
            if group.timer is not None:
                group.timer.cancel()
            for _, fut, _ in group.pending.values():
                if not fut.done():
                    fut.set_exception(Conflict(f"round {self.round_id} was replaced by a newer round"))
            group.pending = {}

    def summary(self) -> dict:
        """A JSON-friendly view for ``/v1/status``."""
        return {
            "round_id": self.round_id,
            "participants": len(self.participants),
            "joined": len(self.joins.joined),
            "groups": [
                {"group_id": g.group_id, "members": g.members, "label_distance": g.distance, "step": g.step,
                 "done": sorted(g.done), "dropped": sorted(g.dropped), "finished": g.finished}
                for g in self.groups or []
            ],
        }
