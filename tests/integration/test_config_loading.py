"""A bad run configuration fails when it is read by the real command-line entry points.

``shared/config.py`` is only the schema; the checks that need the algorithm registry, the model zoo
and the device transforms live in ``shared/run_config.py``. These tests start the actual
``python -m fed_server`` and ``python -m testbed`` processes with configurations only that second
layer can refuse, with a wrong field and with a missing file, and check that each exits at once
(status 2) with one ``config error:`` line per problem and no traceback, before it creates a run
directory. The same holds for a ``--torch-device`` the machine does not have, for every service.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from testbed.processes import service_env

ROOT = Path(__file__).resolve().parents[2]
FNR_FL = ["--set", "algorithm=fnr-fl", "--set", "data.public_samples=100"]


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=service_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("module", ["fed_server", "testbed"])
@pytest.mark.parametrize("overrides, message", [
    (["--set", "algorithm=nope"], "unknown algorithm 'nope'; choose one of"),
    ([*FNR_FL, "--set", "algorithm_params.p=1.5"], "algorithm_params.p: must be less than or equal to 1 (got 1.5)"),
    (["--set", "data.device_transform=nope"], "unknown device_transform 'nope'"),
    (["--set", "model=logreg"], "model 'logreg' has no meaningful cut"),
])
def test_bad_config_is_refused_before_anything_starts(tmp_path, module, overrides, message):
    run_dir = tmp_path / "run"
    result = _run(module, "--run-dir", str(run_dir), *overrides)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("config error: ") and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("module", ["fed_server", "testbed"])
def test_wrong_fields_and_a_missing_file_are_one_line_each(tmp_path, module):
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  lr: -1\n  lrr: 0.1\nrounds: 2\n")
    result = _run(module, "--run-dir", str(run_dir), "--config", str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "config error: train.lr: must be greater than 0 (got -1)",
        "config error: train.lrr: unknown key in train (valid keys: lr, momentum, weight_decay, batch_size, "
        "local_epochs, loss, task, dp_sgd)"], result.stderr

    missing = tmp_path / "missing.yaml"
    result = _run(module, "--run-dir", str(run_dir), "--config", str(missing))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [f"config error: {missing}: file not found"], result.stderr
    assert not run_dir.exists()


def test_a_good_config_gets_past_loading(tmp_path):
    # The control: the same valid FNR-FL configuration is accepted, and the Fed Server stops at the
    # next check it makes (an empty secret file), which names that problem instead.
    secret = tmp_path / "secret"
    secret.write_text("")
    result = _run("fed_server", "--run-dir", str(tmp_path / "run"), *FNR_FL, "--service-secret-file", str(secret))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "python -m fed_server: error: secret file" in result.stderr and "empty" in result.stderr, result.stderr


def _unavailable_cuda() -> tuple[str, str]:
    """A CUDA device this machine lacks, and the start of the resolver's reason for it."""
    import torch

    if not torch.cuda.is_available():
        return "cuda", "torch device 'cuda' is not available: torch"
    name = f"cuda:{torch.cuda.device_count()}"
    return name, f"torch device '{name}' does not exist"


@pytest.mark.parametrize("module", ["fed_server", "main_server", "device_agent", "testbed"])
def test_an_unavailable_torch_device_is_refused_at_start(tmp_path, module):
    # --torch-device is checked while the flags are parsed (the testbed's, by its configuration
    # check's child): the service exits with a usage error saying why, before it loads data, binds
    # a port or contacts anyone.
    name, reason = _unavailable_cuda()
    run_dir = ["--run-dir", str(tmp_path / "run")] if module in ("fed_server", "testbed") else []
    result = _run(module, "--torch-device", name, *run_dir)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"python -m {module}: error: argument --torch-device: {reason}" in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()
