"""One group of a Main Server round: its members, where each is cut, its barrier's state, and a
group step trained off the event loop with its time taken (:func:`timed_step`; in U-shaped mode
its two halves, :func:`timed_forward` and :func:`timed_backward`)."""
from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from main_server.group_trainer import (
    ForwardPass, GroupMember, GroupTrainer, MemberBatch, MemberResult, MiddleResult, NonFiniteStep,
)
from shared.algorithms.group_loss import GroupLoss
from shared.algorithms.member_defence import MemberDefence
from shared.algorithms.label_balance import label_distance
from shared.config import TrainConfig
from shared.errors import DomainError, Failed, Invalid
from shared.models import SplitModel
from shared.schemas import JoinRequest, Participant


#: One member's part of a step (its batch, or in U-shaped mode its gradient).
P = TypeVar("P")


@dataclass
class StepOutcome:
    """A member's answer to a step (or, U-shaped, to its second half), with its wait at the
    barrier and the step's server time."""

    result: MemberResult
    wait_s: float
    server_s: float


@dataclass
class ForwardOutcome:
    """A member's answer to a U-shaped step's first half, with its wait and the half's server time."""

    result: MiddleResult
    wait_s: float
    server_s: float


@dataclass
class Group:
    """Members that share one server-portion copy and meet at a barrier every step."""

    group_id: int
    members: list[str]
    split: dict[str, int]
    num_steps: dict[str, int]
    trainer: GroupTrainer
    distance: float | None
    step: int = 0
    done: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    pending: dict[str, tuple[MemberBatch, asyncio.Future, float]] = field(default_factory=dict)
    training: set[str] = field(default_factory=set)   # members whose step is being trained
    running: bool = False
    train_time_s: float = 0.0
    finished: bool = False
    timer: asyncio.TimerHandle | None = None
    #: U-shaped mode, between a step's halves: the forward pass, the members it answered that
    #: still owe their gradient, the gradients received (with each sender's future and arrival),
    #: and the first half's server time.
    forward: ForwardPass | None = None
    owing: set[str] = field(default_factory=set)
    gradients: dict[str, tuple[torch.Tensor, asyncio.Future, float]] = field(default_factory=dict)
    forward_s: float = 0.0

    def expected(self) -> set[str]:
        """Members that owe the current step."""
        return {m for m in self.members if m not in self.dropped and m not in self.done and self.num_steps[m] > self.step}


def new_group(group_id: int, members: Sequence[Participant], joins: Sequence[JoinRequest], template: SplitModel,
              server_weights: Mapping[str, torch.Tensor], train: TrainConfig, group_loss: GroupLoss,
              device: torch.device | None, defences: Sequence[MemberDefence] = (), end: int | None = None) -> Group:
    """A group of ``members`` (with their ``joins``, in the same order) with its own copy of the
    server portion from the smallest split point among them to ``end`` (None: the model's end;
    U-shaped: the devices' head start), at its Eq. 2 label distance (None when a member sent no
    label counts)."""
    split = {m.device_id: m.split_point for m in members}
    start = min(split.values())
    keys = template.portion_keys(start, len(template.blocks) if end is None else end)
    trainer = GroupTrainer(
        copy.deepcopy(template), start, {k: server_weights[k] for k in keys},
        lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay, group_loss=group_loss, device=device,
        # |D_i| as the Fed Server registered it, the weight Algorithm 1 gives the device
        members={m.device_id: GroupMember(m.num_samples, m.split_point) for m in members},
        defences=defences, end=end,
    )
    counted = all(j.label_counts for j in joins)
    return Group(group_id=group_id, members=list(split), split=split,
                 num_steps={j.device_id: j.num_steps for j in joins}, trainer=trainer,
                 distance=label_distance(np.stack([np.asarray(j.label_counts, dtype=np.int64) for j in joins]))
                 if counted else None)


@dataclass
class TrainedStep:
    """What a group step came to: each trained member's result, each member left out and why."""

    started: float
    ended: float
    results: dict[str, MemberResult]
    refused: dict[str, DomainError]


def timed_step(trainer: GroupTrainer, batches: list[MemberBatch]) -> TrainedStep:
    """``trainer.step(batches)`` with its start and end (``time.monotonic``), taken in the worker
    thread: the step's server time is its training alone, not its wait for a free worker nor the
    hop back to the event loop.

    A step the trainer refuses as not finite (:class:`NonFiniteStep`, the copy untouched) is
    trained again without the members it names, until it is finite or nobody is left: the others
    get gradients of a step their own data made, never a non-finite one."""
    return _until_finite(lambda parts: trainer.step(list(parts.values())), {b.device_id: b for b in batches})


def _until_finite(train: Callable[[dict[str, P]], dict[str, MemberResult]], parts: dict[str, P]) -> TrainedStep:
    """``train(parts)`` (each member's part of a step, by device), timed; while it raises
    :class:`NonFiniteStep`, again without the members it names (refused: Invalid where their own
    results showed it, Failed otherwise), until it is finite or no part is left."""
    started = time.monotonic()
    refused: dict[str, DomainError] = {}
    results: dict[str, MemberResult] = {}
    while parts:
        try:
            results = train(parts)
            break
        except NonFiniteStep as exc:
            kind = Invalid if exc.attributed else Failed
            refused.update({d: kind(f"step not finite: {why}") for d, why in exc.culprits.items()})
            parts = {d: part for d, part in parts.items() if d not in exc.culprits}
    return TrainedStep(started, time.monotonic(), results, refused)


@dataclass
class TrainedForward:
    """What a U-shaped step's first half came to: the forward pass and each member's result, or
    every member refused."""

    started: float
    ended: float
    forward: ForwardPass | None
    results: dict[str, MiddleResult]
    refused: dict[str, DomainError]


def timed_forward(trainer: GroupTrainer, batches: list[MemberBatch]) -> TrainedForward:
    """``trainer.forward(batches)`` with its start and end taken in the worker thread (as
    :func:`timed_step`). An output that is not finite refuses the members it names (the whole
    batch's: it cannot be told whose activations made it so)."""
    started = time.monotonic()
    try:
        forward, results = trainer.forward(batches)
    except NonFiniteStep as exc:
        kind = Invalid if exc.attributed else Failed
        return TrainedForward(started, time.monotonic(), None, {},
                              {d: kind(f"step not finite: {why}") for d, why in exc.culprits.items()})
    return TrainedForward(started, time.monotonic(), forward, results, {})


def timed_backward(trainer: GroupTrainer, forward: ForwardPass, gradients: dict[str, torch.Tensor]) -> TrainedStep:
    """``trainer.backward(forward, gradients)`` with its start and end (as :func:`timed_step`): a
    second half refused as not finite is trained again without the members it names (their
    gradients leave it; the forward pass kept its graph), until it is finite or nobody is left."""
    return _until_finite(lambda parts: trainer.backward(forward, parts), dict(gradients))
