"""Devices that bring their own data (dataset "local") through the real services.

Three device agents each read their own raw ``.npz`` (uint8 MNIST digits written from the embedded
subset), register without a shard, and train FedAvg with the run's input transform; the Fed Server evaluates on ``data.test_file``. A device whose file is bad stops before registering, with the message.
"""
from __future__ import annotations

import numpy as np

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
        status = testbed.follow(timeout=240)
        # The run is over but the Fed Server still serves its spec: a fourth device with a bad
        # file fetches it, checks its data and stops without registering.
        agent = testbed.start_agent("agent-bad", data=str(bad), index=3)
        wait_for(lambda: not agent.alive(), 120, "the agent with bad data to exit")
        assert testbed.status()["registered"] == 3
        assert agent.process.returncode == 1
        assert f"dev3-bad: not registered: {bad}: field 'y' has labels 0..10, outside 0..9" in agent.log_tail()
    assert status["state"] == "finished" and status["registered"] == 3
    metrics = read_metrics(run_dir)
    assert [m["status"] for m in metrics] == ["ok", "ok"]
    assert sorted(metrics[-1]["split_points"]) == ["dev0-site0", "dev1-site1", "dev2-site2"]
    assert metrics[-1]["test_accuracy"] > status["initial"]["test_accuracy"] + 0.1
