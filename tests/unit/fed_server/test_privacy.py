"""The Fed Server's privacy terms and spending (fed_server/privacy.py): a multiplier calibrated to
``target_epsilon`` spends it in the planned rounds and the budget stops the run there; adaptive
clipping's noise split and bound; the checkpoint keeps the multiplier, the bound and the ledger."""
from __future__ import annotations

import math

import pytest

from fed_server.privacy import RunPrivacy
from shared.run_config import load_run_config


def _config(**privacy):
    return load_run_config({"algorithm": "fedavg", "aggregation": {"rule": "mean"}, "rounds": 6,
                            "data": {"num_devices": 20}, "devices_per_round": 5,
                            "privacy": {"clipping": "fixed", "noise": "central", "delta": 1e-3, **privacy}})


def test_a_calibrated_multiplier_spends_the_target_in_the_planned_rounds_and_the_budget_stops_there():
    run = RunPrivacy(_config(target_epsilon=2.0, clip_norm=0.5))
    assert run.sample_rate == 0.25 and run.noise_multiplier is not None
    assert run.task_terms().clip_norm == 0.5
    assert run.central_stds() == (pytest.approx(run.noise_multiplier * 0.5), 0.0)
    for done in range(1, 7):
        assert run.exhausted() is None, done
        record = run.release(aggregated=5, unclipped=None)
        assert record["epsilon"] == run.epsilon() and record["noise_multiplier"] == run.noise_multiplier
    assert 1.9 <= run.epsilon() <= 2.0   # Opacus's calibration tolerance
    assert run.exhausted().startswith("privacy budget: another round would raise epsilon from")


def test_adaptive_clipping_splits_the_multiplier_and_moves_the_bound():
    run = RunPrivacy(_config(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=2.0))
    update_std, count_std = run.central_stds()
    assert count_std == 2.0
    assert (update_std / run.clip_norm) ** -2 + (2 * 2.0) ** -2 == pytest.approx(1.0)
    record = run.release(aggregated=5, unclipped=5.0)   # every update was inside: the bound shrinks
    assert record["clip_norm"] == 1.0 and record["unclipped_fraction"] == 1.0
    assert run.clip_norm == pytest.approx(math.exp(-0.2 * 0.5))


def test_a_resumed_run_keeps_its_multiplier_bound_and_ledger():
    config = _config(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=5.0)
    run = RunPrivacy(config)
    for _ in range(3):
        run.release(aggregated=5, unclipped=1.0)
    resumed = RunPrivacy(config)
    resumed.load_state_dict(run.state_dict())
    assert (resumed.noise_multiplier, resumed.clip_norm, resumed.epsilon()) == (
        run.noise_multiplier, run.clip_norm, run.epsilon())
    assert resumed.adaptive is not None and resumed.adaptive.clip_norm == run.clip_norm
