"""The testbed's progress follower: a missed status request is not the end of a run; each asks for what is new."""
from __future__ import annotations

import httpx
import pytest

from device_agent.agent import parse_data_args
from fed_server.records import RoundRecord
from shared.config import RunConfig
from testbed.processes import Service
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


def test_follow_asks_for_rounds_after_the_last_completed_one_and_prints_each_attempt_once(tmp_path, round_record):
    # The server's history grows by one attempt per answer; status(since) filters on the logical
    # round as the Fed Server does. A failed attempt of round 1 must not hide its retry. Each
    # request but the last (the whole history, at once) waits for more records than the last
    # answer counted.
    attempts = [round_record(round=1, round_id=1, status="failed"), round_record(round=1, round_id=2),
                round_record(round=2, round_id=3)]
    asked: list[tuple[int, int, float]] = []
    testbed = Testbed(RunConfig(), tmp_path)

    def status(since: int = 0, seen: int = 0, wait_s: float = 0.0) -> dict:
        asked.append((since, seen, wait_s))
        known = attempts[:len(asked)]
        done = len(asked) >= len(attempts)
        return {**FINISHED, "state": "finished" if done else "running", "records": len(known),
                "history": [r.to_json() for r in known if r.round > since]}

    testbed.status = status
    printed: list[RoundRecord] = []
    final = testbed.follow(lambda record, _: printed.append(record), wait_s=5.0)
    assert printed == attempts
    assert asked == [(0, 0, 5.0), (0, 1, 5.0), (1, 2, 5.0), (0, 3, 0.0)]   # the last asks for the whole history ...
    assert final["history"] == [r.to_json() for r in attempts]      # ... which the caller gets


class _StaysUp:
    """A service stand-in that runs until the testbed's process group stops it."""

    def __init__(self) -> None:
        self.up = True

    def alive(self) -> bool:
        return self.up


@pytest.mark.parametrize("state, waits", [("running", False), ("finished", True)])
def test_stop_waits_for_the_agents_only_after_a_finished_run(tmp_path, monkeypatch, state, waits):
    # Agents exit on their own once the run has finished (having collected the final model);
    # stopped before that, a testbed that waited for them sat out the whole grace.
    from testbed import runner

    testbed = _testbed(tmp_path, [{**FINISHED, "state": state}])
    services = [_StaysUp(), _StaysUp()]
    testbed.fed, testbed.agent_services = services[0], [services[1]]
    slept: list[float] = []

    def sleep(seconds: float) -> None:   # an agent that exits while the testbed waits for it
        slept.append(seconds)
        services[1].up = False

    monkeypatch.setattr(runner.time, "sleep", sleep)
    monkeypatch.setattr(testbed.processes, "stop", lambda *args: [setattr(s, "up", False) for s in services])
    testbed.stop()
    assert bool(slept) == waits and not any(s.up for s in services)


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


def test_every_device_data_agent_gets_the_data_args_as_the_agent_reads_them(tmp_path):
    local = RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]}})
    testbed = Testbed(local, tmp_path, device_data=["pkg.mod:load", "b.npz"], data_args=["root=/d", "n=a=b"])
    started: list[list[str]] = []
    testbed.processes.start = lambda name, module, args, env=None: started.append(list(args))
    testbed.start_agent("agent-0", data="pkg.mod:load", index=0)
    testbed.start_agent("agent-1", data="b.npz", index=1)
    for args in started:
        given = [args[i + 1] for i, a in enumerate(args) if a == "--data-arg"]
        assert parse_data_args(given) == {"root": "/d", "n": "a=b"}
    with pytest.raises(TestbedError, match="--data-arg is for the functions of --device-data"):
        Testbed(RunConfig(), tmp_path, data_args=["root=/d"])


@pytest.mark.parametrize("algorithm, expected", [("fedavg", 0), ("fedbc", 0), ("s2fl", 1), ("sfl", 1)])
def test_main_servers_default_to_none_for_split_depth_zero(tmp_path, algorithm, expected):
    """A split-depth-zero algorithm never calls a Main Server, so the testbed starts none unless
    asked; a split algorithm gets one; an explicit count is kept."""
    config = RunConfig(algorithm=algorithm)
    default = Testbed(config, tmp_path / "a")
    assert len(default.main_urls) == expected
    assert (default.main_url is None) == (expected == 0)
    assert len(Testbed(config, tmp_path / "b", main_servers=2).main_urls) == 2


# --- how the devices enrol -------------------------------------------------------------------------


class _Started:
    """A started child that stays up (a service) or has exited (a one-shot command)."""

    def __init__(self, returncode: int | None) -> None:
        self.returncode = returncode

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode or 0

    def send_signal(self, sig: int) -> None:
        pass


