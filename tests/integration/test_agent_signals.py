"""A device agent stops cleanly on SIGTERM (``docker stop``, the end of a Kubernetes pod): its
devices stop and it exits 0 at once, instead of being killed at the end of the grace period."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from integration_support import server_pair, small_config
from testbed.processes import service_env


def test_device_agent_exits_cleanly_on_sigterm():
    # A Fed Server nobody listens on: the agent is up and retrying, the state it is in while it
    # waits for a server; SIGTERM must stop it there like Ctrl-C does.
    process = subprocess.Popen(
        [sys.executable, "-m", "device_agent", "--fed-server-url", "http://127.0.0.1:9", "--shards", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env())
    try:
        assert process.stdout is not None
        for line in process.stdout:   # wait until it is running (its first failed call), no sleep
            if "Connection refused" in line:
                break
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=30)
        stopped_after = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # Without a handler, SIGTERM kills the process: return code -15.
    assert process.returncode == 0
    assert stopped_after < 10


def test_an_agent_setting_up_many_devices_stops_within_two_seconds_on_sigterm():
    # 400 devices of a real run, signalled while they set up (some registered, most not yet):
    # the agent must stop within 2 s, however many of its devices are busy.
    config = small_config(algorithm="fedavg", model="logreg", **{"data.dataset": "synthetic", "data.partition": "natural",
                                                 "data.num_devices": 400, "data.max_samples": None,
                                                 "devices.profiles": []})
    with server_pair(config, "agent-sigterm") as servers:
        process = subprocess.Popen(
            [sys.executable, "-m", "device_agent", "--fed-server-url", servers.fed_url, "--shards", "0-399"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=service_env())
        try:
            assert process.stdout is not None
            registered = 0
            for line in process.stdout:   # wait until set-up is under way: a few devices registered
                registered += ": registered shard " in line
                if registered == 5:
                    break
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            rest, _ = process.communicate(timeout=30)
            stopped_after = time.monotonic() - sent
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert registered == 5 and process.returncode == 0, rest[-3000:]
    assert stopped_after < 2, (stopped_after, rest[-3000:])
    assert "registered shard 399 " not in rest   # it was stopped during set-up, not after
