"""Client time table and sliding split choice of the Fed Server (S2FL paper, Section 3.1, Eq. 1).

The table holds, per device and split candidate ``j`` (0..K-1, larger ``j`` = more layers on
the device), the running average of the measured round time (dispatch to upload).

* Warm-up: in rounds 1..K every device gets candidate ``j = round - 1``.
* After warm-up: take the median ``m`` of the ``x * K`` times of the round's ``x`` devices and
  give each device the candidate whose time is closest to ``m``.

Decisions where the paper is silent (documented here and in the methods):

* running average ``new = (1 - s) * old + s * measured``; the first measurement is stored as is;
* a missing cell (the device was never measured at ``j``) is filled with the Eq. 1 estimate
  times :meth:`ClientTimeTable.calibration` (median measured/predicted ratio over the table, which
  scales the analytical model to this testbed's real overheads); with no estimate (no estimator,
  or a device whose link rate is not known yet: a real device before its first round), with the
  median of the other devices' entries for ``j``; if neither exists the cell stays unknown and is
  left out of the median and of the device's choices;
* a device with no known time at all after warm-up keeps cycling through the candidates,
  ``j = (round - 1) % K``, so that it gets measured;
* ties in ``|t - m|`` (within 1e-9 relative) go to the larger ``j``, i.e. more layers on the device,
  which moves work off the shared Main Server.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DeviceProfile", "SplitCostView", "eq1_bytes", "eq1_time", "ClientTimeTable"]


@dataclass(frozen=True)
class DeviceProfile:
    """What a device reports about itself: compute speed (FLOP/s) and transfer rate (bytes/s;
    None: not known, see :meth:`fed_server.split_planner.SplitPlanner.rate_of`)."""

    flops: float
    rate: float | None


@dataclass(frozen=True)
class SplitCostView:
    """Eq. 1 inputs for one split candidate, per ONE sample (bytes and FLOPs).

    ``client_param_bytes`` = |Wc|; ``activation_bytes`` = q; ``client_flops`` / ``server_flops`` =
    forward+backward FLOPs of the client / server portion for one sample. U-shaped mode
    (``split.u_shaped``; docs/s2fl.md, "U-shaped mode") adds the device's head: ``head_param_bytes``
    = |Wh|, ``head_activation_bytes`` = q_h (the middle's output, down, and its gradient, up) and
    ``head_flops`` = Fh, and ``server_flops`` is then the middle's alone; all three are 0 otherwise.
    """

    client_param_bytes: int
    activation_bytes: int
    client_flops: float
    server_flops: float
    head_param_bytes: int = 0
    head_activation_bytes: int = 0
    head_flops: float = 0.0

    @property
    def device_param_bytes(self) -> int:
        """What the device downloads and uploads of the model: |Wc| (+ |Wh|)."""
        return self.client_param_bytes + self.head_param_bytes


def eq1_bytes(cost: SplitCostView, samples: int) -> float:
    """Eq. 1's bytes on the device's link in one round: ``2|Wc| + 2pq`` (the client portion down
    and up, each sample's activation up and its gradient down); U-shaped, ``2(|Wc| + |Wh|) +
    2p(q + q_h)`` (the head down and up too, and each sample's middle output down and its
    gradient up)."""
    if samples < 0:
        raise ValueError(f"samples must be >= 0, got {samples}")
    return 2.0 * cost.device_param_bytes + 2.0 * float(samples) * (cost.activation_bytes + cost.head_activation_bytes)


def eq1_time(profile: DeviceProfile, cost: SplitCostView, samples: int, server_flops: float) -> float:
    """Eq. 1: ``T = 2|Wc|/R + 2pq/R + Fc/Comp_c + Fs/Comp_s`` (seconds); U-shaped,
    ``T = 2(|Wc| + |Wh|)/R + 2p(q + q_h)/R + (Fc + Fh)/Comp_c + Fs/Comp_s`` with ``Fs`` the middle's.

    ``p = samples``, ``q = cost.activation_bytes``, ``Fc = cost.client_flops * p``,
    ``Fh = cost.head_flops * p``, ``Fs = cost.server_flops * p``, ``R = profile.rate``,
    ``Comp_c = profile.flops`` and ``Comp_s = server_flops`` (the Main Server's FLOP/s).
    """
    if not (profile.flops > 0 and profile.rate is not None and profile.rate > 0 and server_flops > 0):
        raise ValueError("device flops, device rate and server flops must be > 0")
    p = float(samples)
    comm = eq1_bytes(cost, samples) / profile.rate
    return comm + (cost.client_flops + cost.head_flops) * p / profile.flops + cost.server_flops * p / server_flops


class ClientTimeTable:
    """Per-device, per-split-candidate running average of measured round times (seconds)."""

    def __init__(self, num_candidates: int = 3, smoothing: float = 0.5) -> None:
        if int(num_candidates) < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        if not (0.0 < float(smoothing) <= 1.0):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.num_candidates = int(num_candidates)
        self.smoothing = float(smoothing)
        self._table: dict[str, dict[int, float]] = {}

    def _check_j(self, j: int) -> int:
        jj = int(j)
        if jj != j or not 0 <= jj < self.num_candidates:
            raise ValueError(f"candidate index must be in 0..{self.num_candidates - 1}, got {j}")
        return jj

    def record(self, device: str, j: int, seconds: float) -> None:
        """Fold a measured round time into cell (device, j): ``(1-s)*old + s*measured``."""
        jj = self._check_j(j)
        t = float(seconds)
        if not math.isfinite(t) or t < 0.0:
            raise ValueError(f"round time must be finite and >= 0, got {seconds}")
        row = self._table.setdefault(str(device), {})
        old = row.get(jj)
        row[jj] = t if old is None else (1.0 - self.smoothing) * old + self.smoothing * t

    def get(self, device: str, j: int) -> float | None:
        """The cell's running average, or ``None`` if never measured."""
        return self._table.get(str(device), {}).get(self._check_j(j))

    def entries(self) -> dict[str, dict[int, float]]:
        """A deep copy of the table, for checkpoints and metrics."""
        return {dev: dict(row) for dev, row in self._table.items()}

    def load_entries(self, entries: Mapping[str, Mapping[int, float]]) -> None:
        """Replace the table's cells (a resumed run restores its checkpointed table)."""
        fresh = self.from_entries(entries, self.num_candidates, self.smoothing)
        self._table = fresh._table

    @classmethod
    def from_entries(
        cls,
        entries: Mapping[str, Mapping[int, float]] | Mapping[str, Mapping[str, float]],
        num_candidates: int = 3,
        smoothing: float = 0.5,
    ) -> ClientTimeTable:
        """Rebuild a table from :meth:`entries` output (string ``j`` keys from JSON accepted)."""
        table = cls(num_candidates=num_candidates, smoothing=smoothing)
        for dev, row in entries.items():
            for j, t in row.items():
                jj = table._check_j(int(j))
                tt = float(t)
                if not math.isfinite(tt) or tt < 0.0:
                    raise ValueError(f"invalid time {t!r} for ({dev!r}, {j!r})")
                table._table.setdefault(str(dev), {})[jj] = tt
        return table

    def calibration(self, estimate: Callable[[str, int], float]) -> float:
        """Median over existing cells of ``measured / estimate(device, j)``; 1.0 if none.

        Scales Eq. 1 predictions to this testbed's reality (framework overheads, serialisation,
        contention that Eq. 1 ignores). Cells whose estimate is not finite and > 0 are skipped.
        """
        ratios: list[float] = []
        for dev in sorted(self._table):
            for j in sorted(self._table[dev]):
                est = float(estimate(dev, j))
                if math.isfinite(est) and est > 0.0:
                    ratios.append(self._table[dev][j] / est)
        return float(np.median(ratios)) if ratios else 1.0

    def _column_median(self, j: int, exclude: str) -> float | None:
        vals = [row[j] for dev, row in self._table.items() if dev != exclude and j in row]
        return float(np.median(vals)) if vals else None

    def choose(
        self,
        round_index: int,
        devices: Sequence[str],
        estimate: Callable[[str, int], float] | None = None,
    ) -> dict[str, int]:
        """Split candidate per device for a 1-based round (the paper's median rule).

        Rounds 1..K: every device gets ``j = round_index - 1`` (warm-up). Later rounds: fill
        each (device, j) from the table, else ``estimate(device, j) * calibration``, else the
        median of the other devices' entries for ``j``; ``m`` = median of the known times of
        all ``len(devices) * K`` cells; each device gets the ``j`` whose time is closest to
        ``m``, ties -> the larger ``j``. Deterministic.
        """
        if int(round_index) < 1:
            raise ValueError(f"round_index is 1-based, got {round_index}")
        k = self.num_candidates
        devs = [str(d) for d in devices]
        if round_index <= k:
            return {d: int(round_index) - 1 for d in devs}

        cycle_j = (int(round_index) - 1) % k
        cal = self.calibration(estimate) if estimate is not None else 1.0
        times: dict[str, dict[int, float]] = {}
        for d in devs:
            row: dict[int, float] = {}
            for j in range(k):
                t = self.get(d, j)
                if t is None and estimate is not None:
                    est = float(estimate(d, j))
                    t = est * cal if math.isfinite(est) and est >= 0.0 else None
                if t is None:
                    t = self._column_median(j, exclude=d)
                if t is not None:
                    row[j] = t
            times[d] = row

        known = [t for d in devs for t in times[d].values()]
        if not known:
            return {d: cycle_j for d in devs}
        m = float(np.median(known))

        choice: dict[str, int] = {}
        for d in devs:
            row = times[d]
            if not row:
                choice[d] = cycle_j
                continue
            best_j, best_gap = -1, math.inf
            for j in sorted(row):  # ascending, so a (near-)tie replaces with the larger j
                gap = abs(row[j] - m)
                if gap <= best_gap + 1e-9 * max(1.0, abs(m)):
                    best_j, best_gap = j, min(gap, best_gap)
            choice[d] = best_j
        return choice
