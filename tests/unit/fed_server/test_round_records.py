"""Reading ``metrics.jsonl`` back as typed round records: the one loader every reader uses."""
from __future__ import annotations

import pytest

from fed_server.records import read_round_records
from fed_server.run_dir import RunDirectory


def test_the_records_written_are_read_back_typed_and_a_missing_file_holds_none(tmp_path, round_record):
    run = RunDirectory(tmp_path)
    assert read_round_records(run.metrics_path) == []
    written = [round_record(round=1, round_id=1, status="failed", test_accuracy=None), round_record(round=1, round_id=2)]
    for record in written:
        run.append_metrics(record.to_json())
    assert read_round_records(run.metrics_path) == written


def test_a_line_that_is_not_a_record_is_named_by_file_and_line(tmp_path, round_record):
    run = RunDirectory(tmp_path)
    run.append_metrics(round_record().to_json())
    run.append_metrics({**round_record(round=2).to_json(), "round": "two"})
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a round record: round: Input should be a valid integer"):
        read_round_records(run.metrics_path)