def _start_without_services(testbed: Testbed, monkeypatch) -> dict[str, tuple[str, list[str]]]:
    """Start ``testbed`` with every child faked but ``python -m fed_server credentials``, which runs
    here for real; each child's module and arguments by name."""
    import fed_server.__main__ as fed_main
    import testbed.runner as runner
    from testbed.processes import ProcessGroup

    started: dict[str, tuple[str, list[str]]] = {}

    def spawn(group, name, module, args, env):
        started[name] = (module, list(args))
        if args[:1] == ["credentials"]:
            fed_main.main(list(args))
            return _Started(0)
        return _Started(None)

    monkeypatch.setattr(ProcessGroup, "_spawn", spawn)
    monkeypatch.setattr(runner, "wait_healthy", lambda *args, **kwargs: None)
    testbed.start()
    return started


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_credentials_enrolment_gives_the_fed_server_a_fresh_key_and_each_agent_a_credential_for_its_shards(
        tmp_path, monkeypatch):
    from device_agent.agent import parse_shards
    from shared.auth import Auth
    from shared.errors import NotAllowed

    config = RunConfig.model_validate({"algorithm": "fedavg", "data": {"num_devices": 5}})
    testbed = Testbed(config, tmp_path, agents=2, main_servers=0, enrolment="credentials")
    try:
        started = _start_without_services(testbed, monkeypatch)
        fed_args = started["fed_server"][1]
        key_file = _flag(fed_args, "--enrolment-key-file")
        assert key_file is not None and _flag(fed_args, "--enrolment-secret-file") is None
        auth = Auth(service_secret=b"s", enrolment_key=open(key_file).read().encode())
        for agent, shards, other in (("agent-0", [0, 1, 2], 3), ("agent-1", [3, 4], 0)):
            module, args = started[agent]
            assert module == "device_agent" and parse_shards(_flag(args, "--shards")) == shards
            assert _flag(args, "--prefix") == "dev"   # the ids the credential names, whatever SFL_PREFIX says
            credential = open(_flag(args, "--enrolment-secret-file")).read().strip()
            assert credential.startswith("sfl-enrol-1:")
            enrolment = auth.check_enrolment({"x-enrolment-secret": credential})
            for shard in shards:
                enrolment.check_scope(f"dev-{shard:03d}", shard)
            with pytest.raises(NotAllowed):
                enrolment.check_scope(f"dev-{other:03d}", other)
        assert {m for m, _ in started.values()} == {"fed_server", "device_agent"}
    finally:
        testbed.stop(agent_grace_s=0)
    assert not testbed.secret_files.folder.exists()


def test_secret_enrolment_stays_the_default_one_shared_secret(tmp_path, monkeypatch):
    config = RunConfig.model_validate({"algorithm": "fedavg", "data": {"num_devices": 4}})
    testbed = Testbed(config, tmp_path, agents=2, main_servers=1)
    try:
        started = _start_without_services(testbed, monkeypatch)
        secret = _flag(started["fed_server"][1], "--enrolment-secret-file")
        assert secret is not None and _flag(started["fed_server"][1], "--enrolment-key-file") is None
        assert [_flag(started[a][1], "--enrolment-secret-file") for a in ("agent-0", "agent-1")] == [secret, secret]
        main_args = started["main_server"][1]
        assert _flag(main_args, "--service-secret-file") and _flag(main_args, "--enrolment-secret-file") is None
        assert not any("credential" in name for name in started)
    finally:
        testbed.stop(agent_grace_s=0)


def test_credentials_enrolment_is_refused_for_local_data_and_unknown_modes(tmp_path):
    local = RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 2, "input_shape": [3]}})
    with pytest.raises(TestbedError, match="--enrolment credentials covers the shards of a built-in data set"):
        Testbed(local, tmp_path, device_data=["a.npz"], enrolment="credentials")
    with pytest.raises(TestbedError, match="enrolment 'keys': one of secret, credentials"):
        Testbed(RunConfig(), tmp_path, enrolment="keys")


def test_an_agents_shards_go_on_its_command_line_as_ranges_in_their_order():
    from device_agent.agent import parse_shards
    from testbed.runner import _shard_list

    for shards, text in (([0, 1, 2, 5], "0-2,5"), ([3], "3"), ([7, 8, 1], "7-8,1"), (list(range(100_000)), "0-99999")):
        assert _shard_list(shards) == text and parse_shards(text) == shards


class _Exited:
    """A child process that has exited with ``code`` (None: still running)."""

    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


def test_an_agent_that_stops_on_bad_data_ends_the_run_with_its_reason_not_its_start_up_warning(tmp_path):
    # The agent started beside the servers and said once that the Fed Server was not reachable yet;
    # seconds later it refused its data and exited. The testbed's failure used to show its whole
    # log tail, that unrelated warning among it.
    local = RunConfig.model_validate({"data": {"dataset": "local", "num_classes": 10, "input_shape": [1, 28, 28]}})
    testbed = Testbed(local, tmp_path, device_data=["bad.npz"])
    log = tmp_path / "agent-0.log"
    reason = "dev0-bad: not registered: bad.npz: field 'y' has labels 0..10, outside 0..9 (data.num_classes = 10)"
    log.write_text(
        "2026-12-05 08:48:52,289 device_agent WARNING waiting for the Fed Server at http://127.0.0.1:1: not reachable "
        "yet (ConnectError: [Errno 111] Connection refused); retrying\n"
        "2026-12-05 08:48:58,718 device_agent INFO the Fed Server at http://127.0.0.1:1 is reachable (after 6.4 s)\n"
        f"2026-12-05 08:49:04,498 device_agent ERROR {reason}\n")
    testbed.fed = Service("fed_server", _Exited(None), tmp_path / "fed.log")
    testbed.agent_services.append(Service("agent-0", _Exited(1), log, "device_agent"))
    with pytest.raises(TestbedError) as failed:
        testbed._check_services()
    assert str(failed.value).splitlines() == ["agent-0 exited with code 1:", f"2026-12-05 08:49:04,498 device_agent ERROR {reason}"]


def test_a_process_that_logged_no_error_shows_its_last_lines(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    assert Service("x", _Exited(1), log).why_it_stopped(lines=3) == "line 37\nline 38\nline 39"
