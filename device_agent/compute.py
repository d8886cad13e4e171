"""Where a device's training compute runs: on its own thread, or on the agent's few compute threads.

An agent hosting many virtual devices runs one thread per device (each waits on the network most of
the time). Where the compute runs decides the agent's memory, not only its CPU share: glibc gives
each thread that allocates its own arena, and an arena keeps what its thread's training freed
for the next round. Ten devices training on their own ten threads held ten arenas of about 55
MiB each at the agent's peak (benchmarks/README.md, "Why the code is as it is"); on two compute threads only two
arenas ever hold training memory. The devices' results are the same either way: a section runs
the same code on the same tensors, only on another thread.
"""
from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

T = TypeVar("T")


class Compute(Protocol):
    """Runs a device's compute section and says how much CPU time it took on the thread it ran on."""

    def run(self, section: Callable[[], T], work: float = 0.0) -> tuple[T, float]:
        """``section()``'s result and the CPU seconds of the thread that ran it (``time.thread_time``).
        ``work``: the section's expected size (any unit), which may order waiting sections."""
        ...

    def close(self) -> None:
        """Release the threads, if any, once no device computes any more, and wait for them to end."""
        ...


def _timed(section: Callable[[], T]) -> tuple[T, float]:
    cpu0 = time.thread_time()
    result = section()
    return result, time.thread_time() - cpu0


class InlineCompute:
    """Each section on the calling device's own thread, as many at once as devices compute
    (``--compute-slots 0``)."""

    def run(self, section: Callable[[], T], work: float = 0.0) -> tuple[T, float]:
        return _timed(section)

    def close(self) -> None:
        pass


class ComputeThreads:
    """The agent's ``count`` compute threads, shared by its devices (``--compute-slots N``).

    A section waits for a free thread and the device's thread waits for it; its exception
    (``TaskExpired`` included) is raised in the device's thread. A whole-model round (no Main
    Server) is one section; split training computes on the device's own thread
    (:func:`device_agent.trainer.train_round` says why), so no device ever holds a compute
    thread while it waits for the Main Server.

    Waiting sections go largest ``work`` first, then first come first served. A round ends when
    its last device has uploaded, and whole-model rounds of unequal sizes arrive together: the
    largest first leaves the small ones to fill the last gaps, so no core idles while the
    largest runs alone at the end (longest-processing-time-first scheduling; the trainer's work
    is samples x epochs x an emulated kind's stretch). Equal work keeps
    the order of arrival.
    """

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"compute threads must be >= 1, got {count}")
        self.count = count
        self._waiting: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()   # ties (and every step) first come first served
        self._threads: list[threading.Thread] = []
        self._start = threading.Lock()
        self._closed = False

    def run(self, section: Callable[[], T], work: float = 0.0) -> tuple[T, float]:
        self._started()
        done: Future = Future()
        self._waiting.put((-work, next(self._order), section, done))
        return done.result()

    def _started(self) -> None:
        with self._start:   # the threads start with the first section, not with the agent
            if self._closed:
                raise RuntimeError("the agent's compute threads are closed")
            while len(self._threads) < self.count:
                thread = threading.Thread(target=self._serve, name=f"compute-{len(self._threads)}", daemon=True)
                thread.start()
                self._threads.append(thread)

    def _serve(self) -> None:
        while True:
            _, _, section, done = self._waiting.get()
            if section is None:
                return
            try:
                done.set_result(_timed(section))
            except BaseException as exc:  # raised again in the device's thread by done.result()
                done.set_exception(exc)

    def close(self) -> None:
        """End the threads once the sections running now are done, and wait for them to end.
        Sections still waiting are not run: their devices' threads get a RuntimeError (the agent
        is stopping, and a device's round that waits behind others would hold its exit).

        The wait matters at the agent's exit: a compute thread that has run torch code and is
        still ending while the process exits (its thread-local state torn down beside the exit's
        static destructors) aborted the agent with "terminate called without an active
        exception" in about one run in four of examples/tabular (in CI).
        """
        with self._start:
            self._closed = True
            while True:
                try:
                    _, _, _, dropped = self._waiting.get_nowait()
                except queue.Empty:
                    break
                dropped.set_exception(RuntimeError("the agent's compute threads are closed"))
            for _ in self._threads:
                self._waiting.put((math.inf, next(self._order), None, None))
        for thread in self._threads:
            thread.join()


def compute_for(slots: int) -> Compute:
    """``--compute-slots``: 0 runs each device's compute on its own thread, N on N shared threads."""
    if slots < 0:
        raise ValueError(f"compute_slots must be >= 0 (0: each device on its own thread), got {slots}")
    return ComputeThreads(slots) if slots else InlineCompute()
