"""A device agent stops cleanly on SIGTERM (``docker stop``, the end of a Kubernetes pod): its
devices stop and it exits 0 at once, instead of being killed at the end of the grace period."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

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
