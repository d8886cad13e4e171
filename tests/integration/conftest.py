"""Helpers for tests that start the real services as separate processes on loopback."""
from __future__ import annotations

import pytest

from integration_support import read_metrics
from shared.config import RunConfig
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


@pytest.fixture
def run_testbed(tmp_path):
    """Run a config to completion on a real testbed, its processes forked from the shared warm starter;
    returns (final status, metrics, run dir)."""

    def run(config: RunConfig, agents: int = 1, timeout: float = 240.0, during=None, torch_device: str | None = None,
            main_servers: int | None = None, name: str = ""):
        """``name``: a suffix of the run directory, for a test that runs the same algorithm twice."""
        run_dir = tmp_path / (f"run-{config.algorithm}" + (f"-{main_servers}-main-servers" if main_servers and main_servers > 1 else "")
                              + (f"-{name}" if name else ""))
        with Testbed(config, run_dir, agents=agents, torch_device=torch_device, main_servers=main_servers,
                     warm=shared_starter()) as testbed:
            if during is not None:
                during(testbed)
            status = testbed.follow(timeout=timeout)
        return status, read_metrics(run_dir), run_dir

    return run
