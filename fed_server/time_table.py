"""Client time table and sliding split choice of the Fed Server (S2FL paper, Section 3.1, Eq. 1).

The table holds, per device and split candidate ``j`` (0..K-1, larger ``j`` = more layers on
the device), the running average of the measured round time (dispatch to upload), kept as its
three measured parts: transfer, compute and the rest (the Main Server's training of its steps).

* Warm-up (``every_split``, the paper's): in rounds 1..K every device gets ``j = round - 1``.
  ``estimated`` (the default, a deviation: the paper's costs a slow device K rounds at splits far
  from the median): round 1 puts every device at ``j = 0``; from round 2 on the median rule runs on
  the measured cells and on estimates of the untried ones, so a device tries a split only when the
  rule, on those estimates, picks it.
* Median rule: take the median ``m`` of the ``x * K`` times of the round's ``x`` devices and
  give each device the candidate whose time is closest to ``m``.

Decisions where the paper is silent (documented here, in the methods and in docs/s2fl.md):

* running average ``new = (1 - s) * old + s * measured``; the first measurement is stored as is;
* **the cells follow a device's changes**: each device has a link level and a compute level
  (1 at first); a cell's transfer and compute parts are stored divided by the levels of when they
  were measured and read multiplied by the levels of now. A measured part that differs from its
  cell's by more than :data:`CHANGE_RATIO` times either way (and by at least :data:`CHANGE_SHARE`
  of the cell) is a change, not noise: the level moves by that ratio, so every cell of the device
  follows at once, the splits it has not used lately included;
* **a cut attempt is a censored entry**: a device that left an attempt unfinished at candidate
  ``j`` after ``W`` seconds (cut at a deadline) takes at least ``W`` there. Its link level rises
  until the cell reads ``W`` (its compute level where the cell has no transfer time), and until
  it is measured again it gets its cheapest candidate among those that read less than ``W`` (its
  censored ones excluded); where none does, its cheapest: it is left to its missed-deadline sit-out;
* a missing cell (the device was never measured at ``j``) is scaled from the device's latest
  measured cell term by term (Eq. 1 with the compute speed, link rate and server speed measured
  there); for a device with no measured cell, the Eq. 1 estimate times :meth:`ClientTimeTable.calibration` (median measured/predicted ratio over the table, which
  scales the analytical model to this testbed's real overheads); with no estimate (no estimator,
  or a device whose link rate is not known yet: a real device before its first round), with the
  median of the other devices' entries for ``j``; if neither exists the cell stays unknown and is
  left out of the median and of the device's choices;
* a device with no known time at all after warm-up keeps cycling through the candidates,
  ``j = (round - 1) % K``, so that it gets measured;
* **the tie-break where the median says nothing**: a device whose times at every candidate are
  within the table's noise of each other (the spread at most ``2 * noise`` times its smallest
  time; :meth:`ClientTimeTable.noise`), or all at most ``m /`` :data:`FAR_BELOW`, gets its deepest
  candidate (more layers on the device, less work for the Main Server: it is off the critical
  path at every split). Otherwise ties in ``|t - m|`` (within 1e-9 relative) go to the larger ``j``;
* **the bottleneck cap** (``bottleneck_cap``, on by default): the round lasts at least as long as
  its slowest device at that device's cheapest candidate, ``b = max_d min_j t(d, j)`` (device
  ``B``). A device is chosen among its candidates whose round's critical path reads at most
  ``b * (1 + noise)``, so the median rule balances the devices below the bottleneck and never
  makes one of them a new, longer one. A group's members meet at a barrier every step, so a
  device's download of its portion comes before every member's first step and its upload after
  their last: with ``e`` the one-way seconds of the device's portion at ``j`` (``portion_s``: its
  bytes over the device's measured link rate) and ``e_B`` the bottleneck's at its cheapest, the
  critical path is ``2 max(e, e_B) + max(t - 2e, b - 2e_B)``, which is ``b`` for a device whose
  portion moves no slower than the bottleneck's, and ``t`` where ``e`` is not known. Where no
  candidate fits, the device gets the one of shortest critical path;
* **no dominated split** (``undominated``, on by default): the median rule chooses only among the
  allowed candidates that no deeper allowed candidate matches in time, ``t(k) <= t(j) (1 + noise)``
  for some ``k > j``. A dominated candidate is closest to ``m`` only for being slow (an early cut
  whose activations cost more than the layers it spares the device): it would put more layers'
  work on the Main Server, which a group's members wait for at every step, for no shorter round.
  The paper's rule as written: ``bottleneck_cap=False, undominated=False``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Bottleneck", "ClientTimeTable", "DeviceProfile", "RoundParts", "SplitCostView", "critical_path", "eq1_bytes",
           "eq1_time", "warm_up_rounds"]


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


#: A measured part (transfer or compute) at least this many times its cell's part, or at most its
#: inverse, is a change of the device (a link that slowed down, a board that throttles), not noise.
CHANGE_RATIO = 1.5
#: ... provided it moves the cell by at least this share of the cell's time: a part of a few
#: milliseconds varies by more than CHANGE_RATIO from noise alone.
CHANGE_SHARE = 0.1
#: A device whose times at every candidate are at most ``m / FAR_BELOW`` is off the round's
#: critical path wherever it is cut: it gets its deepest candidate.
FAR_BELOW = 2.0
#: The table's noise (relative) until it has seen NOISE_SAMPLES re-measurements, and its floor.
NOISE_DEFAULT = 0.1
NOISE_FLOOR = 0.02
NOISE_SAMPLES = 3
#: How many of the latest re-measurements the noise is the median of.
NOISE_WINDOW = 64
#: ``split.warm_up``: estimate the untried candidates after one round, or try every one (the paper).
WARM_UPS = ("estimated", "every_split")


def warm_up_rounds(warm_up: str, num_candidates: int) -> int:
    """Rounds 1..n whose splits ``warm_up`` sets, not the median rule: one per candidate for the
    paper's (``every_split``), the first alone for ``estimated``."""
    return num_candidates if warm_up == "every_split" else 1

