"""A model from the user's own package (not the zoo) through the real services: trained under S2FL
and FedAvg, and a device whose copy of the package builds a different model refused at registration."""
from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from fed_server.run_dir import RunDirectory
from integration_support import server_pair, small_config, wait_for
from shared.models import build_model, model_fingerprint
from shared.schemas import RunInfo
from shared.wire import unpackb
from testbed.processes import ProcessGroup

REF = "user_models:mnist_net"
PARAMS = {"width": 4, "hidden": 24}
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@pytest.fixture
def user_package(monkeypatch):
    """The user's package on PYTHONPATH, which the testbed's children inherit (service_env)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))


def _config(algorithm: str):
    return small_config(algorithm=algorithm, model=REF, model_params=PARAMS,
                        **{"data.num_devices": 3, "data.max_samples": 600, "deadlines.min_participants": 3})


@pytest.mark.parametrize("algorithm", ["s2fl", "fedavg"])
def test_a_model_from_the_users_package_trains(algorithm, run_testbed, user_package):
    config = _config(algorithm)
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished"
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    if algorithm == "s2fl":   # the cut falls inside the user's blocks: the Main Server built them too
        assert all(0 < k < 4 for m in metrics for k in m["split_points"].values())
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(REF, 10, (1, 28, 28), seed=config.seed, params=PARAMS).state_dict()
    assert state.keys() == initial.keys()
    assert any(not (state[k] == initial[k]).all() for k in initial)


def test_a_device_whose_package_builds_another_model_is_refused(tmp_path, user_package):
    config = _config("fedavg")
    other = tmp_path / "other_version"
    other.mkdir()
    source = (HERE / "user_models.py").read_text()
    (other / "user_models.py").write_text(source.replace("2 * width", "3 * width"))   # another version of the package
    with server_pair(config, "own-model", main_args=["--model", REF]) as servers:
        run = RunInfo.model_validate(unpackb(httpx.get(f"{servers.fed_url}/v1/run").content))
        assert run.fingerprint == model_fingerprint(build_model(REF, 10, (1, 28, 28), params=PARAMS), config.data)
        assert run.model_params == PARAMS
        agents = ProcessGroup(tmp_path / "logs")
        try:
            common = ["--fed-server-url", servers.fed_url, "--shards", "0"]
            refused = agents.start("refused", "device_agent", [*common, "--model", REF],
                                   env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(other)])})
            unnamed = agents.start("unnamed", "device_agent", [*common, "--prefix", "plain"])
            wait_for(lambda: not refused.alive() and not unnamed.alive(), 120, "both agents to stop")
            assert refused.process.returncode == 1 and unnamed.process.returncode == 1
            log = refused.log_path.read_text()
            assert "409" in log or "Conflict" in log
            assert "the device's model differs from the run's" in log
            assert "parameter blocks.conv2.0.weight: float32 [12, 4, 3, 3] on the device, float32 [8, 4, 3, 3] in the run" in log
            assert "start this process with --model user_models:mnist_net" in unnamed.log_path.read_text()
            status = httpx.get(f"{servers.fed_url}/v1/status").json()
            assert status["registered"] == 0
        finally:
            agents.stop()
