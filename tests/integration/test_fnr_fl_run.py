"""FNR-FL end to end through the real services: report -> follow-up (refine or not) -> upload."""
from __future__ import annotations

import math

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.models import build_model


def test_fnr_fl_two_rounds_refines_the_lowest_accuracy_half(run_testbed):
    config = small_config(algorithm="fnr-fl", **{
        "data.partition": "iid",
        "data.public_samples": 200,
        "data.device_transform": "gaussian_noise",
        "data.device_transform_params": {"sigma": 1.0},
        "algorithm_params": {"p": 0.5, "refine_epochs": 1},
    })
    status, metrics, run_dir = run_testbed(config)

    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2]
    assert all(m["status"] == "ok" for m in metrics)
    assert all(len(m["aggregated"]) == 4 for m in metrics)
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in metrics)
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(config.model, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert any(not (state[k] == initial[k]).all() for k in initial)

    for m in metrics:
        am = m["algorithm_metrics"]
        assert am["leaky"] is False and am["public_set"] == "holdout" and am["penalty"] == "paper"
        acc = am["public_accuracy"]
        assert am["reported"] == 4 and set(acc) == set(m["selected"])
        # floor(4 * 0.5) = 2 devices, the two lowest public accuracies (ties by id), refined and uploaded.
        lowest = sorted(acc, key=lambda d: (acc[d], d))[:2]
        assert am["refine_selected"] == lowest
        assert am["refined"] == sorted(lowest)
        assert set(am["delta"]) == set(lowest)
        for device in lowest:
            stats = am["refine_stats"][device]
            assert stats["refine_steps"] == 1 * math.ceil(200 / 32)
            assert math.isfinite(stats["refine_ce"])
        assert all(len(norms) == 10 for norms in am["feature_norms"].values())
