"""shared.machine: the allocator's arenas, counted by glibc itself in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.machine import limit_allocator_arenas, usable_cores

ROOT = Path(__file__).resolve().parents[3]

# Eight threads that each allocate while all of them are alive, then glibc's malloc_stats(), which
# prints one "Arena N:" block per arena to stderr.
_THREADS = """
import ctypes, sys, threading
from shared.machine import limit_allocator_arenas, usable_cores
if sys.argv[1] == "service":
    from shared.service import configure_process
    configure_process()   # what every service does first
elif int(sys.argv[1]):
    assert limit_allocator_arenas(int(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
together = threading.Barrier(8)
def work():
    blocks = [libc.malloc(64 * 1024) for _ in range(8)]
    together.wait()
    for b in blocks:
        libc.free(b)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.malloc_stats()
"""


def _arenas(cap: int | str, **env_vars: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env.update(PYTHONPATH=str(ROOT), **env_vars)
    out = subprocess.run([sys.executable, "-c", _THREADS, str(cap)], capture_output=True, text=True, check=True,
                         env=env, cwd=ROOT)
    return sum(1 for line in out.stderr.splitlines() if line.startswith("Arena "))


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="malloc arenas are glibc's")
def test_the_arena_cap_holds_while_eight_threads_allocate_at_once_and_every_service_sets_it():
    uncapped = _arenas(0)
    assert uncapped >= 5, uncapped   # glibc's own limit is 8 per core: each thread got an arena
    assert _arenas(2) <= 2
    # Every service caps them at the threads that compute at once: with as many torch threads as
    # cores, one.
    assert _arenas("service", SFL_TORCH_THREADS=str(usable_cores())) == 1


def test_an_arena_cap_in_the_environment_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    assert limit_allocator_arenas(2) is False
