"""A device's training task, from the task to the upload: the algorithm's terms and the state its
device logic kept from the device's last round, the weights it names, the round's training
(through the Main Server's step exchange in split mode), a two-phase algorithm's report and
follow-up, and the body the device uploads."""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from device_agent.api import FedApi, SecureChannel
from device_agent.compute import Compute
from device_agent.device_model import DeviceModel
from device_agent.device_state import DeviceStates
from device_agent.secure_aggregation import SecureSession, share_secrets
from device_agent.step_exchange import MainLink, StepExchange
from device_agent.task_poll import TaskPoller
from device_agent.task_expired import TaskExpired
from device_agent.timing import RoundClock
from device_agent.trainer import (
    LocalResult, TrainContext, TrainSettings, leaves_out_single_samples, round_seed, steps_per_round,
    train_round,
)
from shared.algorithms.base import DeviceLogic, Payload, parse_payload, trainable_parameters
from shared.algorithms.privacy_defence import PrivacyDefence
from shared.algorithms.registry import ALGORITHMS
from shared.algorithms.two_phase import TwoPhaseLogic, two_phase
from shared.data import ArrayDataset
from shared.errors import Conflict, Invalid
from shared.losses import Loss
from shared.models import Portion, SplitModel
from shared.portions import decode_device_portion
from shared.privacy.clipping import clip_update, update_norm
from shared.secagg.masks import BlockLayout
from shared.schemas import DeviceTimings, JoinRequest, ReportRequest, TaskResponse, UpdateRequest
from shared.wire import encode_state

#: Seconds a task without a deadline_s may take (the Fed Server's default round deadline).
TASK_DEADLINE_DEFAULT_S = 300.0
#: What a two-phase task's report and follow-up take: the device logic's two-phase side and the
#: algorithm's ``FollowUp`` model.
FollowUpTerms = tuple[TwoPhaseLogic, type[Payload]]


