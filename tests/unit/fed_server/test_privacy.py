"""The Fed Server's privacy terms and spending (fed_server/privacy.py): a multiplier calibrated to
``target_epsilon`` spends it in the planned rounds and the budget stops the run there; adaptive
clipping's noise split and bound; the checkpoint keeps the multiplier, the bound and the ledger; a
round selects fewer devices from a short pool, so that it never samples above the run's rate, and
spends the rate it sampled at."""
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
        record = run.release(aggregated=5, unclipped=None, sample_rate=0.25)
        assert record["epsilon"] == run.epsilon() and record["noise_multiplier"] == run.noise_multiplier
        assert record["sample_rate"] == 0.25
    assert 1.9 <= run.epsilon() <= 2.0   # Opacus's calibration tolerance
    assert run.exhausted().startswith("privacy budget: another round would raise epsilon from")


def test_adaptive_clipping_splits_the_multiplier_and_moves_the_bound():
    run = RunPrivacy(_config(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=2.0))
    update_std, count_std = run.central_stds()
    assert count_std == 2.0
    assert (update_std / run.clip_norm) ** -2 + (2 * 2.0) ** -2 == pytest.approx(1.0)
    record = run.release(aggregated=5, unclipped=5.0, sample_rate=0.25)   # every update was inside: the bound shrinks
    assert record["clip_norm"] == 1.0 and record["unclipped_fraction"] == 1.0
    assert run.clip_norm == pytest.approx(math.exp(-0.2 * 0.5))


def test_a_resumed_run_keeps_its_multiplier_bound_and_ledger():
    config = _config(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=5.0)
    run = RunPrivacy(config)
    for _ in range(3):
        run.release(aggregated=5, unclipped=1.0, sample_rate=0.25)
    resumed = RunPrivacy(config)
    resumed.load_state_dict(run.state_dict())
    assert (resumed.noise_multiplier, resumed.clip_norm, resumed.epsilon()) == (
        run.noise_multiplier, run.clip_norm, run.epsilon())
    assert resumed.adaptive is not None and resumed.adaptive.clip_norm == run.clip_norm


def test_a_round_never_samples_above_the_runs_rate_and_spends_the_rate_it_sampled_at():
    from opacus.accountants import RDPAccountant

    run = RunPrivacy(_config(noise_multiplier=1.0))
    # 5 of 20 configured: from a pool of 20 all 5; of 12 (the rest not registered, or sitting out)
    # 3 (rate 0.25); of 7, 1; of 3, none. A larger pool keeps 5.
    assert [run.devices_for(pool, 5, 20) for pool in (20, 12, 7, 3, 40)] == [5, 3, 1, 0, 5]
    assert RunPrivacy(_config(noise=None)).devices_for(12, 5, 20) == 5     # no epsilon to keep
    run.release(aggregated=3, unclipped=None, sample_rate=3 / 12)
    run.release(aggregated=1, unclipped=None, sample_rate=1 / 7)
    opacus = RDPAccountant()
    opacus.step(noise_multiplier=1.0, sample_rate=3 / 12)
    opacus.step(noise_multiplier=1.0, sample_rate=1 / 7)
    assert run.epsilon() == pytest.approx(opacus.get_epsilon(1e-3))
    with pytest.raises(RuntimeError, match="sampled at 0.5, above the run's 0.25"):
        run.release(aggregated=5, unclipped=None, sample_rate=0.5)


def test_a_round_released_after_the_last_checkpoint_is_counted_on_resume(tmp_path):
    from fed_server.run_dir import RunDirectory

    config = _config(noise_multiplier=1.0)
    run = RunPrivacy(config, RunDirectory(tmp_path))
    for _ in range(2):
        run.release(aggregated=5, unclipped=None, sample_rate=0.25)
    checkpoint = run.state_dict()        # what the checkpoint of round 2 holds
    run.release(aggregated=5, unclipped=None, sample_rate=0.25)   # round 3's model leaves; then the Fed Server stops
    three = run.epsilon()
    resumed = RunPrivacy(config, RunDirectory(tmp_path))
    resumed.load_state_dict(checkpoint)  # resumes after round 2, and will run round 3 again
    assert resumed.ledger is not None and resumed.ledger.rounds == 3 and resumed.epsilon() == three
    # A checkpoint that counts every spend noted: it is the one continued.
    again = RunPrivacy(config, RunDirectory(tmp_path))
    again.load_state_dict(run.state_dict())
    assert again.epsilon() == three
    # Without a note (a run directory from before it was kept), the checkpoint's ledger.
    fresh = RunPrivacy(config, RunDirectory(tmp_path / "other"))
    fresh.load_state_dict(checkpoint)
    assert fresh.ledger is not None and fresh.ledger.rounds == 2
