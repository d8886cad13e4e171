"""What every part of the Fed Server's run logic shares: the configuration, the global model and
the algorithm, the device registry and the published weights, the open attempt and evaluation
phase, and the events that wake the round driver and the waiting devices.

State and the few rules every part applies alike (which attempt is open, taking a device out of
it); what each part decides lives in its own module (``fed_server/coordinator.py`` lists them).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from fed_server.broadcast import Broadcast
from fed_server.devices import DeviceRegistry
from fed_server.evaluation_round import EvaluationRound
from fed_server.fed_round import FedRound
from fed_server.device_pace import DevicePace
from fed_server.missed_deadlines import MissedDeadlines
from fed_server.privacy import RunPrivacy
from fed_server.sample_privacy import SampleLedger
from fed_server.weights_store import WeightsStore
from shared.algorithms.base import Algorithm
from shared.algorithms.selection import DeviceSelector
from shared.config import RunConfig
from shared.errors import Conflict
from shared.losses import Loss, build_loss
from shared.models.split_model import SplitModel
from shared.portions import device_state, portion_state
from shared.recording import Recording

log = logging.getLogger("fed_server")

#: Called with (attempt, replica URL, device -> why) when devices of a split attempt leave it at
#: the Fed Server, so that replica stops waiting for them (``driver.send_departures``).
DepartureHook = Callable[[FedRound, str, dict[str, str]], None]


@dataclass
class RunCore:
    """The run's shared state. ``torch_device``: where the global model is evaluated (it stays on
    the CPU, where uploads arrive and are aggregated)."""

    config: RunConfig
    run_id: str
    model: SplitModel
    algorithm: Algorithm
    selector: DeviceSelector
    devices: DeviceRegistry
    missed: MissedDeadlines
    pace: DevicePace
    evaluation_mode: str
    torch_device: torch.device | None = None
    #: The run's loss (``train.loss``): the server's evaluation computes it (shared/losses.py).
    loss: Loss = field(default_factory=build_loss)
    #: The weights tasks name, packed once each and fetched by id (fed_server/weights_store.py).
    weights: WeightsStore = field(default_factory=WeightsStore)
    round: FedRound | None = None              # the open attempt
    evaluating: EvaluationRound | None = None  # the open federated evaluation phase
    finished: bool = False
    started_at: float | None = None            # when the first attempt of this process began
    # Set whenever something a waiting round driver checks may have changed (a device
    # registered, a report, an update or a group portion arrived): the driver wakes on it
    # instead of polling. Methods run on the event loop, so setting it needs no lock.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Posted whenever a waiting device's answer may have changed (a round's tasks went out,
    # follow-ups were planned, an evaluation phase began, the run finished): devices wait for
    # work on it (long-poll, ``TaskDispatch.next_task``) instead of polling.
    work_posted: Broadcast = field(default_factory=Broadcast)
    on_departure: DepartureHook | None = None
    #: ``--record-received``: keep what devices and the Main Server send (honest-but-curious, for
    #: studying what a server learns; shared/recording.py). None: nothing is kept.
    recording: Recording | None = None

    def record_state(self, fed_round: FedRound, name: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep ``state`` as ``name`` in the attempt's records, where this round is recorded."""
        if self.recording is not None and self.recording.keeps(fed_round.index):
            self.recording.state(fed_round.index, fed_round.round_id, name, state)
    #: The run's differential privacy (None without ``privacy.clipping``; fed_server/privacy.py).
    privacy: RunPrivacy | None = None
    #: Each device's sample-level epsilon under DP-SGD (None without ``train.dp_sgd``;
    #: fed_server/sample_privacy.py).
    sample_privacy: SampleLedger | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.model.blocks)

    @property
    def head_start(self) -> int:
        """Where the devices' heads start (U-shaped mode), or the model's end: the Main Server's
        portion ends there (``split.head_blocks``)."""
        return self.config.split.head_start(self.num_blocks)

    def portion(self, end: int) -> dict[str, torch.Tensor]:
        """Blocks ``[0, end)`` of the global model."""
        return portion_state(self.model, 0, end)

    def device_portion(self, split_point: int) -> dict[str, torch.Tensor]:
        """What a device cut at ``split_point`` trains of the global model: blocks
        ``[0, split_point)``, and in U-shaped mode the head."""
        return device_state(self.model, split_point, self.head_start)

    def holdout(self) -> float | None:
        """The fraction every device holds out for federated evaluation; None: the server evaluates."""
        return self.config.evaluation.holdout if self.evaluation_mode == "federated" else None

    def summed_weight(self, device: str) -> float:
        """A device's weight in an attempt whose updates are summed before the algorithm sees them
        (private or securely aggregated): 1 when noise is added (each device's sensitivity is the
        clip bound, whatever its data size), else its sample count (Algorithm 1's |D_i|)."""
        if self.privacy is not None and self.privacy.noise_multiplier is not None:
            return 1.0
        return float(self.devices.devices[device].num_samples)

    def post_work(self) -> None:
        """Wake every device waiting for a task: its answer may have changed (event loop)."""
        self.work_posted.post()

    def open_round(self, round_id: int) -> FedRound:
        """The open attempt, which must be ``round_id``; Conflict otherwise (a stale upload)."""
        if self.round is None or self.round.round_id != round_id:
            current = self.round.round_id if self.round else None
            raise Conflict(f"round {round_id} is not open (open round: {current})")
        return self.round

    def exclude(self, fed_round: FedRound, devices: Iterable[str], reason: str, tell_main_server: bool = False) -> None:
        """Take ``devices`` out of the attempt (:meth:`FedRound.exclude`) and wake the driver, which
        may now find the attempt complete. ``tell_main_server``: the Main Server does not know yet
        (the device left at the Fed Server), so its replica is told (:attr:`on_departure`)."""
        new = fed_round.exclude(devices, reason)
        if not new:
            return
        log.warning("round %d (attempt %d): %s taken out: %s", fed_round.index, fed_round.round_id,
                    ", ".join(sorted(new)), reason)
        self.changed.set()
        if tell_main_server and fed_round.uses_main_server and self.on_departure is not None:
            by_replica: dict[str, dict[str, str]] = {}
            for device in sorted(new):
                url = fed_round.assignments[device].main_server_url
                if url is not None:
                    by_replica.setdefault(url, {})[device] = reason
            for url, reasons in by_replica.items():
                self.on_departure(fed_round, url, reasons)