@dataclass
class TaskTrainer:
    """Trains one device's tasks on its ``data`` (None between tasks on a device that lets its data
    go: :attr:`device_agent.device.Device.keep_data`): ``model`` holds its weights, ``main`` its Main
    Server client, ``poller`` asks for a two-phase algorithm's follow-up, ``new_clock`` times each
    round. ``seed`` and ``seed_key`` (the device's shard, or its id when it brings its own data)
    give each round's batch order (:func:`device_agent.trainer.round_seed`); ``compute``: where a
    whole-model round's training runs (the agent's compute threads, or this thread); ``loss``: the
    run's (``RunInfo.loss``), which every task's ``train.loss`` must name; ``states``: where the
    device logic's kept state waits for the device's next round in run ``run_id``."""

    device_id: str
    data: ArrayDataset | None
    model: DeviceModel
    fed: FedApi
    main: MainLink
    poller: TaskPoller
    new_clock: Callable[[], RoundClock]
    seed: int
    seed_key: int | str
    compute: Compute | None
    task_wait_s: float
    loss: Loss
    states: DeviceStates
    run_id: str
    #: What the device tells the Main Server of its samples per class at every join (as the run's
    #: ``split_privacy.label_counts`` says: exact, noised once, or empty: withheld).
    label_counts: list[int]
    #: The run's privacy defences (``split_privacy.defences``) and the model's classes.
    defences: Sequence[PrivacyDefence] = ()
    num_classes: int = 0
    #: Secure aggregation: the session of the task last trained, whose unmasking stage its device
    #: answers after the upload (:meth:`SecureSession.answer_unmasking`); None for other tasks.
    secure: SecureSession | None = None
    #: Where the secure stages go: ``fed`` (None), or the device's agent's batches.
    secure_channel: SecureChannel | None = None

    @property
    def samples(self) -> ArrayDataset:
        """The data the current task trains on."""
        assert self.data is not None, "a task runs with its device's data loaded"
        return self.data

    def train(self, task: TaskResponse, task_bytes: int, received_at: float) -> UpdateRequest:
        """Train the task and return the upload (the decoded weights and the training's other
        objects are freed when this returns; the model is the caller's :meth:`DeviceModel.task_scope`'s).

        ``received_at`` is the ``time.monotonic()`` at which the task arrived: its ``deadline_s``
        counts from there, and past it the task is given up (:class:`TaskExpired`)."""
        deadline = received_at + (task.deadline_s or TASK_DEADLINE_DEFAULT_S)
        clock = self.new_clock()
        phases, logic, extras = _task_terms(task, self.loss, self.model.layout)
        if time.monotonic() > deadline:   # a stalled device: its weights may no longer be served either
            raise TaskExpired("deadline passed before the task started")
        if logic.State is not None:
            logic.restore_state(self.states.load(self.run_id, self.device_id, logic.State,
                                                 trainable_parameters(self.model.layout)))
        assert task.train is not None and task.round_id is not None and task.round_index is not None
        assert task.split_point is not None
        # Keys and shares go before training: the stages close as soon as every device answered,
        # and a device lost while training is one whose masks its peers' shares remove.
        self.secure = None if task.secure_aggregation is None else share_secrets(
            self.secure_channel or self.fed, self.device_id, task.round_id, task.secure_aggregation, deadline,
            task.split_point)
        settings = TrainSettings.of(task.train, round_seed(self.seed, self.seed_key, task.round_index),
                                    task.half_precision)
        context = TrainContext(clock, logic=logic, extras=extras, deadline=deadline, compute=self.compute,
                               torch_device=self.model.torch_device, defences=self.defences,
                               num_classes=self.num_classes)
        model, result, exchange, start = self._train_portion(task, task_bytes, settings, context)
        portion = device_portion(model, task)
        if phases is not None:
            self._report_and_follow_up(task, *phases, portion, clock, deadline)
        body = self._update(task, portion, result, exchange, clock, logic, start)
        kept = logic.kept_state()
        if kept is not None:
            self.states.keep(self.run_id, self.device_id, kept.to_wire())
        return body

    def _train_portion(self, task: TaskResponse, task_bytes: int, settings: TrainSettings, context: TrainContext
                       ) -> tuple[SplitModel, LocalResult, StepExchange | None, dict[str, torch.Tensor] | None]:
        """Fetch the task's weights, join the Main Server if the task names one, train the round.
        Also returns, for a private or securely aggregated task, a copy of the weights it started
        from (its update is the change from them)."""
        assert task.split_point is not None
        clock = context.clock
        fetch_started = time.monotonic()
        with self.model.named_weights(task) as named:
            # Charged whether this device fetched them or another device of its agent did: an
            # emulated device downloads its task's weights itself. The measured part is the time
            # this device waited for them (the task itself came with a long poll, untimed).
            clock.transfer(task_bytes + named.size, time.monotonic() - fetch_started)
            # Decoded, they view the fetched body, which the agent's devices share: each device
            # copies them into its own model when its training starts (train_round), so a device
            # waiting for a compute thread holds no copy of its own. Both go with this frame, so
            # they do not keep the body alive through the upload once the agent's last device
            # has let it go.
            weights = decode_device_portion(named.weights, self.model.layout, task.split_point,
                                            task.head_start or len(self.model.layout.blocks), what="task weights")
            keep_start = task.privacy is not None or task.secure_aggregation is not None
            start = {k: v.clone() for k, v in weights.items()} if keep_start else None
            model = self.model.for_task()
            exchange = self._join(task, model, clock) if task.main_server_url is not None else None
            if task.head_start is None:
                context.send_step = exchange
            else:
                context.u_steps = exchange
            result = train_round(model, task.split_point, weights, self.samples, settings, context, task.head_start)
        return model, result, exchange, start

    def _join(self, task: TaskResponse, model: SplitModel, clock: RoundClock) -> StepExchange:
        """Join the round at the task's Main Server, announcing the steps ``model``'s portion up to
        the task's split point will send; return the round's step exchange."""
        assert task.main_server_url is not None and task.train is not None and task.round_id is not None
        assert task.split_point is not None
        num_steps = steps_per_round(len(self.samples), task.train.batch_size, task.train.local_epochs,
                                    no_single=leaves_out_single_samples(model, task.split_point, split=True))
        join = JoinRequest(device_id=self.device_id, label_counts=self.label_counts, num_steps=num_steps)
        timeout = (task.deadline_s or TASK_DEADLINE_DEFAULT_S) + 5
        return self.main.join(task.main_server_url, task.round_id, join, clock, timeout)

    def _report_and_follow_up(self, task: TaskResponse, logic: TwoPhaseLogic, follow_up_model: type[Payload],
                              portion: Portion, clock: RoundClock, deadline: float) -> None:
        """Two-phase algorithms: send the report, wait for this round's follow-up, validate it as
        ``follow_up_model`` (the algorithm's ``FollowUp``) and act on it."""
        assert task.round_id is not None
        with clock.compute():
            extras = logic.report(portion, self.samples).to_wire()
        self.fed.report(ReportRequest(device_id=self.device_id, round_id=task.round_id, extras=extras))
        poller = self.poller
        t0 = time.monotonic()
        while True:
            asked_at = time.monotonic()
            wait_s = min(self.task_wait_s, max(0.0, deadline - asked_at))
            follow, size = poller.poll(wait_s)
            if follow.status == "train" and follow.phase == "follow_up" and follow.round_id == task.round_id:
                break
            if follow.status == "done" or (follow.round_id is not None and follow.round_id != task.round_id) \
                    or time.monotonic() > deadline or poller.stop.is_set():
                raise Conflict(f"no follow-up for round {task.round_id}")
            poller.pause_after(follow, asked_at, wait_s)
        clock.wait_s += time.monotonic() - t0  # waiting for the other devices' reports
        clock.transfer(size)
        with clock.compute():
            logic.follow_up(portion, self.samples, parse_payload(follow_up_model, follow.extras, "follow-up"))

    def _update(self, task: TaskResponse, portion: Portion, result: LocalResult, exchange: StepExchange | None,
                clock: RoundClock, logic: DeviceLogic, start: dict[str, torch.Tensor] | None) -> UpdateRequest:
        """The upload: the trained portion (a private task's with its change from ``start`` clipped
        to the task's bound; a securely aggregated task's change, masked), the round's timings
        and Main Server traffic, the algorithm's upload extras (none when masked)."""
        assert task.round_id is not None
        state = portion.state_dict()  # detached views: encoding below copies them into the body
        inside_clip = None
        if task.privacy is not None:
            assert start is not None
            norm = update_norm(state, start)
            inside_clip = norm <= task.privacy.clip_norm
            state = clip_update(state, start, task.privacy.clip_norm, norm)
        # The upload's emulated transfer is charged before it is sent (its timings travel inside
        # it), sized by its tensor payload, which is all but a few hundred bytes of the body.
        clock.transfer(sum(t.numel() * (8 if self.secure else t.element_size()) for t in state.values()))
        if self.secure is not None:
            assert start is not None
            weights = self.secure.masked_weights(state, start, len(self.samples), BlockLayout.of(self.model.layout, task.head_start),
                                                 task.privacy)
            extras: dict = {}
        else:
            weights, extras = encode_state(state), logic.upload_extras(portion, self.samples).to_wire()
        return UpdateRequest(
            device_id=self.device_id, round_id=task.round_id, num_samples=len(self.samples), steps=result.steps,
            train_loss=result.train_loss, weights=weights, inside_clip=inside_clip,
            timings=DeviceTimings(compute_s=clock.compute_s, transfer_s=clock.transfer_s, wait_s=clock.wait_s,
                                  server_s=clock.server_s, total_s=clock.total()),
            bytes_up=exchange.bytes_up if exchange is not None else 0,
            bytes_down=exchange.bytes_down if exchange is not None else 0,
            extras=extras,
        )


