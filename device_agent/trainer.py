"""A device's local training for one round: split mode (through the Main Server) or whole model."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from device_agent.timing import RoundClock
from shared.algorithms.base import DeviceLogic, Payload
from shared.data import ArrayDataset
from shared.models import SplitModel
from shared.torch_device import model_device, synchronize

#: Sends (step, fx, labels) to the Main Server and returns (dfx, server-reported loss).
StepFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]


class TaskExpired(Exception):
    """The task's deadline passed before training finished: the Fed Server has closed that
    attempt, so finishing it would only load the machine and upload a stale model."""


@dataclass
class LocalResult:
    """What a round's training gives besides the weights, which stay in the model (the device
    uploads its portion's ``state_dict`` after any follow-up)."""

    steps: int
    train_loss: float


def batches(data: ArrayDataset, batch_size: int, epochs: int, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches over ``epochs`` passes, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=gen)
        for start in range(0, len(data), batch_size):
            idx = order[start:start + batch_size]
            yield data.x[idx], data.y[idx]


def steps_per_round(num_samples: int, batch_size: int, epochs: int) -> int:
    return epochs * math.ceil(num_samples / batch_size)


def train_round(
    model: SplitModel,
    split_point: int,
    weights: dict[str, torch.Tensor] | None,
    data: ArrayDataset,
    lr: float,
    momentum: float,
    weight_decay: float,
    batch_size: int,
    epochs: int,
    seed: int,
    clock: RoundClock,
    send_step: StepFn | None,
    half_precision: bool = False,
    logic: DeviceLogic | None = None,
    extras: Payload | None = None,
    deadline: float | None = None,
    compute_slot: AbstractContextManager | None = None,
) -> LocalResult:
    """Train blocks[:split_point] of ``model`` in place for one round, on the device its trained
    blocks live on (``--torch-device``; the weights are copied there). ``weights`` None: the
    portion already holds the round's starting weights (the agent loads a task's weights as soon
    as it has decoded them, so the received message's bytes, which the decoded tensors view, are
    freed before training rather than held through it).

    With ``send_step`` (split mode) each step sends the cut's activations and labels to the Main
    Server and backpropagates the returned dfx; without it the device holds the whole model and
    trains on the algorithm's local objective (``logic.loss``; cross-entropy by default).
    ``deadline`` (a ``time.monotonic()`` instant) is checked before every step: past it the
    round is given up with :class:`TaskExpired`. ``compute_slot`` (the agent's semaphore, see
    :class:`device_agent.agent.Agent`) is held during each compute section only, never while
    waiting for the Main Server, so group members waiting for each other cannot deadlock; an
    emulated kind's stretch sleeps after the slot is released. ``extras`` are the task's validated
    ``Algorithm.TaskExtras`` for ``logic.begin_round`` (none: the empty payload).

    The data set stays on the CPU and each batch is moved to the device after it is drawn, so
    the seeded batch order is the same on every device. Activations go back to the CPU (in
    half precision first when asked, halving the copy) for the wire; dfx comes to the device.
    """
    logic = logic or DeviceLogic({})
    portion = model.portion(0, split_point)
    if weights is not None:
        portion.load_state_dict(weights, strict=True)
    device = model_device(portion)
    logic.begin_round(portion, extras if extras is not None else Payload(), data)
    data = logic.training_data(data)
    portion.train()
    optimizer = torch.optim.SGD(portion.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    slot = compute_slot if compute_slot is not None else contextlib.nullcontext()
    losses: list[float] = []
    steps = 0
    for step, (x, y) in enumerate(batches(data, batch_size, epochs, seed)):
        if deadline is not None and time.monotonic() > deadline:
            raise TaskExpired(f"deadline passed after {steps} steps")
        x = x.to(device)  # no copy on the CPU
        if send_step is None:
            with clock.compute(), slot:
                loss = logic.loss(portion, x, y.to(device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                synchronize(device)  # CUDA/MPS run asynchronously: the clock must see the compute
            losses.append(float(loss.detach()))
        else:
            with clock.compute(), slot:
                fx = portion(x)
                synchronize(device)
            sent = fx.detach().half() if half_precision else fx.detach()
            dfx, loss_value = send_step(step, sent.cpu(), y)
            with clock.compute(), slot:
                optimizer.zero_grad(set_to_none=True)
                fx.backward(dfx.to(device=fx.device, dtype=fx.dtype))
                optimizer.step()
                synchronize(device)
            losses.append(loss_value)
        steps += 1
    optimizer.zero_grad(set_to_none=True)  # the last step's gradients: no longer needed, as big as the weights
    return LocalResult(steps=steps, train_loss=sum(losses) / max(1, len(losses)))
