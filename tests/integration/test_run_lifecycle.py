"""The run lifecycle of a Fed Server kept under a supervisor (``--runs-root``), with real processes.

The Fed Server is started again and again with the same flags, as ``docker compose up`` or a
Kubernetes pod restart does:

* after a finished run, a start begins a new run in a directory of its own; an agent started
  while the Fed Server still serves the finished run waits for the next one and joins it;
* a Fed Server killed mid-run is started again with the same flags and resumes the same run;
* a start with a configuration other than the unfinished run's refuses with one line that says
  what to do, and with ``--wait-on-refusal`` stays up (no restart loop) serving that line as 503;
  ``--new-run`` then begins a new run and leaves the unfinished one as it was.
"""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fed_server.recorder import FAULT_PAUSE_ENV
from integration_support import final_status, read_metrics, small_config, wait_for
from testbed.processes import ProcessGroup, Service, free_port, service_env, wait_healthy
from testbed.warm_start import shared_starter

# Whole models on the devices (no Main Server), small: a round takes about a second. The Fed
# Server pauses before each checkpoint, so the test can kill it between a round's record and its
# checkpoint: the run then resumes after the round before.
CONFIG = small_config(algorithm="fedavg", rounds=3, **{"data.num_devices": 2, "data.max_samples": 200})
PAUSE_S = "2"


