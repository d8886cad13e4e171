"""A device's local training for one round: split mode (through the Main Server; U-shaped, with the
device's own head and loss) or whole model."""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from device_agent.compute import Compute, InlineCompute
from device_agent.dp_sgd import PrivateSteps
from device_agent.task_expired import TaskExpired
from device_agent.timing import RoundClock
from shared.algorithms.base import DeviceLogic, Payload
from shared.algorithms.privacy_defence import PrivacyDefence, private_generator
from shared.config import DpSgdConfig, TrainConfig
from shared.data import ArrayDataset
from shared.local_steps import drops_last, steps_per_round
from shared.models import DevicePortion, Portion, SplitModel
from shared.portions import load_portion
from shared.torch_device import model_device, synchronize

#: Sends (step, fx, labels) to the Main Server and returns (dfx, server-reported loss).
StepFn = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, float]]


class UShapedSteps(Protocol):
    """A U-shaped round's exchange with the Main Server: each step in two halves, no label sent."""

    def forward(self, step: int, fx: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Send the activations; return the middle's output for them and the device's loss weight."""
        ...

    def backward(self, step: int, gradient: torch.Tensor, expect_shape: tuple[int, ...]) -> torch.Tensor:
        """Send the gradient at the middle's output; return the gradient at the cut (dfx, of the
        activations' shape ``expect_shape``)."""
        ...


@dataclass
class LocalResult:
    """What a round's training gives besides the weights, which stay in the model (the device
    uploads its portion's ``state_dict`` after any follow-up)."""

    steps: int
    train_loss: float


def batches(data: ArrayDataset, batch_size: int, epochs: int, seed: int,
            no_single: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Shuffled mini-batches over ``epochs`` passes, reproducible from ``seed``.

    ``no_single`` (a BatchNorm layer trains on the batch, :func:`leaves_out_single_samples`):
    an epoch's last batch of one sample is left out of that epoch, since a BatchNorm layer cannot
    train on a single sample (PyTorch raises "Expected more than 1 value per channel"). The order
    is reshuffled every epoch and round, so a different sample sits out each time. An epoch whose
    only batch holds one sample keeps it (there is nothing to train on otherwise)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(data), generator=gen)
        end = len(data) - 1 if drops_last(len(data), batch_size, no_single) else len(data)
        for start in range(0, end, batch_size):
            idx = order[start:start + batch_size]
            yield data.x[idx], data.y[idx]


def normalises_over_batch(portion: torch.nn.Module) -> bool:
    """Whether ``portion`` holds a BatchNorm layer, which cannot train on a batch of one sample."""
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in portion.modules())


def leaves_out_single_samples(model: SplitModel, split_point: int, split: bool) -> bool:
    """Whether a round of ``model`` cut at ``split_point`` leaves an epoch's last batch of one sample
    out (:func:`batches`): where a BatchNorm layer would train on it. At split depth zero that is
    the device's portion; in split mode the whole model, since a device's last step can be the
    only one in its group's step, and the Main Server's layers then see its batch alone."""
    return normalises_over_batch(model if split else model.portion(0, split_point))


