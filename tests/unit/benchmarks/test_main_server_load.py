"""Benchmark (c)'s figures: latency percentiles with the first steps apart, and the compute limits."""
from __future__ import annotations

import math
import mmap
import os
import time

import pytest

from benchmarks.main_server_load import GROUP_SIZE, CpuMeter, _against_limits, _latency_figures, split_cores


def test_latency_figures_keep_every_step_and_show_the_first_steps_apart() -> None:
    # step 0: slow start-up; steps 1 and 2: steady
    latencies = {0: [1.0, 3.0], 1: [0.1, 0.2], 2: [0.3, 0.4]}
    out = _latency_figures(latencies)
    assert out["latency_max_ms"] == pytest.approx(3000.0)                    # the first steps are not dropped
    assert out["latency_p50_ms"] == pytest.approx(350.0)                     # median of all six
    assert out["later_steps_latency_p50_ms"] == pytest.approx(250.0)         # median of steps 1 and 2
    assert out["later_steps_latency_p99_ms"] < 400.0 + 1e-9
    assert out["first_step_latency_p50_ms"] == pytest.approx(2000.0)
    assert out["first_step_latency_max_ms"] == pytest.approx(3000.0)
    assert out["latency_p99_over_p50"] == pytest.approx(out["latency_p99_ms"] / out["latency_p50_ms"])


def test_the_limit_scales_with_the_cores() -> None:
    row = {"replicas": 1, "device_steps_per_s": 100.0, "server_cpu_s": 5.0, "client_cpu_s": 2.0, "wall_s": 10.0}
    out = _against_limits(row, group_step_s=0.025, cores=2, client_cores=2)
    per_core = GROUP_SIZE / 0.025
    assert out["compute_limit_steps_per_s"] == pytest.approx(2 * per_core)
    assert out["fraction_of_compute_limit"] == pytest.approx(100.0 / (2 * per_core))
    assert out["server_cpu_share_of_cores"] == pytest.approx(0.25)
    assert out["client_cpu_share_of_cores"] == pytest.approx(0.1)
    assert _against_limits(row, group_step_s=0.025, cores=4, client_cores=4)["compute_limit_steps_per_s"] \
        == pytest.approx(4 * per_core)
    # cores of their own: the server's limit counts its one core, the client's share its one core
    apart = _against_limits(row, group_step_s=0.025, cores=1, client_cores=1)
    assert apart["compute_limit_steps_per_s"] == pytest.approx(per_core)
    assert apart["server_cpu_share_of_cores"] == pytest.approx(0.5)
    assert apart["client_cpu_share_of_cores"] == pytest.approx(0.2)


def test_split_cores_shares_by_default_and_otherwise_leaves_each_side_a_core() -> None:
    usable = sorted(os.sched_getaffinity(0))
    assert split_cores(None) == (set(usable), set(usable))
    if len(usable) >= 2:
        server, client = split_cores(1)
        assert server == {usable[0]} and client == set(usable[1:])
    for bad in (0, len(usable)):
        with pytest.raises(ValueError, match="--server-cores"):
            split_cores(bad)


def test_cpu_meter_counts_this_process_and_the_servers() -> None:
    meter = CpuMeter([os.getpid()])
    end = time.process_time() + 0.2
    while time.process_time() < end:   # burn some CPU in this process
        math.sqrt(12345.0)
    client, server, loop = meter.read()
    assert client >= 0.2
    assert server > 0.0   # the "server" here is this process too
    # Its main thread burned the CPU, so the "event loop" part is most of it. The kernel reads the
    # process's and the thread's times in clock ticks, each read scaled on its own: a few ticks apart.
    assert 0.5 * server <= loop <= server + 0.05


def test_cpu_meter_counts_the_page_faults_of_fresh_memory() -> None:
    meter = CpuMeter([os.getpid()])
    pages = 64 << 20 >> 12
    fresh = mmap.mmap(-1, pages << 12)   # anonymous: each page is mapped in on its first touch
    if hasattr(mmap, "MADV_NOHUGEPAGE"):   # 4 KiB pages even where transparent huge pages are always on
        fresh.madvise(mmap.MADV_NOHUGEPAGE)
    for offset in range(0, pages << 12, 4096):
        fresh[offset] = 1
    fresh.close()
    faults, loop_faults = meter.faults()
    # this thread touched them all (the main thread: the "event loop" in a Main Server)
    assert loop_faults >= pages and faults >= loop_faults
