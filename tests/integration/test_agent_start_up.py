"""What a device agent says at start-up, run as ``python -m device_agent`` against real servers.

* An agent started before its Fed Server listens (the testbed starts agents beside the servers)
  logs one line while it waits, not one per try or per device, and then trains the run.
* An agent whose device the run refuses (a shard the run does not have; a shard another device
  holds, refused by the Fed Server) exits 2 with one line naming the device and the reason, and
  no traceback.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from fed_server.update_checks import shard_sizes, trained_samples
from integration_support import final_status, server_pair, small_config, wait_for
from shared.schemas import API, DeviceProfileMsg, RegisterRequest
from shared.wire import packb
from testbed.processes import ProcessGroup, free_port, service_env, wait_healthy
from testbed.warm_start import shared_starter

CONFIG = small_config(algorithm="fedavg", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200})
WAITING = "waiting for the Fed Server"


def test_an_agent_started_before_its_fed_server_says_once_that_it_waits_then_trains():
    root = Path(tempfile.mkdtemp(prefix="sfl-agent-start-up-"))
    (root / "config.yaml").write_text(yaml.safe_dump(CONFIG.model_dump(mode="json")))
    fed_port, main_port = free_port(), free_port()
    fed_url, main_url = f"http://127.0.0.1:{fed_port}", f"http://127.0.0.1:{main_port}"
    group = ProcessGroup(root / "logs", shared_starter())
    try:
        # Two devices in one agent: the wait is the agent's, said once for both.
        agent = group.start("agent", "device_agent", ["--fed-server-url", fed_url, "--shards", "0-1"])
        wait_for(lambda: WAITING in agent.log_tail(), 60, "the agent to wait for the Fed Server")
        time.sleep(3)   # several more tries (one a second at most) while nothing listens
        fed = group.start("fed_server", "fed_server", ["--config", str(root / "config.yaml"), "--run-dir",
                                                       str(root / "run"), "--main-server-url", main_url,
                                                       "--port", str(fed_port)])
        group.start("main_server", "main_server", ["--fed-server-url", fed_url, "--port", str(main_port)])
        wait_healthy(fed_url, fed, timeout=60)
        status = final_status(fed_url, 180)
        code = agent.process.wait(60)
        log = agent.log_path.read_text()
    finally:
        group.stop()
        shutil.rmtree(root, ignore_errors=True)

    assert status["state"] == "finished" and code == 0, (status, log)
    lines = log.splitlines()
    assert len([line for line in lines if WAITING in line]) == 1, log
    assert len([line for line in lines if "Connection refused" in line]) == 1, log
    assert len([line for line in lines if "WARNING" in line]) == 1, log
    assert len([line for line in lines if f"the Fed Server at {fed_url} is reachable" in line]) == 1, log
    assert len([line for line in lines if "round 1 (attempt 1) done" in line]) == 2, log


def _hold_shard_0(fed_url: str) -> None:
    """Register another device on shard 0, with the sample count its device would claim."""
    size = trained_samples(shard_sizes(CONFIG.data)[0], None)
    request = RegisterRequest(device_id="other", shard=0, num_samples=size, profile=DeviceProfileMsg(flops=1e9, rate=1e6))
    answer = httpx.post(f"{fed_url}{API}/devices/register", content=packb(request.model_dump()),
                        headers={"content-type": "application/msgpack", "accept": "application/msgpack"})
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("shard, reason", [
    ("5", "shard 5 does not exist: the run has 2 shards (0..1)"),
    ("0", "refused by the Fed Server: shard 0 is already held by device 'other'"),
])
def test_an_agent_whose_device_is_refused_exits_2_with_one_line(shard, reason):
    with server_pair(CONFIG, "agent-refused") as servers:
        if shard == "0":
            _hold_shard_0(servers.fed_url)
        done = subprocess.run([sys.executable, "-m", "device_agent", "--fed-server-url", servers.fed_url,
                               "--shards", shard], capture_output=True, text=True, timeout=120, env=service_env())
    log = done.stdout + done.stderr
    assert done.returncode == 2, log
    assert "Traceback" not in log, log
    refused = [line for line in log.splitlines() if "not registered" in line]
    assert len(refused) == 1 and f"dev-00{shard}: not registered: " in refused[0] and reason in refused[0], log
    assert [line for line in log.splitlines() if "ERROR" in line or "WARNING" in line] == refused, log
