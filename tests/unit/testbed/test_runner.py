"""The testbed's progress follower: a missed status request is not the end of a run; each asks for what is new."""
from __future__ import annotations

import httpx
import pytest

from shared.config import RunConfig
from testbed.runner import Testbed, TestbedError

FINISHED = {"state": "finished", "records": 0, "history": [], "rounds_done": 1, "rounds_total": 1, "summary": {}}


def _testbed(tmp_path, answers):
    testbed = Testbed(RunConfig(), tmp_path)   # never started: no processes to check

    def status(since: int = 0, seen: int = 0, wait_s: float = 0.0) -> dict:
        answer = answers.pop(0) if answers else answers_default
        if isinstance(answer, Exception):
            raise answer
        return answer

    answers_default = httpx.ReadTimeout("busy")
    testbed.status = status
    return testbed


def test_follow_rides_out_a_few_failed_status_polls(tmp_path):
    testbed = _testbed(tmp_path, [httpx.ReadTimeout("busy"), httpx.ConnectError("refused"), FINISHED])
    assert testbed.follow(retry_s=0.01) == FINISHED


def test_follow_gives_up_when_the_server_stays_unreachable(tmp_path):
    testbed = _testbed(tmp_path, [])
    testbed.status_patience_s = 0.2
    with pytest.raises(TestbedError, match="status failed for"):
        testbed.follow(retry_s=0.01)


def test_follow_asks_for_rounds_after_the_last_completed_one_and_prints_each_attempt_once(tmp_path):
    # The server's history grows by one attempt per answer; status(since) filters on the logical
    # round as the Fed Server does. A failed attempt of round 1 must not hide its retry. Each
    # request but the last (the whole history, at once) waits for more records than the last
    # answer counted.
    attempts = [{"round": 1, "round_id": 1, "status": "failed"}, {"round": 1, "round_id": 2, "status": "ok"},
                {"round": 2, "round_id": 3, "status": "ok"}]
    asked: list[tuple[int, int, float]] = []
    testbed = Testbed(RunConfig(), tmp_path)

    def status(since: int = 0, seen: int = 0, wait_s: float = 0.0) -> dict:
        asked.append((since, seen, wait_s))
        known = attempts[:len(asked)]
        done = len(asked) >= len(attempts)
        return {**FINISHED, "state": "finished" if done else "running", "records": len(known),
                "history": [r for r in known if r["round"] > since]}

    testbed.status = status
    printed: list[dict] = []
    final = testbed.follow(lambda record, _: printed.append(record), wait_s=5.0)
    assert printed == attempts
    assert asked == [(0, 0, 5.0), (0, 1, 5.0), (1, 2, 5.0), (0, 3, 0.0)]   # the last asks for the whole history ...
    assert final["history"] == attempts      # ... which the caller gets


def test_device_data_and_local_runs_go_together(tmp_path):
    local = RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]}})
    with pytest.raises(TestbedError, match="needs --device-data"):
        Testbed(local, tmp_path)
    with pytest.raises(TestbedError, match="--device-data is for runs with data.dataset: local"):
        Testbed(RunConfig(), tmp_path, device_data=["a.npz"])
    assert Testbed(local, tmp_path, device_data=["a.npz", "b.npz"]).device_data == ["a.npz", "b.npz"]


def test_device_data_agents_of_real_devices_get_no_kinds(tmp_path):
    # devices.profiles: [] means real devices (no emulation); rotating the empty kind list per
    # agent divided by zero before any agent started.
    local = RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]},
                                      "devices": {"profiles": []}})
    testbed = Testbed(local, tmp_path, device_data=["a.npz", "b.npz"])
    started: list[list[str]] = []
    testbed.processes.start = lambda name, module, args, env=None: started.append(list(args))
    testbed.start_agent("agent-1", data="b.npz", index=1)
    args = started[0]
    assert args[args.index("--data") + 1] == "b.npz" and args[args.index("--kinds") + 1] == ""


@pytest.mark.parametrize("algorithm, expected", [("fedavg", 0), ("fedbc", 0), ("s2fl", 1), ("sfl", 1)])
def test_main_servers_default_to_none_for_split_depth_zero(tmp_path, algorithm, expected):
    """A split-depth-zero algorithm never calls a Main Server, so the testbed starts none unless
    asked; a split algorithm gets one; an explicit count is kept."""
    config = RunConfig(algorithm=algorithm)
    default = Testbed(config, tmp_path / "a")
    assert len(default.main_urls) == expected
    assert (default.main_url is None) == (expected == 0)
    assert len(Testbed(config, tmp_path / "b", main_servers=2).main_urls) == 2
