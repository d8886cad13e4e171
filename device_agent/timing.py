"""A device's round clock: measured compute and transfer time, stretched to an emulated kind."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from device_agent.compute import Compute
from device_agent.task_expired import TaskExpired
from shared.http_client import Cancellation
from shared.profiles import EmulatedKind

T = TypeVar("T")


class RoundClock:
    """Accumulates one round's timings; sleeps to emulate a slower device when ``kind`` is set.

    Compute sections are stretched by ``kind.compute_stretch`` (sleeping the difference), and each
    message adds ``bytes / (rate * time_scale)`` seconds of emulated transfer, unless
    ``emulate_links`` is False (the device's link is real, shaped to its kind's rate: only its
    compute is emulated). With ``kind=None`` (a real device) nothing is added: the figures are
    what was measured.

    ``cpu_time``: stretch the section's CPU time on the thread that ran it (``time.thread_time``)
    instead of its wall time. An agent hosts many virtual devices on a few cores, so a section's
    wall time includes waiting for the CPU behind the other devices (and other processes); a
    wall-time stretch multiplies that waiting too (a Low device slept 9x its queueing), which made
    emulated rounds slower the busier the machine was. The CPU time is the work itself: the
    emulated device is ``stretch`` times slower than this CPU doing its work alone, and the
    contention it really met is kept once, unstretched. Valid only where the section's work runs
    on the thread that runs the section: a CPU device with one torch thread (the testbed's setting); on a GPU, or
    with more torch threads, the device uses wall time (``cpu_time=False``).
    """

    def __init__(self, kind: EmulatedKind | None, time_scale: float = 1.0, cpu_time: bool = False,
                 emulate_links: bool = True, taken_out: Cancellation | None = None) -> None:
        self.kind = kind
        #: Set when the Fed Server closed the task's attempt without the device's upload: an
        #: emulated transfer or compute stretch stops there, as a real device's download does
        #: (:meth:`transfer`, :meth:`computed`), and the device checks it between steps.
        self.taken_out = taken_out
        self.emulate_links = emulate_links
        self.time_scale = time_scale
        self.cpu_time = cpu_time
        self.started = time.monotonic()
        self.compute_s = 0.0
        self.transfer_s = 0.0
        self.wait_s = 0.0
        self.server_s = 0.0

    @contextmanager
    def compute(self) -> Iterator[None]:
        """Time a compute section run on the calling thread (a split step's forward or backward,
        a follow-up)."""
        t0 = time.monotonic()
        cpu0 = time.thread_time()
        yield
        self.computed(time.monotonic() - t0, time.thread_time() - cpu0)

    def section(self, compute: Compute, section: Callable[[], T], work: float = 0.0) -> T:
        """Run a compute section (a whole-model round's local training) on ``compute`` and time it
        (``work``: its expected size, see :class:`device_agent.compute.ComputeThreads`).

        Its wall time counts from here, so it includes waiting for one of the agent's compute
        threads: like waiting for a core, that is contention the device really met."""
        t0 = time.monotonic()
        result, cpu_s = compute.run(section, work)
        self.computed(time.monotonic() - t0, cpu_s)
        return result

    def computed(self, wall_s: float, cpu_s: float) -> None:
        """Account a finished compute section: ``wall_s`` as measured, ``cpu_s`` the CPU time of
        the thread that ran it. An emulated kind sleeps the stretch here, on the device's own
        thread, after the section has left any compute thread."""
        extra = self.stretch_of(wall_s, cpu_s)
        if extra > 0:
            self._pause(extra, "an emulated compute stretch")
        self.compute_s += wall_s + extra

    def stretch_factor(self) -> float:
        """How many times its measured compute an emulated section takes in all (1 for a real device)."""
        return max(1.0, self.kind.compute_stretch) if self.kind is not None else 1.0

    def stretch_of(self, wall_s: float, cpu_s: float) -> float:
        """The seconds an emulated kind adds to a section that took ``wall_s`` (``cpu_s`` of CPU)."""
        return (cpu_s if self.cpu_time else wall_s) * (self.stretch_factor() - 1.0)

    def transfer(self, num_bytes: int, measured_s: float = 0.0) -> None:
        """Account a message: the measured network time plus the emulated delay for its size.
        :class:`TaskExpired` where ``taken_out`` is set before the delay ends: the emulated link
        is given up, as a real one is (:meth:`shared.http_client.SyncClient.call`'s ``cancel``)."""
        delay = (self.kind.transfer_delay(num_bytes, self.time_scale)
                 if self.kind is not None and self.emulate_links else 0.0)
        if delay > 0:
            self._pause(delay, f"an emulated transfer of {num_bytes:,} bytes")
        self.transfer_s += max(0.0, measured_s) + delay

    def check_taken_out(self) -> None:
        """:class:`TaskExpired` once the Fed Server has closed the task's attempt without the device."""
        if self.taken_out is not None and self.taken_out.is_set():
            raise TaskExpired("the Fed Server closed the task's attempt")

    def _pause(self, seconds: float, what: str) -> None:
        """Sleep ``seconds`` of emulation; :class:`TaskExpired` as soon as the attempt is closed."""
        if self.taken_out is None:
            time.sleep(seconds)
        elif self.taken_out.wait(seconds):
            raise TaskExpired(f"the Fed Server closed the task's attempt during {what}")

    def server_time(self, wait_s: float, server_s: float) -> None:
        """Time the Main Server reports: barrier wait and server-side training."""
        self.wait_s += max(0.0, wait_s)
        self.server_s += max(0.0, server_s)

    def total(self) -> float:
        return time.monotonic() - self.started
