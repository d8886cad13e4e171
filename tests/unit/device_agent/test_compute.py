"""device_agent.compute: the agent's compute threads (the state machine of their queue)."""
from __future__ import annotations

import threading

import pytest

from device_agent.compute import ComputeThreads, InlineCompute, compute_for


def test_waiting_sections_go_largest_work_first_then_in_arrival_order():
    """One compute thread, held by a first section while six more arrive: they run largest
    ``work`` first, and sections of equal work (every step's is 0) in the order they came."""
    compute = ComputeThreads(1)
    release = threading.Event()
    started = threading.Event()
    ran: list[str] = []

    def first():
        started.set()
        release.wait(10)

    holder = threading.Thread(target=compute.run, args=(first,))
    holder.start()
    assert started.wait(10)
    arrivals = [("step-a", 0), ("small", 100), ("large", 900), ("step-b", 0), ("mid", 400), ("mid-later", 400)]
    waiters = []
    for name, work in arrivals:
        t = threading.Thread(target=compute.run, args=(lambda name=name: ran.append(name), work))
        t.start()
        waiters.append(t)
        # Each is queued before the next arrives: the queue's order, not the threads', is checked.
        while compute._waiting.qsize() < len(waiters):
            pass
    release.set()
    for t in [holder, *waiters]:
        t.join(10)
    assert ran == ["large", "mid", "mid-later", "small", "step-a", "step-b"]
    compute.close()


def test_a_section_runs_on_a_compute_thread_returns_its_result_and_cpu_time_and_raises_its_error():
    compute = ComputeThreads(2)
    name, cpu = compute.run(lambda: (threading.current_thread().name, sum(i * i for i in range(200_000)))[0])
    assert name.startswith("compute-") and cpu > 0
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: 42)[0] == 42   # the thread survived the error
    compute.close()
    with pytest.raises(RuntimeError, match="closed"):
        compute.run(lambda: 0)


def test_close_returns_once_every_compute_thread_has_ended():
    """``close`` waits for a section still running, then for the threads themselves: none may be
    ending while the agent's process exits (that aborted the agent, see ``ComputeThreads.close``)."""
    compute = ComputeThreads(2)
    running, release = threading.Event(), threading.Event()
    device = threading.Thread(target=compute.run, args=(lambda: (running.set(), release.wait(10)),))
    device.start()
    assert running.wait(10)
    closer = threading.Thread(target=compute.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close returned while a section was still running"
    release.set()
    closer.join(10)
    device.join(10)
    assert not closer.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("compute-")]


def test_close_runs_the_section_running_but_not_those_waiting():
    """A stopping agent waits for the section it is running, not for the rounds queued behind
    it: their devices' threads get the error at once."""
    compute = ComputeThreads(1)
    running, release = threading.Event(), threading.Event()
    ran: list[str] = []
    errors: list[BaseException] = []

    def device(section, work: float = 0.0) -> None:
        try:
            compute.run(section, work)
        except RuntimeError as exc:
            errors.append(exc)

    first = threading.Thread(target=device, args=(lambda: (running.set(), release.wait(10), ran.append("first")),))
    first.start()
    assert running.wait(10)
    waiting = [threading.Thread(target=device, args=(lambda: ran.append("waiting"),)) for _ in range(3)]
    for t in waiting:
        t.start()
    while compute._waiting.qsize() < len(waiting):
        pass
    closer = threading.Thread(target=compute.close)
    closer.start()
    for t in waiting:
        t.join(10)
    assert [str(e) for e in errors] == ["the agent's compute threads are closed"] * 3
    release.set()
    closer.join(10)
    first.join(10)
    assert ran == ["first"] and not closer.is_alive()


def test_compute_for_zero_is_the_devices_own_thread_and_refuses_a_negative_count():
    inline = compute_for(0)
    assert isinstance(inline, InlineCompute)
    assert inline.run(lambda: threading.current_thread().name)[0] == threading.current_thread().name
    assert isinstance(compute_for(3), ComputeThreads) and compute_for(3).count == 3
    with pytest.raises(ValueError, match="compute_slots"):
        compute_for(-1)
