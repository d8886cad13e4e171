"""Each device's sample-level epsilon under DP-SGD (``train.dp_sgd``; docs/privacy.md, "Sample-level
DP-SGD"), accounted by the Fed Server from what it knows, not from what a device reports.

A device with ``n`` samples takes ``local_epochs * ceil(n / batch_size)`` DP-SGD steps in each task,
each a Gaussian mechanism of ``noise_multiplier`` on a batch sampled at rate ``q = batch_size / n``.
Every task an attempt hands out counts, whether or not its upload is aggregated: a device that
trained and uploaded released its blocks to the Fed Server either way, and one cut before
uploading is counted too, which overstates, never understates, its epsilon. The tasks are counted
as the attempt begins, and noted at once in the run directory: an attempt in flight when the Fed
Server stops is run again on resume, and both count. The epsilon of each
device at ``delta`` is Opacus's Renyi-DP accountant's over its steps; the run reports the worst
device's, which bounds every device's. Only devices that trained in a round are computed again
(a device's epsilon only grows), so a round costs one accountant call per device it counted.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from fed_server.run_dir import RunDirectory
from shared.config import DpSgdConfig, TrainConfig
from shared.local_steps import steps_per_round
from shared.privacy.accountant import epsilon_of


class SampleLedger:
    """Per device: its samples and the tasks counted; and their epsilons."""

    def __init__(self, terms: DpSgdConfig, train: TrainConfig, run_dir: RunDirectory | None = None) -> None:
        self.terms = terms
        #: Where each count is noted before the tasks go out (None: nowhere, in tests).
        self.run_dir = run_dir
        self.batch_size = train.batch_size
        self.epochs = train.local_epochs
        self._samples: dict[str, int] = {}
        self._tasks: dict[str, int] = {}
        self._epsilon: dict[str, float] = {}

    def steps(self, samples: int) -> int:
        """DP-SGD steps a task of a device with ``samples`` samples takes (no batch is left out: a
        model with BatchNorm cannot train with DP-SGD)."""
        return steps_per_round(max(1, samples), self.batch_size, self.epochs)

    def count(self, devices: Mapping[str, int]) -> None:
        """Count one task for each device in ``devices`` (device id -> its registered samples)."""
        for device, samples in devices.items():
            self._samples[device] = samples
            self._tasks[device] = self._tasks.get(device, 0) + 1
            self._epsilon[device] = self.epsilon(device)
        if self.run_dir is not None:
            self.run_dir.write_released("sample_privacy", self.state_dict())

    def epsilon(self, device: str) -> float:
        """The device's epsilon at ``delta`` over the tasks counted (0 before any)."""
        tasks = self._tasks.get(device, 0)
        if not tasks:
            return 0.0
        samples = max(1, self._samples[device])
        return _epsilon(self.terms.noise_multiplier, min(1.0, self.batch_size / samples), tasks * self.steps(samples),
                        self.terms.delta)

    def worst(self) -> tuple[str, float] | None:
        """The device with the largest epsilon and its epsilon (None before any task)."""
        if not self._epsilon:
            return None
        device = max(self._epsilon, key=lambda d: (self._epsilon[d], d))
        return device, self._epsilon[device]

    def record(self) -> dict[str, Any]:
        """The round record's ``sample_privacy`` fields: the worst device's epsilon so far, at delta."""
        worst = self.worst()
        return {"epsilon": worst[1] if worst else 0.0, "device": worst[0] if worst else None,
                "delta": self.terms.delta, "noise_multiplier": self.terms.noise_multiplier,
                "max_grad_norm": self.terms.max_grad_norm}

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint: device -> [samples, tasks counted]."""
        return {d: [self._samples[d], n] for d, n in sorted(self._tasks.items())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s output (a resumed run's epsilons go on from there), or
        from the counts noted after it where they hold more tasks (an attempt in flight when the
        Fed Server stopped)."""
        released = self.run_dir.read_released("sample_privacy") if self.run_dir is not None else None
        if released is not None and sum(int(v[1]) for v in released.values()) > sum(int(v[1]) for v in state.values()):
            state = released
        self._samples = {str(d): int(v[0]) for d, v in state.items()}
        self._tasks = {str(d): int(v[1]) for d, v in state.items()}
        self._epsilon = {d: self.epsilon(d) for d in self._tasks}


@functools.lru_cache(maxsize=65536)
def _epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """Opacus's RDP epsilon of ``steps`` steps at these terms (devices of one shard size share it)."""
    return epsilon_of("rdp", [(noise_multiplier, sample_rate, steps)], delta)
