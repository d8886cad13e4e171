"""The warm starter forks real children that behave as ``python -m module`` started afresh."""
from __future__ import annotations

import signal
import subprocess
import textwrap
import time

import pytest

from testbed.processes import ProcessGroup, service_env
from testbed.warm_start import WarmProcess, WarmStarter

CHILD = textwrap.dedent("""
    import os, sys, threading, time
    mode = sys.argv[1]
    print("argv", sys.argv[1:], "name", __name__, "cwd", os.getcwd(), flush=True)
    print("env", os.environ.get("WARM_TEST_VALUE"), "session leader", os.getsid(0) == os.getpid(), flush=True)
    print("stdin", repr(sys.stdin.read()), flush=True)
    if mode == "thread":   # a non-daemon thread runs to its end before the process exits
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    elif mode == "raise":
        raise RuntimeError("boom")
    elif mode == "message":
        sys.exit("a one-line reason")
    elif mode == "sleep":
        time.sleep(60)
    elif mode.isdigit():
        sys.exit(int(mode))
""")


@pytest.fixture(scope="module")
def starter():
    warm = WarmStarter(preload=())   # nothing heavy: what is checked here is the forking
    yield warm
    warm.close()


@pytest.fixture
def package(tmp_path):
    """A module importable only from ``tmp_path``, the children's working directory."""
    (tmp_path / "warm_child.py").write_text(CHILD)
    return tmp_path


def _start(starter, package, *args, **env):
    log = package / "child.log"
    child = starter.start("warm_child", list(args), service_env({"WARM_TEST_VALUE": "set", **env}), log,
                          cwd=str(package))
    return child, log


def test_a_child_runs_the_module_as_main_in_its_own_session_with_its_env_cwd_and_log(starter, package):
    child, log = _start(starter, package, "7")
    assert child.wait(30) == 7 and child.poll() == 7
    out = log.read_text()
    assert f"argv ['7'] name __main__ cwd {package}" in out
    assert "env set session leader True" in out
    assert "stdin ''" in out   # not the warm process's request pipe


def test_exit_status_is_what_a_fresh_interpreter_gives(starter, package):
    child, log = _start(starter, package, "raise")
    assert child.wait(30) == 1
    assert "RuntimeError: boom" in log.read_text()
    child, log = _start(starter, package, "message")
    assert child.wait(30) == 1
    assert "a one-line reason" in log.read_text()
    child, log = _start(starter, package, "thread")
    assert child.wait(30) == 0
    assert "thread done" in log.read_text()


def test_a_killed_child_reports_the_signal_and_wait_times_out_while_it_runs(starter, package):
    child, _ = _start(starter, package, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.kill()   # a second kill of an ended child is a no-op, as with Popen


def test_a_signal_to_a_child_reaped_before_its_end_was_read_is_a_no_op():
    # Between the warm process's waitpid and the launcher reading the report, the pid is gone but
    # returncode is still None. Signal 0 only asks whether the pid exists (nothing is killed if it
    # has been reused).
    ended = subprocess.Popen(["true"])
    ended.wait()
    WarmProcess(ended.pid).send_signal(0)


def test_a_process_group_restarts_and_stops_forked_children(starter, package, monkeypatch):
    monkeypatch.chdir(package)   # the group's children start in the launcher's working directory
    group = ProcessGroup(package / "logs", starter)
    log = package / "logs" / "svc.log"
    service = group.start("svc", "warm_child", ["sleep"])
    assert log.exists()
    first = service.process.pid
    _wait_for_lines(log, 1)
    group.restart(service)
    _wait_for_lines(log, 2)
    assert service.process.pid != first and service.alive()
    t = time.monotonic()
    group.stop(timeout=10)
    assert not service.alive() and service.process.returncode == -signal.SIGTERM
    assert time.monotonic() - t < 10
    assert log.read_text().count("argv ['sleep']") == 2


def _wait_for_lines(log, count: int) -> None:
    deadline = time.monotonic() + 30
    while log.read_text().count("argv ['sleep']") < count:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def test_two_children_get_different_numpy_streams(starter, package):
    (package / "draw.py").write_text("import numpy; print(numpy.random.randint(1 << 30))\n")
    draws = []
    for i in range(2):
        log = package / f"draw{i}.log"
        assert starter.start("draw", [], service_env(), log, cwd=str(package)).wait(30) == 0
        draws.append(log.read_text())
    assert draws[0] != draws[1]


def test_closing_the_starter_kills_what_it_still_runs_and_refuses_more(package):
    warm = WarmStarter(preload=())
    left, _ = _start(warm, package, "sleep")
    warm.close()
    assert left.wait(30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while _running(left.pid):   # gone, not merely reported gone
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="not running"):
        warm.start("warm_child", ["0"], service_env(), package / "x.log", cwd=str(package))


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie that its new parent has not reaped yet does not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
