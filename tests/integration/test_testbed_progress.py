"""The testbed's progress follower through the real services: every attempt is printed once."""
from __future__ import annotations

import threading

from integration_support import freeze_agent_through_a_failed_attempt, read_metrics, small_config
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def test_follow_prints_the_retry_and_later_rounds_after_a_failed_attempt(tmp_path):
    # Quorum = all 4 devices; the second agent (2 devices) is frozen through round 1's first
    # attempt, which fails; the retry and round 2 succeed. The follower polls while this happens,
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
                                timeout=300, poll_s=0.2)
        fault.join(timeout=5)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished"
    assert any(m["status"] == "failed" for m in metrics), "the fault must have failed an attempt"
    assert [m["status"] for m in metrics if m["round"] == 2] == ["ok"]
    assert printed == [(m["round"], m["round_id"], m["status"]) for m in metrics]
