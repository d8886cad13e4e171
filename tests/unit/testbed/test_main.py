"""The testbed's round line: server-evaluated, federated, and without figures."""
from __future__ import annotations

from testbed.__main__ import format_round

STATUS = {"rounds_total": 2}


def _record(**fields) -> dict:
    return {"round": 1, "status": "ok", "test_accuracy": 0.5, "test_loss": 1.25, "round_time_s": 1.0, "elapsed_s": 2.0,
            "bytes_total": 1e6, "cumulative_bytes": 2e6, "split_points": {"d0": 3}, "dropped": [],
            "evaluated_devices": None, **fields}


def test_the_round_line_marks_federated_figures_and_shows_missing_ones_as_na():
    assert "acc  50.00%  loss 1.250" in format_round(_record(), STATUS)
    assert "acc(fed)  50.00%  loss 1.250" in format_round(_record(evaluated_devices=3), STATUS)
    line = format_round(_record(evaluated_devices=0, test_accuracy=None, test_loss=None), STATUS)
    assert "acc(fed) n/a  loss n/a" in line
