"""A model from the user's own package (not the zoo) through the real services: trained under S2FL
and FedAvg by devices that read their own ``.npz`` files (S2FL with federated evaluation, FedAvg
with the server's test file), a BatchNorm model under FedAvg whose device's last batch would hold
one sample, and a device whose copy of the package builds a different model refused at
registration."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fed_server.run_dir import RunDirectory
from fed_server.update_checks import shard_sizes
from integration_support import read_metrics, server_pair, small_config, wait_for, write_raw_mnist
from shared.data.datasets import MNIST_MEAN, MNIST_STD
from shared.models import build_model, model_fingerprint
from shared.models.export import load_trained
from shared.schemas import RunInfo
from shared.wire import unpackb
from testbed.processes import ProcessGroup
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

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
def test_a_model_from_the_users_package_trains_on_the_devices_own_files(algorithm, tmp_path, user_package):
    paths = [str(write_raw_mnist(tmp_path / f"site{i}.npz", "train", slice(200 * i, 200 * (i + 1)))) for i in range(3)]
    data = {"dataset": "local", "num_devices": 3, "num_classes": 10, "input_shape": [1, 28, 28],
            "input_transform": {"scale": 1 / 255, "mean": [MNIST_MEAN], "std": [MNIST_STD]}}
    if algorithm == "fedavg":   # the server evaluates on its own file; S2FL's devices evaluate (federated)
        data["test_file"] = str(write_raw_mnist(tmp_path / "test.npz", "test", slice(0, 300)))
    config = small_config(algorithm=algorithm, model=REF, model_params=PARAMS, data=data,
                          **{"deadlines.min_participants": 3})
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, device_data=paths, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished" and status["registered"] == 3
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    if algorithm == "s2fl":   # federated evaluation: every device evaluated its held-out fifth
        assert [m["evaluated_devices"] for m in metrics] == [3, 3]
        assert all(m["evaluated_samples"] == 3 * 40 and 0 <= m["test_accuracy"] <= 1 for m in metrics)
    else:
        assert metrics[-1]["evaluated_devices"] is None and metrics[-1]["test_accuracy"] is not None
    if algorithm == "s2fl":   # the cut falls inside the user's blocks: the Main Server built them too
        assert all(0 < k < 4 for m in metrics for k in m["split_points"].values())
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(REF, 10, (1, 28, 28), seed=config.seed, params=PARAMS).state_dict()
    assert state.keys() == initial.keys()
    assert any(not (state[k] == initial[k]).all() for k in initial)
    _check_export(run_dir, tmp_path / "export", state,
                  (tmp_path / "test.npz", metrics[-1]["test_accuracy"]) if algorithm == "fedavg" else None)


def _check_export(run_dir: Path, out: Path, state: dict, test: tuple[Path, float] | None) -> None:
    """``python -m fed_server export``, then the files loaded with plain PyTorch into the user's own
    ``nn.Sequential`` (built by calling their function, not through this project); with a test file,
    that model's accuracy on it is the one the Fed Server recorded for the last round."""
    done = subprocess.run([sys.executable, "-m", "fed_server", "export", str(run_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(HERE)})
    assert done.returncode == 0, done.stderr
    assert f"pt           {out / 'model.pt'}" in done.stdout and "safetensors  " in done.stdout, done.stdout
    from user_models import mnist_net

    for weights in (torch.load(out / "model.pt", weights_only=True), load_file(str(out / "model.safetensors"))):
        net = mnist_net(10, (1, 28, 28), **PARAMS)
        net.load_state_dict(weights)   # strict: exactly the user's own key names
        assert all(torch.equal(v, state[f"blocks.{k}"]) for k, v in net.state_dict().items())
    scripted = torch.jit.load(str(out / "model.torchscript.pt"))
    loaded = load_trained(out)
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        assert torch.allclose(scripted(x), loaded(x), atol=1e-6)
    if test is not None:
        path, recorded = test
        with np.load(path) as data:
            x = torch.tensor(data["x"], dtype=torch.float32).reshape(-1, 1, 28, 28) * (1 / 255)
            y = torch.tensor(data["y"], dtype=torch.int64)
        net.eval()
        with torch.no_grad():
            correct = (net((x - MNIST_MEAN) / MNIST_STD).argmax(1) == y).sum().item()
        assert correct / len(y) == pytest.approx(recorded, abs=1.5 / len(y)), (correct, len(y), recorded)


@pytest.mark.parametrize("algorithm,model", [("fedavg", "batchnorm_model:net"), ("sfl", "batchnorm_model:device_net"),
                                             ("sfl", "batchnorm_model:net")])
def test_a_device_whose_last_batch_holds_one_sample_keeps_training_a_batchnorm_layer(algorithm, model, tmp_path,
                                                                                       user_package):
    # A BatchNorm1d layer trains on a device's batch: under FedAvg in the whole model, under SFL in
    # the device's portion (the cut after block 3) or on the Main Server (after the cut: SFL's
    # groups of one send each device's batch alone through it). 101 = 4 x 25 + 1 samples used to end every
    # round in a step PyTorch refuses, and the device was dropped every round while the run
    # reported success. Now that lone sample sits out its epoch (in split mode the device tells the
    # Main Server one step fewer) and both devices are aggregated.
    config = small_config(algorithm=algorithm, model=model, **{
        "data.num_devices": 2, "data.partition": "iid", "data.max_samples": 201, "train.batch_size": 25,
        "grouping.group_size": 2, "deadlines.min_participants": 1})
    assert [n % 25 for n in shard_sizes(config.data)] == [1, 0]
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    metrics = read_metrics(run_dir)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok", "ok"], metrics
    assert [(sorted(m["aggregated"]), m["dropped"], m["left"]) for m in metrics] == [(["dev-000", "dev-001"], [], {})] * 2
    assert status["summary"]["dropped_every_round"] == {}


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
        agents = ProcessGroup(tmp_path / "logs", shared_starter())
        try:
            common = ["--fed-server-url", servers.fed_url, "--shards", "0"]
            refused = agents.start("refused", "device_agent", [*common, "--model", REF],
                                   env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(other)])})
            unnamed = agents.start("unnamed", "device_agent", [*common, "--prefix", "plain"])
            wait_for(lambda: not refused.alive() and not unnamed.alive(), 120, "both agents to stop")
            # The agent without --model refuses the run at start, before any device registers; the other's
            # device is refused at registration. Both are configuration problems: exit 2.
            assert refused.process.returncode == 2 and unnamed.process.returncode == 2
            log = refused.log_path.read_text()
            assert "dev-000: not registered: refused by the Fed Server: " in log
            assert "the device's model or data pipeline differs from the run's" in log
            assert "parameter blocks.conv2.0.weight: float32 [12, 4, 3, 3] on the device, float32 [8, 4, 3, 3] in the run" in log
            assert "start this process with --model user_models:mnist_net" in unnamed.log_path.read_text()
            status = httpx.get(f"{servers.fed_url}/v1/status").json()
            assert status["registered"] == 0
        finally:
            agents.stop()
