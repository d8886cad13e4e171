"""Helpers of the Main Server's logic tests (round state and round registry), as one ``kit`` fixture:
plans for the zoo's logistic regression (split point 1: the server trains the head on the
flattened input, so steps are cheap and exact), joins, steps, and running a test body on a loop."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest
import torch

from main_server.group import Group
from main_server.group_round import GroupRound
from shared.config import TrainConfig
from shared.models import build_model
from shared.schemas import JoinRequest, JoinResponse, Participant, RoundPlan, StepRequest, WireTensor
from shared.wire import encode_state, encode_tensor

CLASSES = 10
FEATURES = 60
BATCH = 4
LR = 0.1
SLOW = 30.0   # a deadline no test reaches
FAST = 0.2    # a deadline a test waits out


def make_plan(devices: list[str], grouping: str = "balanced", group_size: int = 2, round_id: int = 1,
              join_s: float = SLOW, step_s: float = SLOW, **changes) -> RoundPlan:
    model = build_model("logreg", CLASSES, (1, 1, FEATURES), seed=0)
    fields = dict(
        run_id="run", round_id=round_id, round_index=max(round_id, 1), model="logreg", num_classes=CLASSES, input_shape=[1, 1, FEATURES], seed=0,
        participants=[Participant(device_id=d, split_point=1, num_samples=10) for d in devices],
        server_weights=encode_state(model.portion(1, len(model.blocks)).state_dict()),
        train=TrainConfig(lr=LR, batch_size=BATCH), grouping=grouping, group_size=group_size,
        group_loss="per_member", join_deadline_s=join_s, step_deadline_s=step_s,
    )
    fields.update(changes)
    return RoundPlan(**fields)


def join_req(device: str, counts: list[int] | None = None, num_steps: int = 1) -> JoinRequest:
    return JoinRequest(device_id=device, label_counts=counts or [1] * CLASSES, num_steps=num_steps)


def batch(seed: int, n: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, FEATURES, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)


def step_req(device: str, step: int, fx: torch.Tensor, labels: torch.Tensor) -> StepRequest:
    return StepRequest(device_id=device, step=step, fx=WireTensor(**encode_tensor(fx)),
                       labels=WireTensor(**encode_tensor(labels)))


class Uploads:
    """The ``on_group_done`` callback: records finished groups, lets a test await one."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self.arrived = asyncio.Event()

    async def __call__(self, state: GroupRound, group: Group) -> None:
        self.groups.append(group)
        self.arrived.set()


def run(test: Callable[[], Awaitable[None]]) -> None:
    """Each test body runs on a fresh loop: GroupRound arms its timers on the running loop."""
    asyncio.run(asyncio.wait_for(test(), 20))


async def pending(task: asyncio.Task) -> bool:
    """True if ``task`` is still blocked after the loop has run everything else it can."""
    for _ in range(20):
        await asyncio.sleep(0)
    return not task.done()


async def joined(state: GroupRound, *devices: str) -> list[JoinResponse]:
    return list(await asyncio.gather(*(state.join(join_req(d)) for d in devices)))


@pytest.fixture
def kit() -> SimpleNamespace:
    """The helpers and constants above, for the test modules (which cannot import each other)."""
    return SimpleNamespace(
        CLASSES=CLASSES, FEATURES=FEATURES, BATCH=BATCH, LR=LR, SLOW=SLOW, FAST=FAST, make_plan=make_plan,
        join_req=join_req, batch=batch, step_req=step_req, Uploads=Uploads, run=run, pending=pending, joined=joined,
    )
