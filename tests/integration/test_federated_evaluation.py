"""Federated evaluation end to end: FedAvg on embedded MNIST, the server evaluating nothing, the
devices evaluating the global model on their held-out parts and the Fed Server recording the
sample-weighted mean of their reports."""
from __future__ import annotations

import pytest

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.data import device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.evaluation import evaluation_sums
from shared.models import build_model


def test_devices_evaluate_the_global_model_and_the_record_is_their_weighted_mean(run_testbed):
    config = small_config(algorithm="fedavg", model="cnn", **{
        "data.num_devices": 3, "data.max_samples": 600, "evaluation.mode": "federated", "evaluation.holdout": 0.2,
    })
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2] and all(m["status"] == "ok" for m in metrics)
    assert status["initial"] == {"test_accuracy": None, "test_loss": None}   # nothing evaluates round 0

    # Recompute every device's held-out part with the devices' own split (testbed ids: dev-<shard>).
    train_pool = load_dataset(config.data)[0]
    held_out = {f"dev-{shard:03d}": evaluation_holdout(device_shard(config.data, train_pool, shard),
                                                       config.evaluation.holdout, config.seed, f"dev-{shard:03d}")[1]
                for shard in range(3)}
    for m in metrics:
        assert sorted(m["aggregated"]) == sorted(held_out)
        assert m["evaluated_devices"] == 3 and m["evaluated_samples"] == sum(len(h) for h in held_out.values())

    # The last record's figures are the sample-weighted mean of what each device computed on its
    # held-out part with the final global model (the checkpoint's), not an average of averages.
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    model = build_model(config.model, 10, (1, 28, 28), seed=config.seed)
    model.load_state_dict(state)
    sums = [evaluation_sums(model, h) for h in held_out.values()]
    samples = sum(len(h) for h in held_out.values())
    last = metrics[-1]
    assert last["test_accuracy"] == pytest.approx(sum(s.correct for s in sums) / samples)
    assert last["test_loss"] == pytest.approx(sum(s.loss_sum for s in sums) / samples, rel=1e-4)
    summary = status["summary"]
    assert summary["initial_accuracy"] is None and summary["final_accuracy"] == last["test_accuracy"]