#: Eq. 1's terms of (device, candidate): bytes on the device's link, client FLOPs, server FLOPs.
Terms = Callable[[str, int], tuple[float, float, float]]
#: One-way seconds of a device's portion at a candidate on its link; None where its rate is not known.
PortionSeconds = Callable[[str, int], float | None]


def critical_path(devices: Iterable[tuple[float, float]]) -> float:
    """A group's round from its devices' (time, one-way seconds of the portion in that time): its
    members meet at a barrier every step, so the slowest portion download comes before every
    member's first step and the slowest upload after their last, ``2 max e + max (t - 2e)``; each
    ``e`` at most ``t / 2`` (the time holds both transfers)."""
    pairs = [(t, min(max(e, 0.0), t / 2.0)) for t, e in devices]
    return 2.0 * max(e for _, e in pairs) + max(t - 2.0 * e for t, e in pairs)


@dataclass(frozen=True)
class Bottleneck:
    """The round's bottleneck: the largest of the devices' cheapest times, ``time_s``, and the
    one-way seconds of that device's portion there, ``edge_s`` (0 where not known)."""

    time_s: float
    edge_s: float = 0.0

    def path(self, t: float, edge_s: float | None) -> float:
        """The round's critical path with a device whose time is ``t`` and whose portion moves
        in ``edge_s`` each way: its download before the group's first step and its upload after the
        last, around the slower of its steps and the bottleneck's (module docstring); ``t`` where
        ``edge_s`` is not known."""
        if edge_s is None or not math.isfinite(t) or self.time_s == math.inf:
            return t
        return critical_path([(self.time_s, self.edge_s), (t, edge_s)])


@dataclass(frozen=True)
class RoundParts:
    """A round time (or a cell of the table) in its measured parts, seconds: the device's transfers
    (its link), its compute, and the rest (the Main Server's training of its steps)."""

    transfer_s: float
    compute_s: float
    other_s: float

    @property
    def total(self) -> float:
        return self.transfer_s + self.compute_s + self.other_s

    def scaled(self, link: float, compute: float) -> RoundParts:
        """The transfer part times ``link``, the compute part times ``compute``."""
        return RoundParts(self.transfer_s * link, self.compute_s * compute, self.other_s)

    def mixed(self, new: RoundParts, s: float) -> RoundParts:
        """The running average ``(1 - s) * self + s * new``, part by part."""
        return RoundParts(*((1.0 - s) * a + s * b for a, b in zip(self.as_list(), new.as_list())))

    def as_list(self) -> list[float]:
        return [self.transfer_s, self.compute_s, self.other_s]