def device_portion(model: SplitModel, task: TaskResponse) -> Portion:
    """What ``task`` trains of ``model``: blocks ``[0, split_point)``, and U-shaped its head."""
    assert task.split_point is not None
    return model.device_portion(task.split_point, task.head_start or len(model.blocks))


def _task_terms(task: TaskResponse, loss: Loss, layout: SplitModel) -> tuple[FollowUpTerms | None, DeviceLogic, Payload]:
    """A training task's algorithm terms, validated before anything is fetched: when the task asks
    for a report, its device logic's two-phase side with the algorithm's ``FollowUp`` model (else
    None); the device logic for the task's parameters, its ``train`` settings and the run's
    ``loss``; the task's extras, whose tensors must match the trainable parameters of the portion
    the task trains (of the model's ``layout``).
    Invalid for a task that lacks its round, split point or settings, names an unknown algorithm
    or another loss than the run's (a task never brings code: its loss must be the one the device
    checked at the start), cuts the model outside its blocks (or, U-shaped, leaves no middle between its
    cut and its head), or asks for a report its algorithm does not send; pydantic's
    ValidationError for parameters or extras the algorithm refuses."""
    if task.train is None or task.round_id is None or task.split_point is None:
        raise Invalid("a training task must name its round_id, split_point and train settings")
    if not 0 <= task.split_point <= len(layout.blocks):
        raise Invalid(f"the task's split_point {task.split_point} is not within the model's {len(layout.blocks)} blocks")
    if task.head_start is not None and not 0 < task.split_point < task.head_start < len(layout.blocks):
        raise Invalid(f"the task's head_start {task.head_start} must lie after its split_point {task.split_point} and "
                      f"before the model's end ({len(layout.blocks)} blocks)")
    if (task.train.loss, task.train.task) != (loss.name, loss.task):
        raise Invalid(f"the task's loss {task.train.loss!r} ({task.train.task}) is not the run's {loss.name!r} "
                      f"({loss.task})")
    name = task.algorithm or "fedavg"
    algorithm = ALGORITHMS.get(name)
    if algorithm is None:
        raise Invalid(f"the task's algorithm {name!r} is not one this agent knows "
                      f"({', '.join(ALGORITHMS)})")
    logic = algorithm.device_logic(dict(task.params), loss, task.train)   # pydantic's ValidationError for refused params
    extras = parse_payload(algorithm.TaskExtras, task.extras, "task extras",
                           trainable_parameters(device_portion(layout, task)))
    if not task.report:
        return None, logic, extras
    phases, phase_logic = two_phase(algorithm), two_phase(logic)
    if phases is None or phase_logic is None:
        raise Invalid(f"the task asks for a report, which algorithm {name!r} does not send")
    return (phase_logic, phases.FollowUp), logic, extras
