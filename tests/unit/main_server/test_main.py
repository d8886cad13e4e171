"""``python -m main_server`` says at start when it runs without a service secret, as the Fed Server
does."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from testbed.processes import free_port, service_env

ROOT = Path(__file__).resolve().parents[3]


def _lines_until_running(*args: str) -> list[str]:
    """Start the Main Server, collect its log lines until uvicorn says it is serving, stop it."""
    env = {k: v for k, v in service_env().items() if k != "SFL_SERVICE_SECRET"}
    process = subprocess.Popen([sys.executable, "-m", "main_server", "--host", "127.0.0.1", "--port",
                                str(free_port()), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines = []
    guard = threading.Timer(120, process.kill)   # a server that neither serves nor dies fails the test
    guard.start()
    try:
        for line in process.stdout:   # ends when the process dies
            lines.append(line.rstrip())
            if "Uvicorn running on" in line:
                break
    finally:
        guard.cancel()
        process.terminate()
        process.wait(timeout=60)
    assert lines and "Uvicorn running on" in lines[-1], lines
    return lines


def test_an_open_main_server_warns_at_start():
    # The function that decides (shared.auth.warn_if_open) is tested with and without a secret in
    # tests/unit/shared/test_auth.py; this checks that the Main Server's start calls it.
    warnings = [line for line in _lines_until_running() if "no service secret" in line]
    assert len(warnings) == 1 and " main_server WARNING " in warnings[0], warnings
    assert "anyone who can reach this server can open rounds, join them and send activations" in warnings[0]
    assert "SFL_SERVICE_SECRET" in warnings[0]


def test_train_workers_below_one_is_a_usage_error():
    from main_server.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["--train-workers", "0"])
    assert stopped.value.code == 2