def _change(measured: float, expected: float, cell_s: float) -> float:
    """The ratio by which a part changed (:data:`CHANGE_RATIO`, :data:`CHANGE_SHARE`); 1.0 for noise."""
    if not (expected > 0.0 and measured > 0.0):
        return 1.0
    ratio = measured / expected
    if not (math.isfinite(ratio) and ratio > 0.0):   # beyond a float's range: not a level to keep
        return 1.0
    if max(ratio, 1.0 / ratio) >= CHANGE_RATIO and abs(measured - expected) >= CHANGE_SHARE * cell_s:
        return ratio
    return 1.0


def _level(level: float, factor: float) -> float:
    """``level * factor``, or ``level`` where that would leave a float's positive range."""
    moved = level * factor
    return moved if math.isfinite(moved) and moved > 0.0 else level


def _undominated(row: Mapping[int, float], allowed: Sequence[int], noise: float) -> list[int]:
    """The ``allowed`` candidates (ascending) that no deeper allowed one matches in time, within
    the table's noise: a candidate that a deeper one matches or beats would put more layers'
    work on the Main Server for no shorter round, so the median rule never chooses it."""
    return [j for j in allowed if not any(k > j and row[k] <= row[j] * (1.0 + noise) for k in allowed)]


def _cheapest(row: Mapping[int, float]) -> int:
    """The candidate with the least time; ties to the larger ``j``."""
    return min(row, key=lambda j: (row[j], -j))


