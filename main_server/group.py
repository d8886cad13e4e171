"""One group of a Main Server round: its members, where each is cut, its barrier's state, and a
group step trained off the event loop with its time taken (:func:`timed_step`)."""
from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from main_server.group_trainer import GroupMember, GroupTrainer, MemberBatch, MemberResult, NonFiniteStep
from shared.algorithms.group_loss import GroupLoss
from shared.algorithms.member_defence import MemberDefence
from shared.algorithms.label_balance import label_distance
from shared.config import TrainConfig
from shared.errors import DomainError, Failed, Invalid
from shared.models import SplitModel
from shared.schemas import JoinRequest, Participant


@dataclass
class StepOutcome:
    result: MemberResult
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
    distance: float
    step: int = 0
    done: set[str] = field(default_factory=set)
    dropped: set[str] = field(default_factory=set)
    pending: dict[str, tuple[MemberBatch, asyncio.Future, float]] = field(default_factory=dict)
    training: set[str] = field(default_factory=set)   # members whose step is being trained
    running: bool = False
    train_time_s: float = 0.0
    finished: bool = False
    timer: asyncio.TimerHandle | None = None

    def expected(self) -> set[str]:
        """Members that owe the current step."""
        return {m for m in self.members if m not in self.dropped and m not in self.done and self.num_steps[m] > self.step}


def new_group(group_id: int, members: Sequence[Participant], joins: Sequence[JoinRequest], template: SplitModel,
              server_weights: Mapping[str, torch.Tensor], train: TrainConfig, group_loss: GroupLoss,
              device: torch.device | None, defences: Sequence[MemberDefence] = ()) -> Group:
    """A group of ``members`` (with their ``joins``, in the same order) with its own copy of the
    server portion from the smallest split point among them, at its Eq. 2 label distance."""
    split = {m.device_id: m.split_point for m in members}
    start = min(split.values())
    keys = template.portion_keys(start, len(template.blocks))
    trainer = GroupTrainer(
        copy.deepcopy(template), start, {k: server_weights[k] for k in keys},
        lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay, group_loss=group_loss, device=device,
        # |D_i| as the Fed Server registered it, the weight Algorithm 1 gives the device
        members={m.device_id: GroupMember(m.num_samples, m.split_point) for m in members},
        defences=defences,
    )
    return Group(group_id=group_id, members=list(split), split=split,
                 num_steps={j.device_id: j.num_steps for j in joins}, trainer=trainer,
                 distance=label_distance(np.stack([np.asarray(j.label_counts, dtype=np.int64) for j in joins])))


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
    started = time.monotonic()
    refused: dict[str, DomainError] = {}
    results: dict[str, MemberResult] = {}
    while batches:
        try:
            results = trainer.step(batches)
            break
        except NonFiniteStep as exc:
            kind = Invalid if exc.attributed else Failed
            refused.update({d: kind(f"step not finite: {why}") for d, why in exc.culprits.items()})
            batches = [b for b in batches if b.device_id not in exc.culprits]
    return TrainedStep(started, time.monotonic(), results, refused)
