"""A device's round clock: measured compute and transfer time, stretched to an emulated kind."""
from __future__ import annotations

import time
from contextlib import contextmanager
from collections.abc import Iterator

from shared.profiles import EmulatedKind


class RoundClock:
    """Accumulates one round's timings; sleeps to emulate a slower device when ``kind`` is set.

    Compute sections are stretched by ``kind.compute_stretch`` (sleeping the difference), and each
    message adds ``bytes / (rate * time_scale)`` seconds of emulated transfer. With ``kind=None``
    (a real device) nothing is added: the figures are what was measured.

    ``cpu_time``: stretch the section's CPU time on the calling thread (``time.thread_time``)
    instead of its wall time. An agent hosts many virtual devices on a few cores, so a section's
    wall time includes waiting for the CPU behind the other devices (and other processes); a
    wall-time stretch multiplies that waiting too (a Low device slept 9x its queueing), which made
    emulated rounds slower the busier the machine was. The CPU time is the work itself: the
    emulated device is ``stretch`` times slower than this CPU doing its work alone, and the
    contention it really met is kept once, unstretched. Valid only where the section's work runs
    on the calling thread: a CPU device with one torch thread (the testbed's setting); on a GPU, or
    with more torch threads, the device uses wall time (``cpu_time=False``).
    """

    def __init__(self, kind: EmulatedKind | None, time_scale: float = 1.0, cpu_time: bool = False) -> None:
        self.kind = kind
        self.time_scale = time_scale
        self.cpu_time = cpu_time
        self.started = time.monotonic()
        self.compute_s = 0.0
        self.transfer_s = 0.0
        self.wait_s = 0.0
        self.server_s = 0.0

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time a compute section (forward, backward, optimizer step)."""
        t0 = time.monotonic()
        cpu0 = time.thread_time() if self.cpu_time else 0.0
        yield
        measured = time.monotonic() - t0
        if self.kind is not None and self.kind.compute_stretch > 1.0:
            work = time.thread_time() - cpu0 if self.cpu_time else measured
            extra = work * (self.kind.compute_stretch - 1.0)
            time.sleep(extra)
            measured += extra
        self.compute_s += measured

    def transfer(self, num_bytes: int, measured_s: float = 0.0) -> None:
        """Account a message: the measured network time plus the emulated delay for its size."""
        delay = self.kind.transfer_delay(num_bytes, self.time_scale) if self.kind is not None else 0.0
        if delay > 0:
            time.sleep(delay)
        self.transfer_s += max(0.0, measured_s) + delay

    def server_time(self, wait_s: float, server_s: float) -> None:
        """Time the Main Server reports: barrier wait and server-side training."""
        self.wait_s += max(0.0, wait_s)
        self.server_s += max(0.0, server_s)

    def total(self) -> float:
        return time.monotonic() - self.started
