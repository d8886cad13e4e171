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
"""
from __future__ import annotations

from dataclasses import dataclass

FLOPS = {"low": 5e9, "mid": 1e10, "high": 2e10}   # FLOP/s, paper Table 1
RATES = {"low": 1e6, "mid": 2e6, "high": 5e6}     # bytes/s, paper Table 1
SERVER_FLOPS = 5e10


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
