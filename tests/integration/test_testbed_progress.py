"""The testbed's progress follower through the real services: every attempt is printed once, and
each status request is held until there is something new."""
from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from fed_server.records import RoundRecord
from fed_server.update_checks import shard_sizes
from integration_support import freeze_agent_through_a_failed_attempt, read_metrics, server_pair, small_config
from shared.http_client import HEADERS
from shared.schemas import DeviceProfileMsg, RegisterRequest
from shared.wire import packb
from testbed.follow import format_done, format_round, format_waiting
from testbed.processes import free_port, service_env
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

REPO = Path(__file__).resolve().parents[2]


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
        status = testbed.follow(lambda record, _: printed.append((record.round, record.round_id, record.status)),
                                timeout=300)
        fault.join(timeout=5)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished"
    assert any(m["status"] == "failed" for m in metrics), "the fault must have failed an attempt"
    assert [m["status"] for m in metrics if m["round"] == 2] == ["ok"]
    assert printed == [(m["round"], m["round_id"], m["status"]) for m in metrics]


def test_status_is_held_until_a_new_record_is_written_and_a_second_terminal_follows_the_run(tmp_path):
    # GET /v1/status?seen=K&wait_s=W answers once the run has more than K records (or finished),
    # not at once and not only when W runs out: the first request, made before any round ran,
    # comes back with round 1's record while the run goes on (woken by that record, not by the
    # run's end), before its 30 s (the longest a request is held; a round here takes seconds).
    # Meanwhile `python -m testbed.follow URL`, as a user runs it against a Fed Server, prints
    # the same round lines and summary as the testbed's own follower.
    config = small_config(algorithm="fedavg", rounds=3)
    with Testbed(config, tmp_path / "run", agents=2, warm=shared_starter()) as testbed:
        watcher = subprocess.Popen([sys.executable, "-m", "testbed.follow", testbed.fed_url, "--timeout", "240"],
                                   cwd=REPO, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
        try:
            out, err = watcher.communicate(timeout=60)
        finally:
            watcher.kill()
    assert watcher.returncode == 0, err
    # It may have started while the devices registered: those lines come first.
    lines = out.splitlines()
    waiting = [line for line in lines if line.startswith("waiting for devices: ")]
    assert lines[:len(waiting)] == waiting, out
    assert lines[len(waiting):] == [format_round(RoundRecord.model_validate(r), final) for r in final["history"]] + [
        format_done(final["summary"])], out


def test_follow_command_reports_the_devices_as_they_register(tmp_path):
    # A Fed Server waiting for 2 devices: the follower says 0 of 2, then 1 of 2 once one registers
    # (its status is asked every second while nothing is recorded), and gives up at its timeout.
    config = small_config(algorithm="fedavg", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200})
    with server_pair(config, "follow-waiting") as pair:
        watcher = subprocess.Popen([sys.executable, "-m", "testbed.follow", pair.fed_url, "--timeout", "8"], cwd=REPO,
                                   env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert watcher.stdout.readline() == format_waiting(0, 2) + "\n"
            register = RegisterRequest(device_id="dev-0", shard=0, num_samples=shard_sizes(config.data)[0],
                                       profile=DeviceProfileMsg(kind="high", flops=1e10, rate=1e7))
            httpx.post(f"{pair.fed_url}/v1/devices/register", content=packb(register.model_dump()), headers=HEADERS,
                       timeout=30).raise_for_status()
            assert watcher.stdout.readline() == format_waiting(1, 2) + "\n"
            out, err = watcher.communicate(timeout=60)
        finally:
            watcher.kill()
    assert watcher.returncode == 1 and out == "", out
    assert err.startswith("follow failed: run did not finish within 8s"), err


def test_follow_command_fails_at_once_without_a_fed_server():
    # A wrong address is one line and status 1 at once, not two minutes of retries.
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "testbed.follow", f"http://127.0.0.1:{free_port()}"], cwd=REPO,
                            env=service_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith("follow failed: no Fed Server status at http://127.0.0.1:"), result.stderr
    assert time.monotonic() - started < 30.0


def test_ctrl_c_stops_the_testbed_at_once_and_the_command_it_prints_resumes_the_run(tmp_path):
    # The first Ctrl-C stops every process within about 2 s (no grace for the agents, no further
    # round) and says how to resume; that command continues from the checkpoint, losing and
    # repeating no round. Interrupted runs used to go on for up to 15 s while the agents were
    # given time to exit, and said only "interrupted". More rounds than a quiet machine runs in the
    # moment between the first round's line and the signal. The test's own process may have
    # SIGINT ignored (a suite started in the background by a script), which the testbed inherits:
    # it acts on SIGINT all the same.
    rounds = 30
    run_dir = tmp_path / "run"
    args = ["--algorithm", "fedavg", "--rounds", str(rounds), "--devices", "3", "--set", "data.max_samples=300",
            "--set", "devices.profiles=[]", "--run-dir", str(run_dir)]
    testbed = subprocess.Popen([sys.executable, "-m", "testbed", *args], cwd=REPO, env=service_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert testbed.stdout is not None
    for line in testbed.stdout:
        if line.startswith(f"round   1/{rounds}"):
            break
    interrupted_at = time.monotonic()
    testbed.send_signal(signal.SIGINT)
    _, err = testbed.communicate(timeout=30)
    took = time.monotonic() - interrupted_at
    assert testbed.returncode == 130, err
    assert took < 3.0, took
    done = len(read_metrics(run_dir))
    assert done < rounds, "the run went on after Ctrl-C"
    assert f"interrupted after {done} of {rounds} rounds; services stopped. Resume from its checkpoint with: " in err, err
    resume = shlex.split(err.rsplit("Resume from its checkpoint with: ", 1)[1].strip())
    assert resume[:3] == ["python", "-m", "testbed"] and resume[3:] == args
    resumed = subprocess.run([sys.executable, *resume[1:]], cwd=REPO, env=service_env(), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"done: {rounds} rounds" in resumed.stdout
    # It says once that it resumed, and prints only the rounds it runs: the restored ones used to
    # be printed again, exactly as before, as if the run had started over.
    said = [line for line in resumed.stdout.splitlines() if line.startswith("resumed after round ")]
    assert len(said) == 1, resumed.stdout
    after = int(said[0].rsplit(" ", 1)[1])
    printed = [int(line.split()[1].split("/")[0]) for line in resumed.stdout.splitlines() if line.startswith("round ")]
    assert 1 <= after < rounds and printed == list(range(after + 1, rounds + 1)), resumed.stdout
    assert [m["round"] for m in read_metrics(run_dir) if m["status"] == "ok"] == list(range(1, rounds + 1))
