"""Fault injection with real processes: crashed servers, frozen devices. The goal is no lost round."""
from __future__ import annotations

import json
import math
import os
import signal
import time

import httpx
import pytest

from device_agent.clients import HttpFedClient, main_connector
from device_agent.device import Device
from device_agent.task_expired import TaskExpired
from fed_server.recorder import FAULT_PAUSE_ENV
from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, server_pair, small_config, wait_for
from testbed.processes import wait_healthy



def _fed_status(testbed) -> dict:
    return httpx.get(f"{testbed.fed_url}/v1/status", timeout=5).json()


def _main_round(testbed) -> dict | None:
    return httpx.get(f"{testbed.main_url}/v1/status", timeout=5).json()["round"]


def _check_no_round_lost(status: dict, metrics: list[dict], run_dir, rounds: int) -> None:
    assert status["state"] == "finished", status
    ok = [m["round"] for m in metrics if m["status"] == "ok"]
    assert ok == list(range(1, rounds + 1)), f"each round exactly once: {[(m['round'], m['status']) for m in metrics]}"
    ids = [m["round_id"] for m in metrics]
    assert len(ids) == len(set(ids)), "attempt ids are never reused"
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    assert all(bool(t.isfinite().all()) for t in state.values() if t.is_floating_point())
    assert status["summary"]["final_accuracy"] > status["summary"]["initial_accuracy"]
    summary = json.loads((run_dir / "summary.json").read_text())   # a finished run always has one
    assert summary["finished"] and summary["rounds"] == rounds


def _fault_points_reached(run_dir, before: str) -> int:
    return (run_dir / "logs" / "fed_server.log").read_text().count(f"before the {before}")


def _sigkill_fed_server(testbed):
    os.kill(testbed.fed.process.pid, signal.SIGKILL)
    testbed.fed.process.wait()


def _restart_fed_server(testbed) -> None:
    """Start the killed Fed Server again on the same run directory and wait until it serves."""
    testbed.processes.restart(testbed.fed)
    wait_healthy(testbed.fed_url, testbed.fed)


def test_fed_server_killed_twice_in_a_row_never_reuses_an_attempt_id(run_testbed):
    # The second incarnation hands out an attempt id and dies before any checkpoint; the third
    # must not hand out that id again (it used to: both continued from the same checkpoint's
    # counter, so a dead incarnation's retried upload could be taken for the live one's).
    config = small_config(rounds=3, **{"deadlines.round_s": 60, "deadlines.step_s": 10})
    opened: list[int] = []

    def open_round(testbed) -> int:
        wait_for(lambda: _fed_status(testbed)["open_round"] is not None, 180, "an attempt to open")
        return _fed_status(testbed)["open_round"]

    def crash_twice(testbed):
        wait_for(lambda: _fed_status(testbed)["rounds_done"] >= 1, 180, "round 1 to finish")
        for _ in range(2):
            opened.append(open_round(testbed))
            _restart_fed_server(testbed)
        opened.append(open_round(testbed))

    status, metrics, run_dir = run_testbed(config, during=crash_twice)
    _check_no_round_lost(status, metrics, run_dir, 3)
    assert opened == sorted(set(opened)), f"every incarnation opens a new attempt id: {opened}"
    assert (run_dir / "logs" / "fed_server.log").read_text().count("resumed run") == 2


def test_fed_server_killed_between_a_round_record_and_its_checkpoint(run_testbed, monkeypatch):
    # The recorder pauses (fault-injection hook) after writing round 2's metrics line and before
    # the checkpoint that counts it; the server is killed there. The resumed run drops the line
    # the checkpoint does not cover and re-runs the round: each round recorded exactly once.
    # Long enough for the test, which reads the log every 0.1 s, to kill the server in the window.
    monkeypatch.setenv(FAULT_PAUSE_ENV["checkpoint"], "2")
    config = small_config(rounds=3, **{"deadlines.round_s": 60, "deadlines.step_s": 10})

    def crash_in_the_window(testbed):
        wait_for(lambda: _fault_points_reached(testbed.run_dir, "checkpoint") >= 2, 240, "round 2's record")
        _sigkill_fed_server(testbed)
        _, _, extra = RunDirectory(testbed.run_dir).read_checkpoint()
        assert len(read_metrics(testbed.run_dir)) == extra["history_len"] + 1, "killed between the two writes"
        _restart_fed_server(testbed)

    status, metrics, run_dir = run_testbed(config, during=crash_in_the_window)
    _check_no_round_lost(status, metrics, run_dir, 3)