def round_seed(seed: int, shard: int | str, round_index: int) -> int:
    """Per device and round batch-order seed, identical in every process (``shard``: the device's
    shard, or its id when it brings its own data). Keyed by the logical round, not the attempt id:
    a retried attempt, or the first attempt of a run resumed from its checkpoint (whose attempt ids
    skip the ones handed out before the stop), trains on the batches the round would have had."""
    digest = hashlib.sha256(f"{seed}/{shard}/{round_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFFFFFFFFFFFFFF


@dataclass(frozen=True)
class TrainSettings:
    """A round's optimizer and batch settings (the task's ``train`` settings, its batch-order seed
    and whether activations travel in half precision; ``dp_sgd``: sample-level DP-SGD's terms, or
    None)."""

    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    epochs: int
    seed: int
    half_precision: bool = False
    dp_sgd: DpSgdConfig | None = None

    @classmethod
    def of(cls, train: TrainConfig, seed: int, half_precision: bool = False) -> TrainSettings:
        """The settings of a task's ``train`` config, with the round's ``seed``."""
        return cls(train.lr, train.momentum, train.weight_decay, train.batch_size, train.local_epochs, seed,
                   half_precision, train.dp_sgd)


@dataclass
class TrainContext:
    """Where and under what terms a round trains: its clock, its Main Server exchange (none for a
    whole-model round), the algorithm's device logic and task extras, its deadline, the compute
    threads and the torch device its trained blocks live on, the run's privacy defences (see
    :func:`train_round`)."""

    clock: RoundClock
    send_step: StepFn | None = None
    logic: DeviceLogic | None = None
    extras: Payload | None = None
    deadline: float | None = None
    compute: Compute | None = None
    torch_device: torch.device | None = None
    #: U-shaped mode: the exchange of the two halves of every step (``send_step`` is then None).
    u_steps: UShapedSteps | None = None
    #: The run's privacy defences (``split_privacy.defences``), applied to what the device sends.
    defences: Sequence[PrivacyDefence] = field(default_factory=list)
    #: The model's classes (the label defences draw among them).
    num_classes: int = 0


def train_round(model: SplitModel, split_point: int, weights: dict[str, torch.Tensor] | None, data: ArrayDataset,
                settings: TrainSettings, context: TrainContext, head_start: int | None = None) -> LocalResult:
    """Train blocks[:split_point] of ``model`` in place for one round, on the device its trained
    blocks live on (``--torch-device``; the weights are copied there). ``weights``: the round's
    starting weights, loaded when the training starts (on a compute thread, for a whole-model
    round); blocks still on the meta device (a virtual device's model, built per task) are
    allocated on the context's ``torch_device`` (default the CPU) first. ``weights`` None: the
    portion already holds them. ``settings``: the optimizer, the batches and their seed.

    The ``context`` (:class:`TrainContext`) names the rest. With ``send_step`` (split mode) each step sends the cut's activations and labels to the Main
    Server and backpropagates the returned dfx; with ``u_steps`` (U-shaped mode, ``head_start``:
    the device also trains ``blocks[head_start:]``) it sends the activations, computes the loss on
    its head over the middle's output, sends the gradient there and backpropagates the returned
    dfx; without either the device holds the whole model and trains on the algorithm's local
    objective (``logic.loss``; cross-entropy by default). The run's privacy defences change what a
    split round sends (:mod:`shared.algorithms.privacy_defence`). With ``settings.dp_sgd`` every
    step is a DP-SGD step on the trained blocks (:mod:`device_agent.dp_sgd`).
    ``deadline`` (a ``time.monotonic()`` instant) is checked before every step: past it the
    round is given up with :class:`TaskExpired`. ``compute`` (the agent's compute threads, see
    :mod:`device_agent.compute`; none: this thread) runs the whole local training when there is
    no Main Server, as one section; an emulated kind's stretch sleeps after it, on this thread.
    Split mode computes on this thread: its forward and backward sections are short and each
    waits for the Main Server in between, and queueing them on the compute threads changed the
    emulated times the sliding split is decided on (measured: the default S2FL run's median rule
    then put every device at split 1 from round 7 on; benchmarks/README.md, "Measured and not
    adopted"). ``extras`` are the task's validated
    ``Algorithm.TaskExtras`` for ``logic.begin_round`` (none: the empty payload).

    The data set stays on the CPU and each batch is moved to the device after it is drawn, so
    the seeded batch order is the same on every device. Activations go back to the CPU (in
    half precision first when asked, halving the copy) for the wire; dfx comes to the device.
    """
    portion = model.device_portion(split_point, len(model.blocks) if head_start is None else head_start)
    split = context.send_step is not None or context.u_steps is not None
    training = _RoundTraining(portion, weights, data, settings, context,
                              leaves_out_single_samples(model, split_point, split))
    try:
        if not split:
            training.whole_model()
        else:
            training.split()
    finally:
        if training.private is not None:
            training.private.close()
    return LocalResult(steps=training.steps, train_loss=sum(training.losses) / max(1, len(training.losses)))


class _RoundTraining:
    """One :func:`train_round`: the portion it trains, its progress, and its two modes."""

    def __init__(self, portion: Portion, weights: dict[str, torch.Tensor] | None, data: ArrayDataset,
                 settings: TrainSettings, context: TrainContext, no_single: bool) -> None:
        self.portion = portion
        self.no_single = no_single
        self.weights = weights
        self.data = data
        self.settings = settings
        self.context = context
        self.logic = context.logic or DeviceLogic({})
        self.losses: list[float] = []
        self.steps = 0
        #: The round's DP-SGD (``settings.dp_sgd``), once :meth:`start` has wrapped the optimizer.
        self.private: PrivateSteps | None = None

    def start(self) -> tuple[torch.optim.Optimizer, ArrayDataset, torch.device]:
        """Load the task's weights, begin the algorithm's round, build the optimizer. Called where
        the training runs (a compute thread, for a whole-model round): a device waiting for its
        turn holds no weights of its own, only the task's, which its agent's devices share
        (device_agent/weights_cache.py)."""
        portion, settings = self.portion, self.settings
        if self.weights is not None:
            load_portion(portion, self.weights, self.context.torch_device)
        extras = self.context.extras
        self.logic.begin_round(portion, extras if extras is not None else Payload(), self.data)
        portion.train()
        optimizer: torch.optim.Optimizer = torch.optim.SGD(portion.parameters(), lr=settings.lr,
                                                           momentum=settings.momentum,
                                                           weight_decay=settings.weight_decay)
        device = model_device(portion)
        if settings.dp_sgd is not None:
            self.private = PrivateSteps(portion, optimizer, settings.dp_sgd, settings.batch_size,
                                        private_generator(device))
            optimizer = self.private.optimizer
        return optimizer, self.logic.training_data(self.data), device

    def check_deadline(self, owed_s: float = 0.0) -> None:
        """:class:`TaskExpired` once the deadline has passed (or will have, ``owed_s`` later), or
        the Fed Server has closed the attempt without the device (:meth:`RoundClock.check_taken_out`)."""
        self.context.clock.check_taken_out()
        deadline = self.context.deadline
        if deadline is not None and time.monotonic() + owed_s > deadline:
            raise TaskExpired(f"deadline passed after {self.steps} steps")

    def batches(self, train_data: ArrayDataset) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The round's seeded mini-batches of ``train_data``."""
        settings = self.settings
        return batches(train_data, settings.batch_size, settings.epochs, settings.seed,
                       no_single=self.no_single)

    def whole_model(self) -> None:
        """The whole local training as one section: nothing in it waits for anyone else. An
        emulated kind's stretch is slept once the section is done, so the deadline is checked
        against the time the device will have taken, stretch included.

        The section's size for the queue: the device's samples, times an emulated kind's stretch
        (a Low device sleeps 10x its compute afterwards, so it is the round's longest and goes
        first). The samples of the shard, not of the algorithm's training part, which is known
        only once the round has begun in the section (FedBC holds the same fraction back everywhere)."""
        clock = self.context.clock
        compute = self.context.compute if self.context.compute is not None else InlineCompute()

        def local_training() -> None:
            t0, cpu0 = time.monotonic(), time.thread_time()
            optimizer, train_data, device = self.start()
            for x, y in self.batches(train_data):
                self.check_deadline(clock.stretch_of(time.monotonic() - t0, time.thread_time() - cpu0))
                loss = self.logic.loss(self.portion, x.to(device), y.to(device))  # .to: no copy on the CPU
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                self.losses.append(float(loss.detach()))  # waits for CUDA/MPS: the clock sees the compute
                self.steps += 1
            optimizer.zero_grad(set_to_none=True)  # the last step's gradients: as big as the weights

        clock.section(compute, local_training, work=len(self.data) * self.settings.epochs * clock.stretch_factor())

    def split(self) -> None:
        """Split mode, on this thread: a step's sections are short and interleaved with the Main
        Server's answers (see :func:`train_round`). The privacy defences add their penalty to the
        device's objective and change the activations (and, U-shaped, the gradient) it sends."""
        clock, portion, context = self.context.clock, self.portion, self.context
        optimizer, train_data, device = self.start()
        front = portion.front() if isinstance(portion, DevicePortion) else portion
        # Drawn from the system's entropy: noise the servers could replay (the run's seed) would hide nothing.
        generator = private_generator(device)
        for step, (x, y) in enumerate(self.batches(train_data)):
            self.check_deadline()
            with clock.compute():
                optimizer.zero_grad(set_to_none=True)
                x = x.to(device)  # .to: no copy on the CPU
                fx = front(x)
                penalties = [p for d in context.defences if (p := d.activation_penalty(x, fx)) is not None]
                sent = fx.detach()
                for defence in context.defences:
                    sent = defence.sent_activations(sent, generator)
                synchronize(device)
            sent = sent.half() if self.settings.half_precision else sent
            if context.u_steps is not None and isinstance(portion, DevicePortion):
                dfx, loss_value = self._head(step, context.u_steps, portion.head(), sent.cpu(), y, generator)
            else:
                assert context.send_step is not None
                dfx, loss_value = context.send_step(step, sent.cpu(), y)
            with clock.compute():
                # One pass: the penalties share the front's graph with fx.
                torch.autograd.backward([fx, *penalties],
                                        [dfx.to(device=fx.device, dtype=fx.dtype), *map(torch.ones_like, penalties)])
                optimizer.step()
                synchronize(device)  # CUDA/MPS run asynchronously: the clock must see the compute
            self.losses.append(loss_value)
            self.steps += 1
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients: as big as the weights

    def _head(self, step: int, steps: UShapedSteps, head: Portion, sent: torch.Tensor, y: torch.Tensor,
              generator: torch.Generator) -> tuple[torch.Tensor, float]:
        """U-shaped mode, the middle of one step: the activations ``sent`` up, the middle's output
        back, the loss on this device's head (its gradients, scaled by the loss weight the Main
        Server gives the device, left on the head), the gradient at the head's input up (from the
        targets the defences give, the labels by default), dfx back. Returns dfx and the loss."""
        clock, logic = self.context.clock, self.logic
        output, loss_weight = steps.forward(step, sent)
        with clock.compute():
            device = model_device(head)
            out = output.to(device=device, dtype=torch.float32).requires_grad_(True)
            logits = head(out)
            y = y.to(device)
            loss = logic.criterion.mean(logits, y)
            params = [p for p in head.parameters() if p.requires_grad]
            targets = y
            for defence in self.context.defences:
                targets = defence.gradient_targets(targets, self.context.num_classes, generator)
            noised = targets is not y
            grads = torch.autograd.grad(loss, [out, *params], retain_graph=noised)
            for p, g in zip(params, grads[1:]):
                p.grad = g * loss_weight
            gradient = torch.autograd.grad(logic.criterion.mean(logits, targets), out)[0] if noised else grads[0]
            synchronize(device)
        sent_gradient = gradient.detach().half() if self.settings.half_precision else gradient.detach()
        return steps.backward(step, sent_gradient.cpu(), tuple(sent.shape)), float(loss.detach())
