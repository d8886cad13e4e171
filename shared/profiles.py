"""Device kinds of the S2FL paper's Table 1, and how an agent emulates them on one machine.

A kind is ``"<flops>-<rate>"`` with each of ``low``, ``mid``, ``high`` (``"mid"`` alone means
``"mid-mid"``): nine kinds. Emulation stretches what is *measured*: compute sections sleep
``(stretch - 1)`` times their measured duration (CPU time on a CPU device, see
``device_agent.timing.RoundClock``), where ``stretch = server FLOPS / kind FLOPS``:
this machine plays the Main Server at the paper's 5e10 FLOP/s, so a High device runs 2.5x, a
Mid one 5x and a Low one 10x slower than the real CPU, the paper's device-to-server ratios
(with devices as fast as the server, server-side layers would look no cheaper than client
ones and the sliding split would have nothing to trade). Every
message adds ``bytes / (rate * time_scale)`` seconds, because loopback transfer is nearly free.
``time_scale`` compresses the paper's transfer rates so a testbed round takes seconds.

Compute is compressed too, by how much faster this machine is than the paper's server: a section
of ``F`` FLOPs takes ``F / host_flops`` seconds here and is stretched to
``(F / kind_flops) * (5e10 / host_flops)``, the paper's time divided by ``host_flops / 5e10``.
So with a fixed ``time_scale`` the weight of transfer against compute moves with the host's speed.
``time_scale: auto`` keeps the proportion the same on every host: ``AUTO_TRANSFER_RATIO *
host_flops / 5e10``, with ``host_flops`` this host's measured training speed on the run's model
(``device_agent.calibration``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FLOPS = {"low": 5e9, "mid": 1e10, "high": 2e10}   # FLOP/s, paper Table 1
RATES = {"low": 1e6, "mid": 2e6, "high": 5e6}     # bytes/s, paper Table 1
SERVER_FLOPS = 5e10

#: An agent's ``--links``: ``emulated``, an emulated kind sleeps its transfers at its rate (the
#: agent's link is loopback); ``real``, the agent's link is really as slow as its kinds (a shaped
#: link, ``python -m testbed --real-links``), so only their compute is emulated and every transfer
#: is the measured one.
LINKS = ("emulated", "real")

#: ``time_scale``: a factor > 0, or ``"auto"`` (:func:`auto_time_scale` of the measured host speed).
TimeScale = float | Literal["auto"]

#: With ``time_scale: auto``, emulated transfers are compressed this many times more than emulated
#: compute. A testbed choice, not the paper's (which would be 1: transfers as long as compute
#: relative to Table 1, and a 10-device round of minutes). 24 is about the ratio the former fixed
#: default of 20 gave on the 2-core machine it was chosen on (how: docs/configuration.md,
#: ``devices.time_scale``; the runs: benchmarks/results/2026-11-26_time-scale-group-size-and-aggregation/).
AUTO_TRANSFER_RATIO = 24.0


@dataclass(frozen=True)
class EmulatedKind:
    """One device kind: nominal speed and the stretch factors an agent applies."""

    name: str
    flops: float
    rate: float

    @property
    def compute_stretch(self) -> float:
        return SERVER_FLOPS / self.flops

    def transfer_delay(self, num_bytes: int, time_scale: float) -> float:
        """Seconds one message of ``num_bytes`` takes at this kind's (compressed) rate."""
        return num_bytes / (self.rate * time_scale)


def auto_time_scale(host_flops: float) -> float:
    """The ``time_scale`` that compresses transfer :data:`AUTO_TRANSFER_RATIO` times more than
    compute on a host that trains at ``host_flops`` FLOP/s (it plays the 5e10 FLOP/s server)."""
    if not host_flops > 0:
        raise ValueError(f"host FLOP/s must be > 0, got {host_flops}")
    return AUTO_TRANSFER_RATIO * host_flops / SERVER_FLOPS


def parse_time_scale(text: str) -> TimeScale:
    """``"auto"`` or a number > 0 (a flag's or an environment variable's text); ValueError otherwise."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"time scale must be auto or a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"time scale must be auto or a number > 0, got {text!r}")
    return value


def parse_kind(name: str) -> EmulatedKind:
    """``"high"``, ``"mid-low"``, ... -> :class:`EmulatedKind`; ValueError for anything else."""
    parts = name.strip().lower().split("-")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or parts[0] not in FLOPS or parts[1] not in RATES:
        raise ValueError(f"unknown device kind {name!r}: use low/mid/high or <flops>-<rate>, e.g. high-low")
    return EmulatedKind(f"{parts[0]}-{parts[1]}", FLOPS[parts[0]], RATES[parts[1]])


def kind_for(index: int, kinds: list[str]) -> EmulatedKind:
    """The kind of device ``index`` in a mix: kinds are assigned round-robin."""
    return parse_kind(kinds[index % len(kinds)])
