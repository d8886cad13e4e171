"""The testbed's progress follower through the real services: every attempt is printed once, and
each status request is held until there is something new."""
from __future__ import annotations

import threading
import time

import httpx

from integration_support import freeze_agent_through_a_failed_attempt, read_metrics, small_config
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def test_follow_prints_the_retry_and_later_rounds_after_a_failed_attempt(tmp_path):
    # Quorum = all 4 devices; the second agent (2 devices) is frozen through round 1's first
    # attempt, which fails; the retry and round 2 succeed. The follower asks while this happens,
    # so it sees the failed attempt before the retry. It used to ask for records after the
    # highest *attempt id* it had seen, which hid the retry of round 1 (logical round 1 is not
    # after attempt id 1).
    config = small_config(algorithm="fedavg", rounds=2, **{"deadlines.min_participants": 4, "deadlines.round_s": 20})
    printed: list[tuple[int, int, str]] = []
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, agents=2, warm=shared_starter()) as testbed:
        fault = threading.Thread(target=freeze_agent_through_a_failed_attempt, args=(testbed,), daemon=True)
        fault.start()
        status = testbed.follow(lambda record, _: printed.append((record["round"], record["round_id"], record["status"])),
                                timeout=300)
        fault.join(timeout=5)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished"
    assert any(m["status"] == "failed" for m in metrics), "the fault must have failed an attempt"
    assert [m["status"] for m in metrics if m["round"] == 2] == ["ok"]
    assert printed == [(m["round"], m["round_id"], m["status"]) for m in metrics]


def test_status_is_held_until_a_new_record_is_written_or_the_run_finished(tmp_path):
    # GET /v1/status?seen=K&wait_s=W answers once the run has more than K records (or finished),
    # not at once and not only when W runs out: the first request, made before any round ran,
    # comes back with round 1's record while the run goes on (woken by that record, not by the
    # run's end), before its 30 s (the longest a request is held; a round here takes seconds).
    config = small_config(algorithm="fedavg", rounds=3)
    with Testbed(config, tmp_path / "run", agents=2, warm=shared_starter()) as testbed:
        started = time.monotonic()
        first = testbed.status(seen=0, wait_s=30.0)
        waited = time.monotonic() - started
        assert first["records"] >= 1 and [r["round"] for r in first["history"]][:1] == [1], first
        assert first["state"] == "running", f"answered only when the run finished ({first['records']} records)"
        assert waited < 29.0, f"held {waited:.1f}s: the record did not wake the request"
        too_long = httpx.get(f"{testbed.fed_url}/v1/status", params={"wait_s": 31}, timeout=10)
        assert too_long.status_code == 422, too_long.text
        final = testbed.follow(timeout=240)
        started = time.monotonic()
        again = testbed.status(seen=final["records"], wait_s=30.0)   # finished is news: answered at once
        assert again["state"] == "finished" and time.monotonic() - started < 10.0