def test_fed_server_killed_before_the_summary_of_a_finished_run_writes_it_on_resume(run_testbed, monkeypatch):
    monkeypatch.setenv(FAULT_PAUSE_ENV["summary"], "60")
    config = small_config(rounds=2, **{"deadlines.round_s": 60, "deadlines.step_s": 10})

    def crash_before_the_summary(testbed):
        wait_for(lambda: _fault_points_reached(testbed.run_dir, "summary") >= 1, 240, "the last checkpoint")
        _sigkill_fed_server(testbed)
        assert not (testbed.run_dir / "summary.json").exists()
        _restart_fed_server(testbed)

    status, metrics, run_dir = run_testbed(config, during=crash_before_the_summary)
    _check_no_round_lost(status, metrics, run_dir, 2)


def test_fed_server_sigkilled_mid_run_resumes_from_its_checkpoint(run_testbed):
    config = small_config(rounds=4, **{"deadlines.round_s": 60, "deadlines.step_s": 10})

    def crash_after_round_two(testbed):
        wait_for(lambda: _fed_status(testbed)["rounds_done"] >= 2 and _fed_status(testbed)["open_round"] is not None,
                    180, "round 3 to start")
        time.sleep(0.5)  # mid-round: devices are training
        _restart_fed_server(testbed)

    status, metrics, run_dir = run_testbed(config, during=crash_after_round_two)
    _check_no_round_lost(status, metrics, run_dir, 4)
    assert "resumed run" in (run_dir / "logs" / "fed_server.log").read_text()


def test_a_fedavg_run_killed_mid_round_and_resumed_records_the_rounds_of_the_run_never_killed(run_testbed):
    # What shapes a round is the run's, not the process's: the selection's generator is in the
    # checkpoint, and each device's batch order is seeded by the run's seed, its shard and the
    # logical round (not the attempt id, which skips the ones handed out before the kill). So the
    # resumed run trains round 2 again, from round 1's checkpoint, exactly as the other run did.
    # Each device's own deadline is off: a load spike on a shared machine can cut a device by it
    # in one run and not the other, which is not what this test compares.
    config = small_config(algorithm="fedavg", rounds=3, **{"deadlines.round_s": 60, "deadlines.patience": None})
    _, never_killed, _ = run_testbed(config, name="never-killed")

    def kill_in_round_two(testbed):
        wait_for(lambda: (s := _fed_status(testbed))["rounds_done"] >= 1 and s["open_round"] is not None,
                 180, "round 2 to open")
        _sigkill_fed_server(testbed)
        _restart_fed_server(testbed)

    status, resumed, run_dir = run_testbed(config, during=kill_in_round_two, name="resumed")
    _check_no_round_lost(status, resumed, run_dir, 3)
    ok = [m for m in resumed if m["status"] == "ok"]
    assert ok[-1]["round_id"] > 3, "the resumed run's attempt ids skip the one open at the kill"
    assert [m["round_id"] for m in never_killed] == [1, 2, 3]
    for a, b in zip(never_killed, ok, strict=True):
        assert a["selected"] == b["selected"] and a["aggregated"] == b["aggregated"], (a["round"], a["left"], b["left"])
        # The same batches from the same weights, summed in device order: the same figures (a
        # tolerance only for float rounding).
        assert b["test_loss"] == pytest.approx(a["test_loss"], rel=1e-6), (a["round"], a["test_loss"], b["test_loss"])
        assert b["test_accuracy"] == pytest.approx(a["test_accuracy"], abs=1e-9)


def test_main_server_sigkilled_mid_round_the_attempt_fails_and_is_retried(run_testbed):
    config = small_config(rounds=3, **{"deadlines.round_s": 15, "deadlines.step_s": 5, "deadlines.join_s": 5})

    def crash_main_server_while_stepping(testbed):
        wait_for(lambda: (r := _main_round(testbed)) is not None and r["round_id"] >= 2
                    and any(g["step"] >= 1 for g in r["groups"]), 180, "round 2 to be stepping")
        testbed.processes.restart(testbed.main)
        wait_healthy(testbed.main_url, testbed.main)

    status, metrics, run_dir = run_testbed(config, during=crash_main_server_while_stepping)
    _check_no_round_lost(status, metrics, run_dir, 3)


