"""The testbed launcher's configuration check, run in a short-lived child process.

Checking a run configuration completely builds the model and the algorithm (``shared.run_config``),
so it imports torch: anonymous memory that a process keeps once it has it. The launcher itself
only starts processes and follows the run, so it hands the check to ``python -m
testbed.config_check`` (request as JSON on stdin, :class:`CheckResult` as JSON on stdout) and
keeps nothing of torch (what that saves in benchmark (f)'s testbed:
benchmarks/results/2026-11-24_torch-free-launcher/). A bad configuration still fails before any
service starts, with the same ``config error:`` lines (status 2) as the Fed Server's own check.
"""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Literal

from pydantic import BaseModel

from shared.config import RunConfig
from testbed.processes import service_env


class CheckRequest(BaseModel):
    """What the launcher's command line says about the configuration."""

    config_file: str | None = None
    overrides: list[str] = []
    #: ``--device-data`` paths; their devices set ``data.num_devices`` unless ``count_given``.
    device_data: list[str] = []
    count_given: bool = False
    torch_device: str | None = None


class CheckResult(BaseModel):
    """The fully checked configuration (``config``; read back by the launcher against the schema
    only, the child having checked the rest), the algorithm's split mode and the
    resolved ``--torch-device`` (``auto`` resolved once, here) and ``warnings``; or ``usage_error``, the message of a
    bad flag (an unavailable torch device, a missing ``--device-data`` path)."""

    config: RunConfig | None = None
    split_mode: Literal["zero", "fixed", "sliding"] | None = None
    torch_device: str | None = None
    usage_error: str | None = None
    #: Lines the launcher prints before the run starts (:func:`shared.run_config.run_warnings`), as
    #: the Fed Server logs them.
    warnings: list[str] = []


class CheckFailed(RuntimeError):
    """The check process itself failed (not a configuration problem); the message has its stderr."""


def check(request: CheckRequest) -> CheckResult:
    """The child's side: resolve and check the configuration as the Fed Server will. A bad
    configuration exits with status 2 and ``config error:`` lines on stderr."""
    import argparse

    from shared.algorithms.registry import build_algorithm
    from shared.run_config import ConfigError, build_config_model, exit_on_config_error, resolve_run_config, run_warnings
    from shared.torch_device import torch_device_flag

    torch_device = None
    if request.torch_device is not None:
        try:
            torch_device = str(torch_device_flag(request.torch_device))
        except argparse.ArgumentTypeError as exc:
            return CheckResult(usage_error=f"argument --torch-device: {exc}")
    overrides = list(request.overrides)
    try:
        if request.device_data and not request.count_given:
            from shared.data.local import data_sources

            count = sum(len(data_sources(path)) for path in request.device_data)
            overrides = [f"data.num_devices={count}", *overrides]
        config = resolve_run_config(request.config_file, overrides)
    except ConfigError as exc:
        exit_on_config_error(exc)
    except ValueError as exc:  # a --device-data path that is missing or ambiguous
        return CheckResult(usage_error=str(exc))
    return CheckResult(config=config, split_mode=build_algorithm(config).split_mode(),
                       torch_device=torch_device, warnings=run_warnings(config, build_config_model(config)))


def check_in_child(request: CheckRequest) -> CheckResult:
    """The launcher's side: run :func:`check` in ``python -m testbed.config_check``. A bad configuration's lines go to stderr and the launcher
    exits with status 2; ``result.usage_error`` is the caller's to report."""
    # The child sees the launcher's whole environment: SFL_RUN__* variables apply to the config
    # (service_env leaves them out for the services, which get the resolved file instead).
    env = {**os.environ, "PYTHONPATH": service_env()["PYTHONPATH"], "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-m", "testbed.config_check"], input=request.model_dump_json(),
                          capture_output=True, text=True, env=env)
    if done.returncode == 2:   # config error: lines, as the Fed Server prints them
        sys.stderr.write(done.stderr)
        sys.exit(2)
    if done.returncode != 0:
        raise CheckFailed(f"checking the configuration failed (exit {done.returncode}):\n{done.stderr}")
    return CheckResult.model_validate_json(done.stdout)


def main() -> None:
    """``python -m testbed.config_check``: a :class:`CheckRequest` on stdin, a :class:`CheckResult` on stdout."""
    result = check(CheckRequest.model_validate_json(sys.stdin.read()))
    sys.stdout.write(result.model_dump_json())


if __name__ == "__main__":
    main()
