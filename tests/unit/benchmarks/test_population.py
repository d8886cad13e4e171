"""Part (h)'s pure parts: reading PSS from /proc, memory per device, devices per round, the table."""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import population
from benchmarks.fedavg_overhead import PssSampler, smaps_rollup_kib
from benchmarks.run import DEFAULT_PARTS, PARTS
from benchmarks.run import report as run_report


def _status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise AssertionError(key)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc smaps_rollup")
def test_pss_of_a_live_process_and_of_a_gone_one() -> None:
    figures = smaps_rollup_kib(os.getpid())
    rss = _status_kib(os.getpid(), "VmRSS")
    assert 0 < figures["Pss"] <= figures["Rss"]
    assert abs(figures["Rss"] - rss) < 0.2 * rss
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert smaps_rollup_kib(child.pid) == {}


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc smaps_rollup")
def test_the_sampler_keeps_each_process_peak_and_that_of_the_sum() -> None:
    sampler = PssSampler({"me": os.getpid()})
    sampler.sample()
    before = sampler.peak_pss_kib["me"]
    # 64 MiB of fresh pages, each written: resident. An anonymous map of its own, not the heap: a
    # process that freed much before may serve a heap allocation from pages resident already.
    grown = mmap.mmap(-1, 64 * 2 ** 20)
    for page in range(0, len(grown), mmap.PAGESIZE):
        grown[page] = 1
    sampler.sample()
    grown.close()
    sampler.sample()
    assert sampler.peak_pss_kib["me"] >= before + 60 * 1024
    assert sampler.peak_pss_sum_kib == sampler.peak_pss_kib["me"]


def _population(devices: int, registered: int | None = None, algorithm: str = "fedavg", **pss: float) -> dict:
    registered = devices if registered is None else registered
    p = population.Population(algorithm, "logreg", devices, population.per_round(devices), 1, registered,
                              12.0 if registered == devices else None, 3, 3, [0.5, 0.25, 0.75],
                              {"fed_server": pss.get("fed", 0.0), "agent-0": pss.get("agent0", 0.0),
                               "agent-1": pss.get("agent1", 0.0), "testbed": pss.get("testbed", 0.0)},
                              None if registered == devices else "not registered")
    return p.as_dict()


def test_memory_per_device_is_the_growth_from_the_smallest_population_over_the_devices_added() -> None:
    runs = [_population(100, fed=200, agent0=300, agent1=100, testbed=600),
            _population(1100, fed=210, agent0=400, agent1=200, testbed=800),
            _population(1000, registered=600, fed=205, agent0=350, agent1=150, testbed=700),
            _population(1000, algorithm="s2fl", fed=900, agent0=900, testbed=1800)]
    per_device = population.per_device_kib(runs)
    assert set(per_device) == {1100, 1000}
    assert per_device[1100] == {"fed_server": 10 * 1024 / 1000, "main_server": 0.0,
                                "agents": 200 * 1024 / 1000, "testbed": 200 * 1024 / 1000}
    # Not every device registered: the growth is over those that did.
    assert per_device[1000]["testbed"] == 100 * 1024 / 500
    assert population.per_device_kib([_population(100, registered=10)]) == {}


def test_a_population_sums_its_agents_and_names_its_main_server() -> None:
    p = population.Population("s2fl", "cnn", 1000, 10, 2, 1000, 5.0, 3, 3, [1.0, 3.0, 2.0],
                              {"fed_server": 100.0, "main_server": 50.0, "main_server-1": 25.0, "agent-0": 10.0,
                               "agent-1": 20.0, "testbed": 210.0}, None)
    assert p.kind_pss_mib() == {"fed_server": 100.0, "main_server": 75.0, "agents": 30.0, "testbed": 210.0}
    assert p.median_round_s == 2.0


