"""Devices that bring their own data (dataset "local") through the real services.

Three device agents each read their own raw ``.npz`` (uint8 MNIST digits written from the embedded
subset), register without a shard, and train FedAvg with the run's input transform; the Fed Server
evaluates on ``data.test_file``. A device whose file is bad stops before registering, with the message.
An agent hosting a good image folder and one whose class folder loops trains the good one alone.

Tabular devices: two read ``.csv`` files, a third a data function given its file by the testbed's
``--data-arg``; FedAvg trains logistic regression on them.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from integration_support import read_metrics, small_config, wait_for, write_raw_mnist
from shared.data.datasets import MNIST_MEAN, MNIST_STD
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


# S2FL on device files, with a user's model and federated evaluation: test_own_model.py.
def test_device_files_train_and_a_bad_device_stops_before_registering(tmp_path):
    paths = [str(write_raw_mnist(tmp_path / f"site{i}.npz", "train", slice(200 * i, 200 * (i + 1)))) for i in range(3)]
    test_file = write_raw_mnist(tmp_path / "test.npz", "test", slice(0, 300))
    config = small_config(algorithm="fedavg", **{"train.batch_size": 20}, data={
        "dataset": "local", "num_devices": 3, "num_classes": 10, "input_shape": [1, 28, 28], "test_file": str(test_file),
        "input_transform": {"scale": 1 / 255, "mean": [MNIST_MEAN], "std": [MNIST_STD]}})
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((4, 28, 28), dtype=np.uint8), y=np.array([0, 1, 2, 10]))
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, device_data=paths, warm=shared_starter()) as testbed:
        # A fourth device with a bad file, started with the run (an agent that finds a run over
        # waits for the next one instead): it fetches the spec, checks its data and stops without
        # registering, while the three others train.
        agent = testbed.start_agent("agent-bad", data=str(bad), index=3)
        wait_for(lambda: not agent.alive(), 120, "the agent with bad data to exit")
        assert agent.process.returncode == 2
        assert f"dev3-bad: not registered: {bad}: field 'y' has labels 0..10, outside 0..9" in agent.log_tail()
        status = testbed.follow(timeout=240)
    assert status["state"] == "finished" and status["registered"] == 3
    metrics = read_metrics(run_dir)
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    assert sorted(metrics[-1]["split_points"]) == ["dev0-site0", "dev1-site1", "dev2-site2"]
    assert metrics[-1]["test_accuracy"] > status["initial"]["test_accuracy"] + 0.1


def test_a_device_folder_that_loops_stops_that_device_alone(tmp_path):
    """One agent, two devices from a folder of device folders: ``good`` holds digits per class,
    ``bad`` one class folder of digits and one that links back to ``bad`` itself, which was followed
    (as an empty class) before links were checked. Given as ``--data good --data bad`` instead, the
    loop made ``bad`` ambiguous and stopped the whole agent: tests/unit/device_agent/test_agent_data.py."""
    digits = np.load(write_raw_mnist(tmp_path / "digits.npz", "train", slice(0, 200)))
    sites = tmp_path / "sites"
    for i, (pixels, label) in enumerate(zip(digits["x"], digits["y"])):
        for device in ("good", "bad") if label == 0 else ("good",):
            (sites / device / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(sites / device / str(label) / f"{i}.png")
    (sites / "bad" / "1").symlink_to(".")
    test_file = write_raw_mnist(tmp_path / "test.npz", "test", slice(0, 300))
    config = small_config(algorithm="fedavg", **{"train.batch_size": 20}, data={
        "dataset": "local", "num_devices": 1, "num_classes": 10, "input_shape": [1, 28, 28], "test_file": str(test_file),
        "input_transform": {"scale": 1 / 255, "mean": [MNIST_MEAN], "std": [MNIST_STD]}})
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, device_data=[str(sites)], warm=shared_starter()) as testbed:
        [agent] = testbed.agent_services
        # Not testbed.follow(): it ends the run as failed once an agent exits with an error, and
        # this agent does, with the run's end.
        wait_for(lambda: testbed.status()["state"] == "finished" or not agent.alive(), 240, "the run to finish")
        status = testbed.status()
        wait_for(lambda: not agent.alive(), 60, "the agent to exit")
        assert agent.process.returncode == 2, agent.log_tail()
        errors = [line for line in agent.log_tail(400).splitlines() if "ERROR" in line]
    assert len(errors) == 1 and errors[0].endswith(
        f"dev0-bad: not registered: {sites / 'bad' / '1'}: a symbolic link that loops (to {sites / 'bad'}, a folder "
        f"that holds it)"), errors
    assert status["state"] == "finished" and status["registered"] == 1
    metrics = read_metrics(run_dir)
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    assert list(metrics[-1]["split_points"]) == ["dev0-good"]


def write_tabular(path: Path, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of three well-separated classes of four features, as a CSV whose label column
    ("class") sits between the features: header order is feature order."""
    y = rng.integers(0, 3, size=n)
    x = rng.normal(size=(n, 4)) + 3.0 * np.eye(3, 4)[y]
    table = np.column_stack([x[:, :2], y, x[:, 2:]])
    np.savetxt(path, table, delimiter=",", header="f0,f1,class,f2,f3", comments="",
               fmt=["%.6f", "%.6f", "%d", "%.6f", "%.6f"])
    return x, y


def test_csv_devices_and_a_data_function_with_data_args_train_fedavg(tmp_path, monkeypatch):
    rng = np.random.default_rng(7)
    sites = [tmp_path / f"site{i}.csv" for i in range(3)]
    for site in sites:
        write_tabular(site, rng, 120)
    x, y = write_tabular(tmp_path / "test.csv", rng, 300)
    np.savez(tmp_path / "test.npz", x=x.reshape(-1, 1, 1, 4).astype(np.float32), y=y)
    # The third device's data function, importable by the agents (they inherit PYTHONPATH): it
    # reads the file its --data-arg names, so the run only trains if the keyword reached it.
    (tmp_path / "site_data.py").write_text(
        "import numpy as np\n"
        "def load(path):\n"
        "    table = np.loadtxt(path, delimiter=',', skiprows=1)\n"
        "    return table[:, [0, 1, 3, 4]].reshape(-1, 1, 1, 4), table[:, 2].astype(np.int64)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    config = small_config(algorithm="fedavg", model="logreg", rounds=3,
                          **{"train.batch_size": 20, "train.lr": 0.1}, data={
                              "dataset": "local", "num_devices": 3, "num_classes": 3, "input_shape": [1, 1, 4],
                              "label_column": "class", "test_file": str(tmp_path / "test.npz")})
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, device_data=[str(sites[0]), str(sites[1]), "site_data:load"],
                 data_args=[f"path={sites[2]}"], warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    assert status["state"] == "finished" and status["registered"] == 3
    metrics = read_metrics(run_dir)
    assert [m["status"] for m in metrics] == ["ok"] * 3
    assert sorted(metrics[-1]["split_points"]) == ["dev0-site0", "dev1-site1", "dev2-load"]
    assert metrics[-1]["test_accuracy"] > 0.9 and metrics[-1]["test_loss"] < status["initial"]["test_loss"] / 2
