"""The machine a process runs on: its usable cores, the threads that should compute at once, its
allocator's arenas, and for benchmarks what machine they ran on and a process's peak memory (from
/proc, no psutil)."""
from __future__ import annotations

import ctypes
import datetime as _dt
import os
import platform
import threading
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 ** 2, 1)
    except OSError:
        pass
    return None


def usable_cores() -> int:
    """CPUs this process may run on (its affinity mask on Linux, else every CPU)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def compute_workers() -> int:
    """Threads that compute at once in one process: one per core it may use, given the torch
    threads each computation takes. With one torch thread, as many as there are cores, and no
    more: more at once only share the cores, each taking longer and holding its memory meanwhile.
    The Main Server's training workers and a device agent's compute threads both default to it."""
    import torch

    return max(1, usable_cores() // max(1, torch.get_num_threads()))


_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_allocator_arenas(count: int) -> bool:
    """Cap glibc's malloc arenas at ``count`` for this process; whether the cap was set.

    glibc gives each thread that allocates while the others hold theirs an arena of its own, up
    to 8 per core, and an arena keeps what its thread freed. A service's threads mostly wait (an
    agent's device threads, a server's request and record threads) while a few compute, so each
    waiting thread's arena held memory it had used once, and an agent's peak grew with its device
    threads (measured: benchmarks/why-the-code-is-as-it-is.md, "Whole-model rounds on one compute
    thread per core"). Threads beyond
    the cap share arenas, so what one freed serves the next. Nothing changes where glibc's malloc is not the
    allocator (macOS, musl) or where ``MALLOC_ARENA_MAX`` is set in the environment (it wins).
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_ARENA_MAX, max(1, count)))


def release_free_memory() -> bool:
    """Give the kernel back the pages glibc's malloc holds free (``malloc_trim(0)``); whether it
    could (False where glibc's malloc is not the allocator).

    A model's tensors come from malloc's heap once glibc has raised its mmap threshold (up to 32
    MiB), and a freed heap chunk below others stays resident: a Main Server round's freed copies
    otherwise stayed in its resident set, round after round. Walks every arena: call it when a
    large working set has just been freed, not per request.
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def describe_machine() -> dict:
    """CPU model, cores, memory, OS, Python/torch versions, date and the load at the start."""
    import msgpack
    import torch

    usable = usable_cores()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        load = None
    return {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _mem_total_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "torch_threads_per_process": 1,
        "load_average_at_start": load,
    }


def proc_status_kib(pid: int, field: str) -> int | None:
    """A ``kB`` field of /proc/<pid>/status (VmHWM = peak resident set, VmRSS = current), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class PeakMemorySampler:
    """Samples VmHWM of some processes in a background thread and keeps the largest value seen.

    VmHWM is the kernel's own peak-RSS counter, so sampling only has to catch it before the
    process exits (device agents exit on their own when the run is done); ``read_now`` takes a
    final reading of the processes still alive.
    """

    def __init__(self, pids: dict[str, int], interval_s: float = 0.25) -> None:
        self.pids = dict(pids)
        self.interval_s = interval_s
        self.peak_kib: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="peak-memory", daemon=True)

    def start(self) -> "PeakMemorySampler":
        self._thread.start()
        return self

    def read_now(self) -> None:
        for name, pid in self.pids.items():
            value = proc_status_kib(pid, "VmHWM")
            if value is not None and value > self.peak_kib.get(name, 0):
                self.peak_kib[name] = value

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.read_now()
            self._stop.wait(self.interval_s)

    def stop(self) -> dict[str, float]:
        """Final reading; peak MiB per process name."""
        self.read_now()
        self._stop.set()
        self._thread.join(2.0)
        return {name: round(kib / 1024, 1) for name, kib in self.peak_kib.items()}
