"""The benchmark's measuring tools: the py-spy stack classifier and the /proc readers of benchmark (f)."""
from __future__ import annotations

import os
import time

from benchmarks.fedavg_overhead import PssSampler, cpu_seconds, critical_path_round_s, smaps_rollup_kib
from benchmarks.profile_breakdown import breakdown, classify

THREAD = "thread (1): dev-001;Thread.run (threading.py:982);Device.run (device_agent/device.py:159)"


def test_waiting_is_decided_by_the_innermost_python_frames_and_work_by_any_marker():
    blocked_read = f"{THREAD};send_step (device_agent/device.py:433);SyncStream.read (httpcore/_backends/sync.py:128);0x7f (libc.so.6)"
    assert classify(blocked_read).startswith("wait: reply")
    poll = f"{THREAD};Event.wait (threading.py:629);Condition.wait (threading.py:331)"
    assert classify(poll).startswith("wait: sleeps and poll")
    backward = f"{THREAD};train_round (device_agent/trainer.py:111);Tensor.backward (torch/_tensor.py:623);at::conv (libtorch_cpu.so)"
    assert classify(backward).startswith("work: compute, training")
    encode = f"{THREAD};encode_state (shared/wire.py:90);packb (shared/wire.py:120)"
    assert classify(encode).startswith("work: serialization")
    # A stack that waits for the GIL inside torch is GIL wait, not compute.
    assert classify(f"{backward};take_gil (libpython3.11.so.1.0)") == "work: GIL wait"
    assert classify(f"{THREAD};Device.register (device_agent/device.py:200)") == "work: other Python"


def test_breakdown_sums_the_counts_of_a_raw_file(tmp_path):
    raw = tmp_path / "raw.txt"
    raw.write_text(f"{THREAD};Event.wait (threading.py:629);Condition.wait (threading.py:331) 7\n"
                   f"{THREAD};train_round (device_agent/trainer.py:111);forward (torch/nn/modules/conv.py:1) 3\n")
    counts, total = breakdown(raw)
    assert total == 10 and counts["work: compute, training and aggregation (torch)"] == 3


def test_critical_path_is_the_longest_device_or_the_packed_sum_plus_the_serial_part():
    assert critical_path_round_s({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.0}, 0.5, 2) == 2.5   # packed: 4 / 2
    assert critical_path_round_s({"a": 3.0, "b": 0.5, "c": 0.5}, 0.5, 2) == 3.5            # the longest device


def test_proc_readers_see_this_process_and_nothing_for_a_gone_one():
    start = cpu_seconds(os.getpid())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.05:
        pass
    assert cpu_seconds(os.getpid()) > start
    figures = smaps_rollup_kib(os.getpid())
    assert 0 < figures["Pss"] <= figures["Rss"]
    assert cpu_seconds(2 ** 22 + 1) is None and smaps_rollup_kib(2 ** 22 + 1) == {}
    sampler = PssSampler({"me": os.getpid()}, interval_s=0.01).start()
    memory = sampler.stop()
    assert memory["peak_pss_sum_mib"] > 0 and memory["peak_pss_mib"]["me"] == memory["peak_pss_sum_mib"]
