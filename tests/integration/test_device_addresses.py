"""Devices outside a cluster reach a Main Server replica at another address than the Fed Server
does (``--main-server-public-url``): the Fed Server plans rounds on the address it was given, and
tells the devices theirs, with real servers and an agent.

The devices' address is a TCP proxy in front of the Main Server (as a per-pod LoadBalancer would
be): every join and step goes through it, and no plan does.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import httpx

from integration_support import RecordingProxy, final_status, server_pair, small_config
from testbed.processes import ProcessGroup
from testbed.warm_start import shared_starter

CONFIG = small_config(rounds=1, **{"data.num_devices": 2, "data.max_samples": 200, "grouping.group_size": 2})


def test_devices_are_told_the_replicas_address_for_devices_and_the_fed_server_plans_on_its_own():
    outside = RecordingProxy()
    root = Path(tempfile.mkdtemp(prefix="sfl-addresses-"))
    try:
        with server_pair(CONFIG, "addresses", fed_args=["--main-server-public-url", outside.url]) as pair:
            outside.target_port = httpx.URL(pair.main_url).port
            agents = ProcessGroup(root / "logs", shared_starter())
            try:
                agents.start("agent", "device_agent", ["--fed-server-url", pair.fed_url, "--shards", "0-1",
                                                       "--kinds", "high"])
                status = final_status(pair.fed_url, 240)
            finally:
                agents.stop()
        assert status["state"] == "finished" and [r["status"] for r in status["history"]] == ["ok"], status
        lines = [r.split(b"\r\n", 1)[0].decode() for r in outside.requests()]
        assert any(line.startswith("POST /v1/rounds/1/join ") for line in lines), lines
        assert any(line.startswith("POST /v1/rounds/1/step ") for line in lines), lines
        assert not any(line.startswith(("POST /v1/rounds ", "GET /v1/rounds/1/watch")) for line in lines), lines
    finally:
        outside.close()
        shutil.rmtree(root, ignore_errors=True)