class ClientTimeTable:
    """Per-device, per-split-candidate running average of measured round times (seconds), in
    their parts, with each device's link and compute levels and its censored entries."""

    def __init__(self, num_candidates: int = 3, smoothing: float = 0.5, warm_up: str = "estimated",
                 bottleneck_cap: bool = True, undominated: bool = True) -> None:
        if int(num_candidates) < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        if not (0.0 < float(smoothing) <= 1.0):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        if warm_up not in WARM_UPS:
            raise ValueError(f"warm_up must be one of {', '.join(WARM_UPS)}, got {warm_up!r}")
        self.num_candidates = int(num_candidates)
        self.smoothing = float(smoothing)
        self.warm_up = warm_up
        self.bottleneck_cap = bool(bottleneck_cap)
        self.undominated = bool(undominated)
        # Cells as measured, divided by the device's levels of when they were measured.
        self._cells: dict[str, dict[int, RoundParts]] = {}
        self._levels: dict[str, tuple[float, float]] = {}        # device -> (link, compute)
        self._censored: dict[str, dict[int, float]] = {}         # device -> {j: seconds waited}
        self._latest: dict[str, int] = {}                        # device -> its latest measured j
        self._noise: deque[float] = deque(maxlen=NOISE_WINDOW)

    def _check_j(self, j: int) -> int:
        jj = int(j)
        if jj != j or not 0 <= jj < self.num_candidates:
            raise ValueError(f"candidate index must be in 0..{self.num_candidates - 1}, got {j}")
        return jj

    def levels(self, device: str) -> tuple[float, float]:
        """The device's (link, compute) levels: how many times slower than when its first cells
        were measured the table now reads its transfers and its compute."""
        return self._levels.get(str(device), (1.0, 1.0))

    def record(self, device: str, j: int, seconds: float, transfer_s: float = 0.0, compute_s: float = 0.0) -> None:
        """Fold a measured round time into cell (device, j): ``(1-s)*old + s*measured``, part by
        part (``transfer_s`` and ``compute_s`` of ``seconds``; the rest is the Main Server's). A part
        that changed (:data:`CHANGE_RATIO`) moves the device's level first, so every cell of the
        device follows it; the device's censored entries are done with."""
        jj = self._check_j(j)
        t = float(seconds)
        if not math.isfinite(t) or t < 0.0:
            raise ValueError(f"round time must be finite and >= 0, got {seconds}")
        transfer, compute = float(transfer_s), float(compute_s)
        if not (math.isfinite(transfer) and math.isfinite(compute) and transfer >= 0.0 and compute >= 0.0
                and transfer + compute <= t * (1.0 + 1e-9) + 1e-12):
            raise ValueError(f"transfer {transfer_s} s and compute {compute_s} s must be >= 0 and sum to at most "
                             f"the round time {seconds} s")
        device = str(device)
        measured = RoundParts(transfer, compute, max(0.0, t - transfer - compute))
        expected = self.parts(device, jj)
        link, speed = self.levels(device)
        if expected is not None:
            link_ratio = _change(measured.transfer_s, expected.transfer_s, expected.total)
            compute_ratio = _change(measured.compute_s, expected.compute_s, expected.total)
            if link_ratio == compute_ratio == 1.0 and expected.total > 0.0:
                self._noise.append(abs(t - expected.total) / expected.total)
            link, speed = _level(link, link_ratio), _level(speed, compute_ratio)
            self._levels[device] = (link, speed)
        fresh = measured.scaled(1.0 / link, 1.0 / speed)
        row = self._cells.setdefault(device, {})
        old = row.get(jj)
        row[jj] = fresh if old is None else old.mixed(fresh, self.smoothing)
        self._latest[device] = jj
        self._censored.pop(device, None)

    def censor(self, device: str, j: int, waited_s: float, terms: Terms | None = None) -> float:
        """Device ``device`` left an attempt at candidate ``j`` unfinished after ``waited_s``
        seconds (cut at a deadline): its time there is at least that. Until it is measured again
        it gets a cheaper candidate (:meth:`choose`). Where its cell (measured, or scaled by
        ``terms`` from its latest measured one) reads less, its link level rises until the cell
        reads ``waited_s`` (its compute level, where the cell has no transfer time). Returns the
        factor by which the link level rose (1.0: it did not)."""
        jj = self._check_j(j)
        waited = float(waited_s)
        if not math.isfinite(waited) or waited < 0.0:
            raise ValueError(f"seconds waited must be finite and >= 0, got {waited_s}")
        device = str(device)
        bounds = self._censored.setdefault(device, {})
        bounds[jj] = max(waited, bounds.get(jj, 0.0))
        parts = self.parts(device, jj) or self._scaled(device, jj, terms)
        if parts is None or parts.total >= waited:
            return 1.0
        link, compute = self.levels(device)
        if parts.transfer_s > 0.0:
            raised = _level(link, (waited - parts.compute_s - parts.other_s) / parts.transfer_s)
            self._levels[device] = (raised, compute)
            return raised / link
        if parts.compute_s > 0.0:
            self._levels[device] = (link, _level(compute, (waited - parts.other_s) / parts.compute_s))
        return 1.0

    def censored(self, device: str) -> dict[int, float]:
        """The device's censored entries since it was last measured: candidate -> seconds waited."""
        return dict(self._censored.get(str(device), {}))

    def parts(self, device: str, j: int) -> RoundParts | None:
        """The measured cell's parts at the device's levels of now, or ``None`` if never measured."""
        cell = self._cells.get(str(device), {}).get(self._check_j(j))
        return None if cell is None else cell.scaled(*self.levels(device))

    def get(self, device: str, j: int) -> float | None:
        """The cell's running average, or ``None`` if never measured."""
        parts = self.parts(device, j)
        return None if parts is None else parts.total

    def noise(self) -> float:
        """How much a cell's time moves when it is measured again with nothing changed: the median
        relative difference of the latest re-measurements from their cells (:data:`NOISE_DEFAULT`
        before :data:`NOISE_SAMPLES` of them, at least :data:`NOISE_FLOOR`)."""
        if len(self._noise) < NOISE_SAMPLES:
            return NOISE_DEFAULT
        return max(NOISE_FLOOR, float(np.median(self._noise)))

    def entries(self) -> dict[str, dict[int, float]]:
        """Every measured cell's time, as :meth:`get` reads it, for metrics."""
        return {dev: {j: self.get(dev, j) or 0.0 for j in row} for dev, row in self._cells.items()}

    def state_dict(self) -> dict[str, Any]:
        """Everything the table holds, for the checkpoint (text keys, lists: msgpack and JSON)."""
        return {"cells": {d: {str(j): c.as_list() for j, c in sorted(row.items())} for d, row in self._cells.items()},
                "levels": {d: list(lv) for d, lv in self._levels.items()},
                "censored": {d: {str(j): w for j, w in row.items()} for d, row in self._censored.items()},
                "latest": dict(self._latest), "noise": list(self._noise)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (a resumed run chooses as it would have);
        ValueError, changing nothing, for a candidate or a time the table cannot hold."""
        cells: dict[str, dict[int, RoundParts]] = {}
        for dev, row in state.get("cells", {}).items():
            for j, values in row.items():
                parts = RoundParts(*(float(v) for v in values))
                if not all(math.isfinite(v) and v >= 0.0 for v in parts.as_list()):
                    raise ValueError(f"invalid time {values!r} for ({dev!r}, {j!r})")
                cells.setdefault(str(dev), {})[self._check_j(int(j))] = parts
        levels = {str(d): (float(lv[0]), float(lv[1])) for d, lv in state.get("levels", {}).items()}
        if not all(math.isfinite(v) and v > 0.0 for lv in levels.values() for v in lv):
            raise ValueError(f"invalid levels {levels!r}")
        censored = {str(d): {self._check_j(int(j)): float(w) for j, w in row.items()}
                    for d, row in state.get("censored", {}).items()}
        latest = {str(d): self._check_j(int(j)) for d, j in state.get("latest", {}).items()}
        self._cells, self._levels, self._censored, self._latest = cells, levels, censored, latest
        self._noise = deque((float(v) for v in state.get("noise", [])), maxlen=NOISE_WINDOW)

    def calibration(self, estimate: Callable[[str, int], float]) -> float:
        """Median over measured cells of ``measured / estimate(device, j)``; 1.0 if none.

        Scales Eq. 1 predictions to this testbed's reality (framework overheads, serialisation,
        contention that Eq. 1 ignores). Cells whose estimate is not finite and > 0 are skipped.
        """
        ratios: list[float] = []
        for dev in sorted(self._cells):
            for j in sorted(self._cells[dev]):
                est = float(estimate(dev, j))
                if math.isfinite(est) and est > 0.0:
                    ratios.append((self.get(dev, j) or 0.0) / est)
        return float(np.median(ratios)) if ratios else 1.0

    def _scaled(self, device: str, j: int, terms: Terms | None) -> RoundParts | None:
        """Cell (device, j) scaled from the device's latest measured cell, part by part: its
        transfer by Eq. 1's bytes (its link rate, measured there); its compute and the rest by the
        ratio the other devices measured between the two candidates (the median over those measured
        at both), or by Eq. 1's client and server FLOPs before any was. Eq. 1's FLOPs leave out what
        every step costs whatever its size, which rules a small model's compute: so the measured ratio
        where there is one. A part whose term is zero at the measured candidate is kept as it is.
        None without terms or a measured cell."""
        base_j = self._latest.get(device)
        if terms is None or base_j is None:
            return None
        base = self.parts(device, base_j)
        assert base is not None
        at_base, at_j = terms(device, base_j), terms(device, j)
        scaled = []
        for i, (part, old, new) in enumerate(zip(base.as_list(), at_base, at_j)):
            ratio = self._measured_ratio(i, base_j, j) if i else None
            if ratio is None:
                ratio = new / old if old > 0.0 and math.isfinite(new / old) else 1.0
            scaled.append(part * ratio)
        return RoundParts(*scaled)

    def _measured_ratio(self, part: int, j: int, k: int) -> float | None:
        """The median over the devices measured at candidates ``j`` and ``k`` of their part
        ``part`` (0 transfer, 1 compute, 2 the rest) at ``k`` over at ``j``; None where none was."""
        ratios = [row[k].as_list()[part] / row[j].as_list()[part] for row in self._cells.values()
                  if j in row and k in row and row[j].as_list()[part] > 0.0]
        return float(np.median(ratios)) if ratios else None

    def _column_median(self, j: int, exclude: str) -> float | None:
        vals = [self.get(dev, j) or 0.0 for dev, row in self._cells.items() if dev != exclude and j in row]
        return float(np.median(vals)) if vals else None

    def row(self, device: str, estimate: Callable[[str, int], float] | None = None, calibration: float = 1.0,
            terms: Terms | None = None) -> dict[int, float]:
        """The device's time at every candidate that can be priced (module docstring, in order:
        measured, scaled from its measured cell, calibrated estimate, the others' median); a
        censored candidate reads at least the seconds it was waited for."""
        row: dict[int, float] = {}
        for j in range(self.num_candidates):
            parts = self.parts(device, j) or self._scaled(device, j, terms)
            t = parts.total if parts is not None else None
            if t is None and estimate is not None:
                est = float(estimate(device, j))
                t = est * calibration if math.isfinite(est) and est >= 0.0 else None
            if t is None:
                t = self._column_median(j, exclude=device)
            if t is not None:
                row[j] = t
        for j, waited in self._censored.get(device, {}).items():
            row[j] = max(row.get(j, waited), waited)
        return row

    def _pick(self, device: str, row: Mapping[int, float], m: float, noise: float, paths: Mapping[int, float],
              cap: float) -> int:
        """One device's candidate: after a cut, its cheapest that fits; else among those whose
        critical path (``paths``) reads at most ``cap * (1 + noise)`` (the bottleneck cap; ``cap``
        infinite: all; none: the shortest path), where the median says nothing (its times within
        noise of each other, or all far below ``m``), its deepest; else the paper's closest to
        ``m`` among those no deeper one matches in time (where ``undominated``), ties to the
        larger ``j``."""
        censored = self._censored.get(device)
        if censored:
            limit = max(censored.values())
            fits = {j: t for j, t in row.items() if j not in censored and t < limit}
            return _cheapest(fits or row)
        allowed = [j for j in sorted(row) if paths[j] <= cap * (1.0 + noise)] or [_cheapest(paths)]
        times = list(row.values())
        if max(times) - min(times) <= 2.0 * noise * min(times) or max(times) * FAR_BELOW <= m:
            return allowed[-1]
        best_j, best_gap = -1, math.inf
        candidates = _undominated(row, allowed, noise) if self.undominated else allowed
        for j in candidates:  # ascending, so a (near-)tie replaces with the larger j
            gap = abs(row[j] - m)
            if gap <= best_gap + 1e-9 * max(1.0, abs(m)):
                best_j, best_gap = j, min(gap, best_gap)
        return best_j

    def choose(
        self,
        round_index: int,
        devices: Sequence[str],
        estimate: Callable[[str, int], float] | None = None,
        terms: Terms | None = None,
        portion_s: PortionSeconds | None = None,
    ) -> dict[str, int]:
        """Split candidate per device for a 1-based round (the paper's median rule, extended as
        the module docstring says).

        Warm-up: rounds 1..K (``every_split``) or round 1 (``estimated``): every device gets
        ``j = round_index - 1``. Later rounds: each device's row (:meth:`row`: measured, scaled
        by ``terms`` from its measured cell, ``estimate(device, j) * calibration``, the others'
        median for ``j``); ``m`` = median of the known times of all ``len(devices) * K`` cells;
        the bottleneck ``b`` = the largest of the devices' cheapest times (where ``bottleneck_cap``),
        each candidate's critical path beside it from ``portion_s`` (:class:`Bottleneck`); each
        device's candidate by :meth:`_pick`. Deterministic.
        """
        if int(round_index) < 1:
            raise ValueError(f"round_index is 1-based, got {round_index}")
        k = self.num_candidates
        devs = [str(d) for d in devices]
        if round_index <= warm_up_rounds(self.warm_up, k):
            return {d: int(round_index) - 1 for d in devs}

        cycle_j = (int(round_index) - 1) % k
        cal = self.calibration(estimate) if estimate is not None else 1.0
        rows = {d: self.row(d, estimate, cal, terms) for d in devs}
        known = [t for row in rows.values() for t in row.values()]
        if not known:
            return {d: cycle_j for d in devs}
        m = float(np.median(known))
        noise = self.noise()
        bottleneck = self._bottleneck(rows, portion_s)

        def paths(device: str) -> Mapping[int, float]:
            if portion_s is None or bottleneck.time_s == math.inf:   # nothing to add to the cells
                return rows[device]
            return {j: bottleneck.path(t, portion_s(device, j)) for j, t in rows[device].items()}
        return {d: self._pick(d, rows[d], m, noise, paths(d), bottleneck.time_s) if rows[d] else cycle_j
                for d in devs}

    def _bottleneck(self, rows: Mapping[str, Mapping[int, float]], portion_s: PortionSeconds | None) -> Bottleneck:
        """The largest of the rows' cheapest times and its device's portion seconds there; an
        infinite one without ``bottleneck_cap`` (nothing capped)."""
        if not self.bottleneck_cap:
            return Bottleneck(math.inf)
        slowest = max((d for d in rows if rows[d]), key=lambda d: (min(rows[d].values()), d))
        j = _cheapest(rows[slowest])
        edge = portion_s(slowest, j) if portion_s is not None else None
        return Bottleneck(rows[slowest][j], edge or 0.0)
