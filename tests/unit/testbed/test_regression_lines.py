"""The testbed's round and final lines of a regression run: MSE and MAE where a classification run
shows its accuracy."""
from __future__ import annotations

from testbed.follow import format_done, format_round

STATUS = {"rounds_total": 2, "initial": {"test_accuracy": None, "test_loss": 1.0, "test_mse": 1.0, "test_mae": 0.8}}


REGRESSION = {"test_accuracy": None, "test_loss": 0.25, "test_mse": 0.25, "test_mae": 0.4}


def test_a_regression_round_line_shows_mse_and_mae(round_record):
    assert "round   1/2  mse 0.2500  mae 0.4000  loss 0.250  round" in format_round(round_record(**REGRESSION), STATUS)
    line = format_round(round_record(**{**REGRESSION, "evaluated_devices": 0, "test_mse": None, "test_mae": None,
                                        "test_loss": None}), STATUS)
    assert "mse(fed) n/a  mae n/a  loss n/a" in line


def test_a_regression_run_ends_with_its_final_mse():
    summary = {"rounds": 2, "final_accuracy": None, "best_accuracy": None, "initial_mse": 1.0, "final_mse": 0.25,
               "best_mse": 0.2, "final_mae": 0.4, "median_round_time_s": 1.0, "total_time_s": 2.0, "total_bytes": 1e6}
    assert format_done(summary).startswith(
        "done: 2 rounds, final mse 0.2500 (best 0.2000, initial 1.0000), final mae 0.4000, median round 1.0s")