def test_device_frozen_past_the_step_deadline_is_dropped_then_rejoins(run_testbed):
    # Devices 0-1 in one agent, 2-3 in another. The second agent is frozen (SIGSTOP) during round
    # 1's steps for longer than the step deadline, then thawed: its devices are dropped from round
    # 1, which completes with the other two, and they train again in round 2.
    # Each device's own deadline is off: this test is about the Main Server's step deadline. With
    # it on, the Fed Server takes the frozen devices out first, once the other two uploaded, and
    # counts a missed deadline, so they sit out round 2 (test_attacks.py covers that rule).
    config = small_config(rounds=2, **{"deadlines.step_s": 4, "deadlines.round_s": 60, "train.batch_size": 32,
                                       "deadlines.patience": None})

    def freeze_second_agent(testbed):
        victim = testbed.agent_services[1]
        wait_for(lambda: (r := _main_round(testbed)) is not None and any(g["step"] >= 2 for g in r["groups"]),
                    180, "round 1 to be stepping")
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: _fed_status(testbed)["rounds_done"] >= 1, 120, "round 1 to finish without them")
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)

    status, metrics, run_dir = run_testbed(config, agents=2, during=freeze_second_agent)
    _check_no_round_lost(status, metrics, run_dir, 2)
    ok = [m for m in metrics if m["status"] == "ok"]  # a loaded machine may fail an attempt first
    assert ok[0]["aggregated"] == ["dev-000", "dev-001"]
    assert set(ok[0]["dropped"]) == {"dev-002", "dev-003"}
    assert ok[-1]["aggregated"] == ["dev-000", "dev-001", "dev-002", "dev-003"]
    assert not math.isnan(ok[-1]["test_loss"])


def test_device_gives_up_a_task_whose_deadline_passed():
    # A device that gets a task but cannot start it before the round deadline (a stall, a busy
    # machine) must not train it: that attempt is closed and its upload would only be rejected.
    config = small_config(algorithm="fedavg", **{"data.num_devices": 1, "deadlines.round_s": 1.0,
                                                 "deadlines.max_failed_attempts": 1000})
    with server_pair(config, "expired") as servers:
        device = Device("dev-000", 0, HttpFedClient(servers.fed_url), main_connector(), kind=None)
        device.setup()
        give_up = time.monotonic() + 30
        task, size = device.poller.poll(0.0)
        received_at = time.monotonic()
        while task.status != "train" and time.monotonic() < give_up:
            time.sleep(0.05)
            task, size = device.poller.poll(0.0)
            received_at = time.monotonic()
        assert task.status == "train" and task.deadline_s is not None and task.deadline_s <= 1.0
        time.sleep(task.deadline_s + 0.1)
        with pytest.raises(TaskExpired, match="deadline passed before the task started"):
            device.run_task(task, size, received_at)
        status = _fed_status(servers)
        assert device.tasks_trained == 0 and status["rounds_done"] == 0


def test_a_device_cut_at_its_own_deadline_gives_its_task_up_when_the_attempt_closes(run_testbed):
    # FedAvg, two High devices and one Low, transfers at half the kinds' rates: the Low device's
    # download of the whole model (about 6.9 MB at 0.5 MB/s, 14 s) outlasts its own deadline
    # (twice the Highs' rounds of a few seconds, plus a second). The attempt closes without it;
    # its agent's session names it (``ended``) and the device gives its emulated transfer up there,
    # rather than sleep through it and meet its next task late.
    config = small_config(algorithm="fedavg", rounds=2, **{"data.num_devices": 3, "data.max_samples": 300,
                                                           "devices.profiles": ["high", "high", "low"],
                                                           "devices.time_scale": 0.5})
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished", status
    assert metrics[0]["left"] == {"dev-002": "no upload by its own deadline"}, metrics[0]["left"]
    log = (run_dir / "logs" / "agent-0.log").read_text()
    assert ("dev-002: round 1 (attempt 1) abandoned: the Fed Server closed the task's attempt during an emulated "
            "transfer of ") in log, log[-3000:]
