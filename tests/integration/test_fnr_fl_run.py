"""FNR-FL end to end through the real services: report -> follow-up (refine or not) -> upload."""
from __future__ import annotations

import math
import threading

from fed_server.run_dir import RunDirectory
from integration_support import freeze_agent_through_a_failed_attempt, small_config, wait_for
from shared.models import build_model


def test_fnr_fl_two_rounds_refines_the_lowest_accuracy_half(run_testbed):
    config = small_config(algorithm="fnr-fl", **{
        "data.partition": "iid",
        "data.public_samples": 200,
        "data.device_transform": "gaussian_noise",
        "data.device_transform_params": {"sigma": 1.0},
        "algorithm_params": {"p": 0.5, "refine_epochs": 1},
    })
    status, metrics, run_dir = run_testbed(config)

    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2]
    assert all(m["status"] == "ok" for m in metrics)
    assert all(len(m["aggregated"]) == 4 for m in metrics)
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in metrics)
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(config.model, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert any(not (state[k] == initial[k]).all() for k in initial)

    for m in metrics:
        am = m["algorithm_metrics"]
        assert am["leaky"] is False and am["public_set"] == "holdout" and am["penalty"] == "paper"
        acc = am["public_accuracy"]
        assert am["reported"] == 4 and set(acc) == set(m["selected"])
        # floor(4 * 0.5) = 2 devices, the two lowest public accuracies (ties by id), refined and uploaded.
        lowest = sorted(acc, key=lambda d: (acc[d], d))[:2]
        assert am["refine_selected"] == lowest
        assert am["refined"] == sorted(lowest)
        assert set(am["delta"]) == set(lowest)
        for device in lowest:
            stats = am["refine_stats"][device]
            assert stats["refine_steps"] == 1 * math.ceil(200 / 32)
            assert math.isfinite(stats["refine_ce"])
        assert all(len(norms) == 10 for norms in am["feature_norms"].values())


def _fnr_fl_config(**overrides):
    return small_config(algorithm="fnr-fl", **{
        "data.partition": "iid", "data.public_samples": 200, "algorithm_params": {"p": 0.5, "refine_epochs": 1},
        **overrides})


def test_fnr_fl_retries_a_failed_attempt_and_its_uploads_are_accepted(run_testbed):
    # Quorum = all 4 devices and the second agent frozen through round 1's first attempt: that
    # attempt fails, and the retry of the same logical round must get its follow-ups and accept
    # every upload. Before FNR-FL keyed its plan by the logical round, every upload of a retry
    # was refused with 422 "no follow-up plan for round ...".
    config = _fnr_fl_config(rounds=2, **{"deadlines.min_participants": 4, "deadlines.round_s": 30})
    status, metrics, _ = run_testbed(config, agents=2, timeout=400, during=_in_background(freeze_agent_through_a_failed_attempt))

    assert status["state"] == "finished", status
    assert metrics[0]["status"] == "failed" and metrics[0]["round"] == 1
    ok = [m for m in metrics if m["status"] == "ok"]
    assert [m["round"] for m in ok] == [1, 2]
    assert all(len(m["aggregated"]) == 4 and m["algorithm_metrics"]["reported"] == 4 for m in ok)


def test_fnr_fl_completes_rounds_when_one_agent_of_two_is_killed(run_testbed):
    # The second agent's devices register, then the agent is SIGKILLed. Each round's report phase
    # closes at deadlines.report_s, the two reporters get their follow-ups, and the round is
    # aggregated from their uploads. Before the report phase had its own deadline, the reporters
    # waited until the round deadline and every attempt closed with 0 updates.
    config = _fnr_fl_config(rounds=2, **{"deadlines.round_s": 60, "deadlines.report_s": 8})

    def kill_second_agent(testbed):
        wait_for(lambda: testbed.status()["registered"] >= 4, 240, "every device to register")
        testbed.agent_services[1].process.kill()

    status, metrics, _ = run_testbed(config, agents=2, timeout=400, during=kill_second_agent)

    assert status["state"] == "finished" and status["rounds_done"] == 2, status
    ok = [m for m in metrics if m["status"] == "ok"]
    assert [m["round"] for m in ok] == [1, 2]
    for m in ok:
        assert m["aggregated"] == ["dev-000", "dev-001"]
        assert m["algorithm_metrics"]["reported"] == 2
        assert m["round_time_s"] < config.deadlines.round_s   # closed on the uploads, not the deadline
    # Round 1 waited the report deadline for the killed agent's devices; having missed it, they sit
    # out round 2 (fed_server/missed_deadlines.py), which then waits for nobody.
    assert set(ok[0]["dropped"]) == {"dev-002", "dev-003"}
    assert ok[1]["selected"] == ["dev-000", "dev-001"] and ok[1]["dropped"] == []


def _in_background(fault):
    """Run ``fault(testbed)`` beside the run instead of before it is followed."""
    def start(testbed):
        threading.Thread(target=fault, args=(testbed,), daemon=True).start()
    return start