def test_devices_per_round_and_the_configs() -> None:
    assert [population.per_round(n) for n in (5, 20, 100, 1000, 10000)] == [1, 2, 10, 100, 100]
    config = population.fedavg_config(1000, 600.0)
    assert (config.devices_per_round, config.data.num_devices, config.data.partition, config.model) == (
        100, 1000, "natural", "logreg")
    assert config.deadlines.registration_s > 600.0
    s2fl = population.s2fl_config(600.0)
    assert (s2fl.algorithm, s2fl.model, s2fl.data.num_devices, s2fl.devices_per_round) == ("s2fl", "cnn", 1000, 10)


def test_sizes_on_the_command_line() -> None:
    assert population.parse_sizes("1000, 100,1000") == (100, 1000)
    for bad in ("", "a,100", "1,100", "0"):
        with pytest.raises(ValueError, match="--sizes"):
            population.parse_sizes(bad)


def _results() -> dict:
    runs = [_population(100, fed=200, agent0=300, testbed=520), _population(1000, fed=250, agent0=800, testbed=1070),
            _population(10000, registered=4000, fed=600, agent0=3000, testbed=3620)]
    machine = {"cpu_model": "cpu", "cpus_usable": 2, "cpu_count": 2, "memory_gib": 8, "python": "3.11",
               "torch": "2", "date_utc": "2026-01-02T03:04:05+00:00", "load_average_at_start": [0.1],
               "load_average_at_end": [0.2]}
    return {"machine": machine, "total_s": 60.0, "populations": runs,
            "settings": {"sizes": [100, 1000, 10000], "agents": 1, "rounds": 3, "time_limit_s": 600.0,
                         "fedavg": "f", "s2fl": "s"},
            "goals": {"register_s_at_10000": 60.0, "testbed_pss_mib_at_10000": 1907.3,
                      "round_ratio_10000_over_1000": 1.2, "agent_kb_per_device": 50.0, "fed_server_kb_per_device": 10.0},
            "per_device_kib": {str(n): v for n, v in population.per_device_kib(runs).items()}}


def test_the_table_has_a_row_per_population_and_marks_one_that_did_not_register() -> None:
    rows = population.table(_results())
    header, small, large, stalled = rows
    assert len(rows) == 4 and all(len(r) == len(header) for r in rows)
    cell = dict(zip(header, large))
    assert (cell["devices"], cell["register s"], cell["median round s"], cell["testbed MiB"]) == (
        "1,000", "12.0", "0.50", "1,070")
    assert cell["KiB/device testbed"] == f"{550 * 1024 / 900:,.1f}"
    assert dict(zip(header, small))["KiB/device testbed"] == "-"
    stalled_cell = dict(zip(header, stalled))
    assert (stalled_cell["registered"], stalled_cell["register s"]) == ("4,000 (limit)", "-")
    text = population.report(_results())
    assert "| fedavg logreg | 1,000 |" in text and "Not finished: fedavg at 10,000: not registered." in text


def test_the_files_and_the_system_benchmark_part(tmp_path: Path) -> None:
    results = _results()
    markdown = population.write(results, tmp_path / "p.json", population.report)
    assert markdown.read_text().strip() == population.report(results)
    assert "h" in PARTS and "h" not in DEFAULT_PARTS
    summary = run_report({"machine": {**results["machine"], "load_average_at_start": [0.1]}, "mode": "full",
                          "total_s": 1.0, "population": results})
    assert "(h) large populations" in summary and "| fedavg logreg | 10,000 |" in summary


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc smaps_rollup")
def test_the_memory_guard_trips_once_past_its_limit() -> None:
    trips: list[int] = []
    guard = population.GuardedSampler({"me": os.getpid()}, 1e9, lambda: trips.append(1))
    guard.sample()
    assert trips == [] and not guard.tripped.is_set()
    guard.limit_mib = guard.peak_pss_sum_kib / 1024 / 2
    guard.sample()
    guard.sample()
    assert trips == [1] and guard.tripped.is_set()
