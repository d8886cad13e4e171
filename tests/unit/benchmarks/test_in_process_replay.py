"""Parts (a) and (f) replay a services run's rounds in one process: the replay runs the
algorithm's aggregation, bounds and their log lines included, for each recorded round."""
from __future__ import annotations

import logging

import pytest

from benchmarks import fedavg_overhead, network_overhead
from fed_server.records import RoundRecord
from shared.run_config import load_run_config

DEVICES = ["dev-0", "dev-1", "dev-2"]


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


@pytest.fixture
def records(round_record) -> list[RoundRecord]:
    # Round 2 ran as attempt 3 (attempt 2 failed): the log must name both.
    return [round_record(round=1, round_id=1, aggregated=DEVICES), round_record(round=2, round_id=3, aggregated=DEVICES)]


def test_the_fedavg_replay_aggregates_with_the_recorded_round_and_attempt(
        records: list[RoundRecord], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.algorithms.base")
    result = fedavg_overhead.run_in_process(_config("fedavg"), records, log=lambda _line: None)
    assert len(result["accuracies"]) == 2
    assert any("round 2 (attempt 3): aggregation weight bounded" in m for m in caplog.messages), caplog.messages


def test_the_split_replay_aggregates_with_the_recorded_round_and_attempt(
        records: list[RoundRecord], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="shared.algorithms.base")
    result = network_overhead.run_in_process(_config("s2fl"), records, log=lambda _line: None)
    assert len(result["accuracies"]) == 2 and result["groups_match_services"]
    assert any("round 2 (attempt 3): aggregation weight bounded" in m for m in caplog.messages), caplog.messages