class Site:
    """A runs folder, a Fed Server port and the processes started on them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.runs = root / "runs"
        self.config = root / "config.yaml"
        self.config.write_text(yaml.safe_dump(CONFIG.model_dump(mode="json")))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.group = ProcessGroup(root / "logs", shared_starter())
        self.fed: Service | None = None

    def fed_args(self, *extra: str) -> list[str]:
        return ["--config", str(self.config), "--runs-root", str(self.runs), "--port", str(self.port),
                "--main-server-url", "http://127.0.0.1:9", *extra]

    def start_fed(self, *extra: str) -> Service:
        self.fed = self.group.start("fed_server", "fed_server", self.fed_args(*extra),
                                    env={FAULT_PAUSE_ENV["checkpoint"]: PAUSE_S})
        wait_healthy(self.url, self.fed, timeout=120)
        return self.fed

    def start_agent(self, name: str) -> Service:
        return self.group.start(name, "device_agent", ["--fed-server-url", self.url, "--shards", "0-1"])

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/status", timeout=10).json()

    def fed_log(self) -> str:
        assert self.fed is not None
        return self.fed.log_path.read_text()


@pytest.fixture
def site() -> Iterator[Site]:
    # Its own folder, not pytest's: pytest prunes old basetemp folders, which a concurrent run could
    # do while these processes still write to it.
    site = Site(Path(tempfile.mkdtemp(prefix="sfl-lifecycle-")))
    try:
        yield site
    finally:
        site.group.stop()
        shutil.rmtree(site.root, ignore_errors=True)


def _summary(site: Site, run_id: str) -> dict:
    return json.loads((site.runs / run_id / "summary.json").read_text())


def test_a_start_after_a_finished_run_begins_a_new_one_and_a_crash_mid_run_resumes_it(site):
    fed = site.start_fed()
    first = site.start_agent("agent-1")
    status = final_status(site.url, 240)
    assert status["state"] == "finished", status
    run_a = status["run_id"]
    assert first.process.wait(60) == 0, first.log_tail()
    assert (site.runs / "current").read_text().strip() == run_a
    assert f"new run {run_a} (in {site.runs / run_a})" in site.fed_log()

    # Still serving the finished run: an agent started now waits for the next one.
    waiting = site.start_agent("agent-2")
    wait_for(lambda: f"run {run_a} of the Fed Server" in waiting.log_tail(), 120, "the agent to wait for the next run")
    assert "is over: waiting for its next run" in waiting.log_tail()

    # The same flags again: a new run, in a directory of its own, which the waiting agent joins.
    site.group.restart(fed, signal.SIGTERM)
    wait_healthy(site.url, fed, timeout=120)
    run_b = site.status()["run_id"]
    assert run_b != run_a and (site.runs / run_b).is_dir()
    assert f"new run {run_b}: the last run, {run_a}, is over" in site.fed_log()
    # Killed mid-run (between round 2's record and its checkpoint), started again: the same run resumes.
    wait_for(lambda: site.fed_log().count("attempt 2 pausing") == 2, 240, "round 2 of the new run to be recorded")
    site.group.restart(fed, signal.SIGKILL)
    wait_healthy(site.url, fed, timeout=120)
    assert f"resuming run {run_b}: it is unfinished" in site.fed_log()
    status = final_status(site.url, 240)
    assert status["run_id"] == run_b and status["state"] == "finished", status
    assert status["resumed_after_round"] == 1, status
    assert waiting.process.wait(60) == 0, waiting.log_tail()
    assert [m["round"] for m in read_metrics(site.runs / run_b) if m["status"] == "ok"] == [1, 2, 3]
    assert _summary(site, run_a)["finished"] and _summary(site, run_b)["finished"]
    assert sorted(p.name for p in site.runs.iterdir() if p.is_dir()) == sorted([run_a, run_b])
    # The agent that joined the second run says what it did, not how many rounds the run had.
    assert "run finished; this device trained" in waiting.log_tail(60)


def test_a_changed_configuration_against_an_unfinished_run_is_one_line_and_no_restart_loop(site):
    fed = site.start_fed()
    site.start_agent("agent")
    wait_for(lambda: "attempt 2 pausing" in site.fed_log(), 240, "round 2 to be recorded")
    fed.process.send_signal(signal.SIGKILL)
    fed.process.wait()
    run_a = (site.runs / "current").read_text().strip()
    changed = ["--set", "train.lr=0.2"]

    # Without --wait-on-refusal: exit 2, one line saying what to do.
    done = subprocess.run([sys.executable, "-m", "fed_server", *site.fed_args(*changed)], env=service_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"run {run_a} in {site.runs / run_a} is unfinished" in errors[0]
    assert "train.lr differ" in errors[0] and "--new-run (SFL_NEW_RUN=1)" in errors[0], errors[0]

    # With it (what compose and Kubernetes run): the process stays up, alive but not ready, and says why.
    held = site.group.start("held", "fed_server", [*site.fed_args(*changed), "--wait-on-refusal"])
    wait_for(lambda: _answers(site.url + "/livez") == 200, 120, "the refusing Fed Server to serve")
    health = httpx.get(f"{site.url}/healthz", timeout=10)
    assert health.status_code == 503 and "train.lr differ" in health.json()["detail"], health.text
    run = httpx.get(f"{site.url}/v1/run", timeout=10)
    assert run.status_code == 503 and "--new-run" in run.json()["detail"], run.text
    assert held.alive() and held.log_tail().count("not starting: run") == 1, held.log_tail()
    held.process.send_signal(signal.SIGTERM)   # it stops like a working server (uvicorn ends by the signal)
    assert held.process.wait(30) in (0, -signal.SIGTERM)
    assert (site.runs / "current").read_text().strip() == run_a   # nothing changed

    # --new-run: a new run under the new configuration; the unfinished one stays as it was.
    checkpoint = (site.runs / run_a / "checkpoint.msgpack").read_bytes()
    fed = site.group.start("fed_server-new", "fed_server", site.fed_args(*changed, "--new-run"))
    wait_healthy(site.url, fed, timeout=120)
    run_b = site.status()["run_id"]
    assert run_b != run_a
    assert f"new run {run_b} (--new-run); the unfinished run {run_a} stays in" in fed.log_path.read_text()
    assert (site.runs / run_a / "checkpoint.msgpack").read_bytes() == checkpoint
    assert not (site.runs / run_a / "summary.json").exists()


def _answers(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=5).status_code
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("module", ["fed_server", "main_server"])
def test_a_server_that_cannot_read_its_secret_waits_and_says_why_instead_of_exiting(site, module):
    missing = site.root / "no-such-secret"
    args = ["--port", str(site.port), "--service-secret-file", str(missing), "--wait-on-refusal"]
    if module == "fed_server":
        args += ["--config", str(site.config), "--runs-root", str(site.runs)]
    server = site.group.start(module, module, args)
    wait_for(lambda: _answers(site.url + "/livez") == 200, 120, f"the refusing {module} to serve")
    health = httpx.get(f"{site.url}/healthz", timeout=10)
    assert health.status_code == 503, health.text
    assert health.json()["detail"] == f"secret file {missing}: No such file or directory"
    assert server.alive() and "Traceback" not in server.log_tail()
