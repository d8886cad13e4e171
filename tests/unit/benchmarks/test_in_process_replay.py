"""Parts (a) and (f) replay a services run's rounds in one process: the replay runs the
algorithm's aggregation, bounds and their log lines included, for each recorded round."""
from __future__ import annotations

import logging

import pytest

from benchmarks import fedavg_overhead, network_overhead
from fed_server.records import GroupRecord, RoundRecord
from shared.run_config import load_run_config

DEVICES = ["dev-0", "dev-1", "dev-2"]


def _record(round_index: int, attempt: int, split_point: int) -> RoundRecord:
    """A clean round of the three devices in one group, as the services would record it."""
    return RoundRecord(
        round=round_index, round_id=attempt, algorithm="s2fl", status="ok", test_accuracy=0.5, test_loss=1.0,
        train_loss=1.0, round_time_s=1.0, elapsed_s=float(round_index), selected=DEVICES, aggregated=DEVICES,
        dropped=[], split_points={d: split_point for d in DEVICES}, device_times={}, device_kinds={},
        groups=[GroupRecord(group_id=0, members=DEVICES, dropped=[], label_distance=None, start_block=split_point,
                            train_time_s=1.0)],
        bytes_up=0, bytes_down=0, bytes_server=0, bytes_total=0, cumulative_bytes=0, plan_error=None)


def _config(algorithm: str):
    # Bounds tight enough that the aggregation caps some weight and logs it: the replay's round
    # context reaches that log line. Non-IID shards of unequal size, so weights differ.
    return load_run_config({
        "algorithm": algorithm, "rounds": 2,
        "data": {"num_devices": len(DEVICES), "partition": "dirichlet", "alpha": 0.5, "seed": 1, "max_samples": 150},
        "train": {"lr": 0.05, "batch_size": 32},
        "grouping": {"group_size": len(DEVICES)},
        "aggregation": {"rule": "bounded_mean", "params": {"max_weight_ratio": 1.0}},
        "devices": {"profiles": []},
        "seed": 1,
    })


def _records() -> list[dict]:
    # Round 2 ran as attempt 3 (attempt 2 failed): the log must name both.
    return [_record(1, 1, 1).to_json(), _record(2, 3, 1).to_json()]


def test_the_fedavg_replay_aggregates_with_the_recorded_round_and_attempt(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.algorithms.base")
    result = fedavg_overhead.run_in_process(_config("fedavg"), _records(), log=lambda _line: None)
    assert len(result["accuracies"]) == 2
    assert any("round 2 (attempt 3): aggregation weight bounded" in m for m in caplog.messages), caplog.messages


def test_the_split_replay_aggregates_with_the_recorded_round_and_attempt(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.algorithms.base")
    result = network_overhead.run_in_process(_config("s2fl"), _records(), log=lambda _line: None)
    assert len(result["accuracies"]) == 2 and result["groups_match_services"]
    assert any("round 2 (attempt 3): aggregation weight bounded" in m for m in caplog.messages), caplog.messages
