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
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from concurrent.futures import Executor
from typing import Any, NoReturn, TypeVar

import torch

from main_server.group import (
    ForwardOutcome, Group, StepOutcome, TrainedForward, TrainedStep, new_group, timed_backward, timed_forward,
    timed_step,
)
from main_server.group_trainer import MemberBatch
from main_server.join_phase import JoinPhase
from main_server.metrics import MainMetrics
from main_server.round_plan import plan_model, server_weights
from main_server.step_checks import StepChecks
from shared.algorithms.registry import build_group_loss, build_grouping, build_member_defences
from shared.errors import Conflict, DomainError, Failed, Invalid, NotFound
from shared.losses import build_loss, check_loss_origin, label_counts_problem
from shared.machine import release_free_memory
from shared.recording import Recording
from shared.schemas import BackwardRequest, ForwardRequest, JoinRequest, JoinResponse, RoundPlan, StepRequest
from shared.round_label import round_label

log = logging.getLogger("main_server")

#: What a training worker's run of a step (or half of one) gives (:meth:`GroupRound._train`).
T = TypeVar("T")
#: A step's first request: a whole step, or a U-shaped step's forward half (:meth:`GroupRound._arrive`).
R = TypeVar("R", StepRequest, ForwardRequest)


class GroupRound:
    """One round at the Main Server, from the Fed Server's plan to the groups' uploads.

    The template model, the plan's weights and the validation of every request stay on the CPU,
    where the wire delivers them; each group's copy trains on ``device`` (:class:`GroupTrainer`),
    in ``executor``'s threads (the Main Server's training workers; asyncio's default executor if
    None).
    """

    def __init__(self, plan: RoundPlan, on_group_done: Callable[["GroupRound", Group], Awaitable[None]],
                 metrics: MainMetrics | None = None, device: torch.device | None = None,
                 model_ref: str | None = None, executor: Executor | None = None, loss_ref: str | None = None,
                 recording: Recording | None = None) -> None:
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
        #: What this round keeps of what devices send (``--record-received``; None: nothing).
        self.recording = recording if recording is not None and recording.keeps(plan.round_index) else None
        if self.recording is not None:
            self._record("plan", value={"round_id": plan.round_id, "round_index": plan.round_index,
                                        "head_start": plan.head_start, "grouping": plan.grouping,
                                        "split_points": {p.device_id: p.split_point for p in plan.participants}})

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
        if not req.label_counts:
            if self.plan.groups is None and self.grouping.uses_label_counts:
                raise Invalid(f"this round's grouping ({self.plan.grouping}) groups by label counts; the join sent none")
        else:
            problem = label_counts_problem(len(req.label_counts), self.plan.num_classes,
                                           self.plan.train.resolved_task)
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
        self._record(f"{req.device_id}-join", value={"label_counts": req.label_counts, "num_steps": req.num_steps})
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
                              self.defences, end=self.plan.head_start)
            self.groups.append(group)
            for m in members:
                self.group_by_device[m] = group
            self._arm_step_timer(group)
        self.server_weights = {}   # loaded into every group's copy: the plan's bytes can go, and their pages
        release_free_memory()
        missing = self.joins.missing()
        if self.metrics is not None:
            self.metrics.groups_formed_with([g.distance for g in self.groups if g.distance is not None], len(missing))
        if missing:
            log.warning("%s: %d device(s) never joined (%s): %s", self.label, len(missing), self.joins.why_missing,
                        missing)
        log.info("%s: %d group(s) %s", self.label, len(self.groups),
                 [(g.members, None if g.distance is None else round(g.distance, 3)) for g in self.groups])
        self.groups_ready.set()

    # --- the per-step barrier -------------------------------------------------------------------
    def validate_step(self, req: StepRequest) -> tuple[Group, MemberBatch]:
        """Check that a step request is this member's next step (:meth:`stepping_group`) and fits
        the round (:meth:`StepChecks.decode_batch`), without side effects. Its values are checked
        by :meth:`StepChecks.harmful_values`."""
        group = self.stepping_group(req)
        return group, self.checks.decode_batch(req, group.split[req.device_id])

    def stepping_group(self, req: StepRequest | ForwardRequest | BackwardRequest) -> Group:
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
        if req.device_id in group.pending or req.device_id in group.training or req.device_id in group.owing:
            raise Conflict(f"step {req.step} of {req.device_id!r} was already received")
        return group

    async def step(self, req: StepRequest) -> StepOutcome:
        """Wait at the group's barrier for this step, train the copy once, return this device's dfx.

        A member's step that does not fit the group's batch (:meth:`StepChecks.decode_batch`: its
        encoding, dtypes or shapes) or whose values are harmful (:meth:`StepChecks.harmful_values`) drops its sender
        from the group (Invalid): left in it, the member would hold the barrier until the step
        deadline, as it could never send a step that fits; the others go on without it at this
        step. A request that is not the member's next step (:meth:`stepping_group`) drops nobody."""
        return await self._arrive(req, self.checks.decode_batch)

    async def forward(self, req: ForwardRequest) -> ForwardOutcome:
        """U-shaped mode, a step's first half: wait at the group's barrier for every member's
        activations, run the middle once, return this device's rows of its output. Checked and
        refused as :meth:`step` checks a step (no labels: :meth:`StepChecks.decode_forward`)."""
        return await self._arrive(req, self.checks.decode_forward)

    async def _arrive(self, req: R, decode: Callable[[R, int], MemberBatch]) -> Any:
        """A member's step (or U-shaped first half) at the group's barrier: its next step
        (:meth:`stepping_group`), decoded by ``decode`` and checked for harmful values (else its
        sender is dropped, Invalid), recorded, then awaited until the group has trained."""
        group = self.stepping_group(req)
        try:
            batch = decode(req, group.split[req.device_id])
        except Invalid as exc:
            self._refuse_step(group, req, exc.detail)
        harm = self.checks.harmful_values(batch)
        if harm is not None:
            self._refuse_step(group, req, harm)
        self._record_step(req, fx=batch.fx, labels=batch.labels)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        group.pending[req.device_id] = (batch, future, time.monotonic())
        self._release(group)
        return await future

    async def backward(self, req: BackwardRequest) -> StepOutcome:
        """U-shaped mode, a step's second half: wait for every answered member's gradient at the
        middle's output, step the copy once, return this device's dfx. A gradient that does not
        fit the device's rows (:meth:`StepChecks.decode_gradient`) drops its sender."""
        group = self.gradient_group(req)
        assert group.forward is not None
        rows = next(b.rows for b in group.forward.order if b.device_id == req.device_id)
        try:
            gradient = self.checks.decode_gradient(req, rows)
        except Invalid as exc:
            self._refuse_step(group, req, exc.detail)
        self._record_step(req, gradient=gradient)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        group.gradients[req.device_id] = (gradient, future, time.monotonic())
        self._release(group)
        return await future

    def gradient_group(self, req: BackwardRequest) -> Group:
        """The group of the sender if it owes the gradient of the group's current step: as
        :meth:`stepping_group`, and Conflict while the group is not between a step's halves, for
        another step, for a member that was not answered the step's first half, or twice."""
        group = self.group_by_device.get(req.device_id)
        if group is None or req.device_id in group.dropped:
            return self.stepping_group(req)   # its error
        if group.forward is None or req.step != group.step:
            raise Conflict(f"step {req.step}: the group of {req.device_id!r} takes no gradient now "
                           f"(it is at step {group.step}, {'between' if group.forward is not None else 'before'} its halves)")
        if req.device_id in group.gradients:
            raise Conflict(f"the gradient of step {req.step} of {req.device_id!r} was already received")
        if req.device_id not in group.owing:
            raise Conflict(f"{req.device_id!r} was not answered step {req.step}'s first half")
        return group

    def _record_step(self, req: StepRequest | ForwardRequest | BackwardRequest, **tensors: torch.Tensor | None) -> None:
        """Keep what a member's step sent (``--record-received``), once it passed the checks:
        each tensor as ``<device>-step-<step>-<name>``."""
        if self.recording is not None and self.recording.keeps(self.plan.round_index, req.step):
            for name, tensor in tensors.items():
                if tensor is not None:
                    self._record(f"{req.device_id}-step-{req.step:04d}-{name}", tensor=tensor)

    def _record(self, name: str, tensor: torch.Tensor | None = None, value: object = None) -> None:
        """Keep ``tensor`` or ``value`` as ``name`` in this round's records, if it has any."""
        if self.recording is None:
            return
        if tensor is not None:
            self.recording.tensor(self.plan.round_index, self.round_id, name, tensor)
        else:
            self.recording.value(self.plan.round_index, self.round_id, name, value)

    def _refuse_step(self, group: Group, req: StepRequest | ForwardRequest | BackwardRequest, why: str) -> NoReturn:
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
            group.owing.discard(device)
            waiting = group.gradients.pop(device, None)
            if waiting is not None and not waiting[1].done():
                waiting[1].set_exception(Conflict(f"device {device!r} was dropped from round {self.round_id}: {reason}"))
            group.trainer.leave(device)   # the group trains on as if formed without it
            self.dropped[device] = reason
        if self.metrics is not None:
            self.metrics.members_dropped(cause, len(reasons))
        self.announce()
        self._release(group)

    def _release(self, group: Group) -> None:
        """Train the group's step once every member still owing it has sent it; finish the group
        once nobody owes a step. Nothing while a step trains (its end does this)."""
        if group.running or group.finished or self.abandoned:
            return
        if group.forward is not None:   # U-shaped, between a step's halves
            if group.owing <= set(group.gradients):
                self._spawn(self._run_backward(group))
        elif group.pending and group.expected() <= set(group.pending):
            self._spawn(self._run_step(group) if self.plan.head_start is None else self._run_forward(group))
        elif not group.pending:
            self._check_finished(group)

    def changed(self) -> asyncio.Event:
        """An event set at the next change the watch stream reports (a member dropped, the round
        closed); take it before reading the state, so no change is missed."""
        return self._changed

    def announce(self) -> None:
        """Wake the watch streams (a change to report, or the server stopping)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _close(self) -> None:
        self.closed.set()
        self.announce()
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
        if group.forward is not None:
            late, what = group.owing - set(group.gradients), f"the gradient of step {step}"
        else:
            late, what = group.expected() - set(group.pending), f"step {step}"
        if late:
            reason = f"missed the deadline of {what} ({self.plan.step_deadline_s:g} s)"
            self._drop(group, {d: reason for d in sorted(late)}, cause="deadline")
        else:
            self._release(group)

    async def _run_step(self, group: Group) -> None:
        """Train the group's step on the members' pending batches and answer each its dfx."""
        if group.running or not group.pending:
            return
        pending, group.pending = group.pending, {}
        step = group.step
        # In device order, not arrival order: the union batch, and so the step, is then the same
        # whatever order the members' requests came in (a replay, or a run with replicas,
        # trains the same copy bit for bit).
        batches = [pending[d][0] for d in sorted(pending)]
        trained, cause = await self._train(
            group, step, pending, lambda: timed_step(group.trainer, batches),
            lambda refused: TrainedStep(0.0, 0.0, {}, refused))
        if trained.results:
            self._answer(group, {d: pending[d][1:] for d in trained.results}, trained,
                         activation_bytes=sum(pending[d][0].fx.numel() * pending[d][0].fx.element_size()
                                              for d in trained.results))
        self._refuse(group, {d: pending[d][1] for d in trained.refused}, trained.refused, cause)
        if not self._check_finished(group):
            self._arm_step_timer(group)

    async def _run_forward(self, group: Group) -> None:
        """U-shaped mode: run the first half of the group's step on the members' pending batches,
        answer each its rows of the middle's output, and wait for their gradients."""
        if group.running or not group.pending:
            return
        pending, group.pending = group.pending, {}
        batches = [pending[d][0] for d in sorted(pending)]   # device order, as in _run_step
        trained, cause = await self._train(
            group, group.step, pending, lambda: timed_forward(group.trainer, batches),
            lambda refused: TrainedForward(0.0, 0.0, None, {}, refused))
        if trained.forward is not None:
            group.forward, group.owing = trained.forward, set(trained.results)
            group.forward_s = trained.ended - trained.started
            for device, result in trained.results.items():
                _, fut, arrived = pending[device]
                if not fut.done():
                    fut.set_result(ForwardOutcome(result, wait_s=max(0.0, trained.started - arrived),
                                                  server_s=group.forward_s))
        self._refuse(group, {d: pending[d][1] for d in trained.refused}, trained.refused, cause)
        if group.forward is not None or not self._check_finished(group):
            self._arm_step_timer(group)

    async def _run_backward(self, group: Group) -> None:
        """U-shaped mode: the second half of the group's step from the gradients received (none:
        every member it answered was dropped, and the half is given up), and each sender's dfx."""
        forward = group.forward
        if group.running or forward is None:
            return
        received, group.gradients = group.gradients, {}
        if not received:
            group.forward, group.owing = None, set()
            group.trainer.discard()
            self._check_finished(group)
            return
        gradients = {d: received[d][0] for d in sorted(received)}
        trained, cause = await self._train(
            group, group.step, received, lambda: timed_backward(group.trainer, forward, gradients),
            lambda refused: TrainedStep(0.0, 0.0, {}, refused))
        group.forward, group.owing = None, set()
        if trained.results:
            self._answer(group, {d: received[d][1:] for d in trained.results}, trained,
                         activation_bytes=sum(b.fx.numel() * b.fx.element_size() for b in forward.order
                                              if b.device_id in trained.results),
                         server_s=group.forward_s + trained.ended - trained.started)   # both halves
        self._refuse(group, {d: received[d][1] for d in trained.refused}, trained.refused, cause)
        if not self._check_finished(group):
            self._arm_step_timer(group)

    async def _train(self, group: Group, step: int, parts: Collection[str], work: Callable[[], T],
                     failed: Callable[[dict[str, DomainError]], T]) -> tuple[T, str]:
        """Run ``work`` (a step, or a half of one, for the members ``parts``) in a training worker,
        the group marked as training meanwhile; what it trained, and the drop cause of any member
        it refuses. Should it raise, ``failed`` of every member refused, the cause ``failed_step``:
        a training failure must not leave devices hanging, nor the group.

        Ready group steps queue for the training workers first come, first served: a group's step
        waits only for the steps that were ready before it. That wait counts as the members' wait
        at the Main Server (wait_s), not as the step's server time."""
        group.running = True
        if group.timer is not None:
            group.timer.cancel()
        group.training = set(parts)
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, work), "non_finite"
        except Exception as exc:
            log.exception("%s group %d: step %d failed", self.label, group.group_id, step)
            if self.metrics is not None:
                self.metrics.step_failed()
            return failed({d: Failed(f"server-side training of step {step} failed: {exc}") for d in parts}), "failed_step"
        finally:
            group.running = False
            group.training = set()

    def _refuse(self, group: Group, futures: Mapping[str, asyncio.Future], refused: Mapping[str, DomainError],
                cause: str) -> None:
        """Answer each refused member its error and drop it from the group (``cause``)."""
        for device, error in refused.items():
            fut = futures[device]
            if not fut.done():
                fut.set_exception(type(error)(f"{error.detail}; device {device!r} is dropped from round {self.round_id}"))
        if refused:
            self._drop(group, {d: error.detail for d, error in refused.items()}, cause=cause)

    def _answer(self, group: Group, members: dict[str, tuple[asyncio.Future, float]], trained: TrainedStep,
                activation_bytes: int, server_s: float | None = None) -> None:
        """The step trained on ``members`` (each with its future and arrival; ``activation_bytes``
        they sent): count it, advance the group, answer each its dfx. ``server_s``: the step's
        server time (None: ``trained``'s)."""
        server_s = trained.ended - trained.started if server_s is None else server_s
        group.train_time_s += server_s
        if self.metrics is not None:
            self.metrics.step_trained(
                server_s, fastest_wait_s=trained.started - min(arrived for _, arrived in members.values()),
                activation_bytes=activation_bytes,
                gradient_bytes=sum(r.dfx.numel() * r.dfx.element_size() for r in trained.results.values()))
        group.step += 1
        for device, (fut, arrived) in members.items():
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
            for _, fut, _ in [*group.pending.values(), *group.gradients.values()]:
                if not fut.done():
                    fut.set_exception(Conflict(f"round {self.round_id} was replaced by a newer round"))
            group.pending, group.gradients = {}, {}

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
