"""``python -m testbed.follow``: refuses what is not a Fed Server's status before following."""
from __future__ import annotations

import pytest

import testbed.follow as follow


def test_an_address_that_answers_something_else_is_refused_in_one_line(monkeypatch, capsys):
    # A Main Server's /v1/status (its open round) is not a run's status.
    monkeypatch.setattr(follow, "fetch_status", lambda url, verify: lambda since, seen, wait_s: {"round": None})
    with pytest.raises(SystemExit) as exited:
        follow.main(["http://main:8081"])
    assert exited.value.code == 1
    assert capsys.readouterr().err == "follow failed: http://main:8081/v1/status is not a Fed Server's status (a Main Server?)\n"


def test_a_finished_run_prints_every_round_and_the_summary(monkeypatch, capsys, round_record):
    record = round_record()
    summary = {"rounds": 1, "final_accuracy": 0.5, "best_accuracy": 0.5, "median_round_time_s": 1.0,
               "total_time_s": 1.0, "total_bytes": 1e6}
    finished = {"state": "finished", "records": 1, "history": [record.to_json()], "rounds_done": 1, "rounds_total": 1,
                "summary": summary}
    monkeypatch.setattr(follow, "fetch_status", lambda url, verify: lambda since, seen, wait_s: finished)
    follow.main(["http://fed:8080"])
    assert capsys.readouterr().out.splitlines() == [follow.format_round(record, finished), follow.format_done(summary)]


def test_while_the_run_waits_for_its_devices_each_new_count_is_reported_once():
    def waiting(registered: int) -> dict:
        return {"state": "waiting_for_devices", "registered": registered, "expected_devices": 3, "records": 0,
                "history": [], "rounds_done": 0, "rounds_total": 1, "summary": None}
    answers = iter([waiting(0), waiting(0), waiting(2), waiting(2), waiting(3),
                    {**waiting(3), "state": "running"}, {**waiting(3), "state": "finished"}])
    reported: list[tuple[int, int]] = []
    final = follow.follow_run(lambda since, seen, wait_s: next(answers),
                              on_waiting=lambda registered, expected: reported.append((registered, expected)))
    assert final["state"] == "finished"
    assert reported == [(0, 3), (2, 3), (3, 3)]
    assert follow.format_waiting(2, 3) == "waiting for devices: 2 of 3 registered"


def test_a_record_the_follower_cannot_read_ends_the_follow_in_one_line(monkeypatch, capsys, round_record):
    # A Fed Server of another version: its record lacks a field this one requires.
    record = {k: v for k, v in round_record().to_json().items() if k != "elapsed_s"}
    running = {"state": "running", "records": 1, "history": [record], "rounds_done": 1, "rounds_total": 2,
               "summary": None}
    monkeypatch.setattr(follow, "fetch_status", lambda url, verify: lambda since, seen, wait_s: running)
    with pytest.raises(SystemExit) as exited:
        follow.main(["http://fed:8080"])
    assert exited.value.code == 1
    assert capsys.readouterr().err == ("follow failed: the Fed Server sent a record this follower cannot read: "
                                       "not a round record: elapsed_s: Field required\n")


def test_the_round_line_and_the_last_lines_name_the_dropped_devices(round_record):
    status = {"rounds_total": 2, "initial": {"test_accuracy": 0.1}}
    record = round_record(round=2, round_id=2, aggregated=["d0"], split_points={"d0": 3, "d1": 3}, dropped=["d1"])
    assert follow.format_round(record, status).endswith("splits 3:2  dropped 1: d1")
    many = [f"d{i}" for i in range(1, 6)]
    assert follow.format_round(round_record(dropped=many), status).endswith("dropped 5: d1, d2, d3 +2")
    summary = {"rounds": 2, "final_accuracy": 0.5, "best_accuracy": 0.5, "median_round_time_s": 1.0,
               "total_time_s": 2.0, "total_bytes": 2e6, "dropped_every_round": {"d1": "withdrew: ValueError: ..."}}
    assert follow.format_done(summary).splitlines()[1:] == [
        "  dropped in every round it was selected for: d1 (withdrew: ValueError: ...)"]


def test_a_resumed_run_is_announced_once_after_its_restored_rounds(round_record):
    def _record(round_index: int) -> dict:
        return round_record(round=round_index, round_id=round_index).to_json()

    # Rounds 1 to 3 were restored from the checkpoint (attempts up to 3); 4 and 5 run now.
    resumed = {"resumed_after_round": 3, "resumed_after_attempt": 3, "rounds_done": 3}
    answers = iter([
        {**resumed, "state": "waiting_for_devices", "registered": 0, "expected_devices": 2, "records": 3,
         "history": [_record(1), _record(2), _record(3)]},
        {**resumed, "state": "running", "records": 4, "history": [_record(4)]},
        {**resumed, "state": "finished", "records": 5, "history": [_record(5)]},
        {**resumed, "state": "finished", "records": 5, "history": [_record(r) for r in range(1, 6)]},
    ])
    events: list[str] = []
    follow.follow_run(lambda since, seen, wait_s: next(answers), lambda record, _: events.append(f"round {record.round}"),
                      on_resumed=lambda rounds: events.append(follow.format_resumed(rounds)), replay_restored=False)
    assert events == ["resumed after round 3", "round 4", "round 5"]
    # A follower that replays the history (python -m testbed.follow) puts the line where the restart was.
    answers = iter([{**resumed, "state": "finished", "records": 5, "history": [_record(r) for r in range(1, 6)]}] * 2)
    events.clear()
    follow.follow_run(lambda since, seen, wait_s: next(answers), lambda record, _: events.append(f"round {record.round}"),
                      on_resumed=lambda rounds: events.append(follow.format_resumed(rounds)))
    assert events == ["round 1", "round 2", "round 3", "resumed after round 3", "round 4", "round 5"]


def test_a_private_runs_lines_show_its_epsilon_and_why_it_stopped(round_record):
    spent = {"clip_norm": 0.5, "epsilon": 1.2345, "delta": 1e-5, "noise_multiplier": 1.1}
    line = follow.format_round(round_record(privacy=spent), {"rounds_total": 2})
    assert "  eps 1.234 (delta 1e-05)" in line
    assert "eps" not in follow.format_round(round_record(privacy={"clip_norm": 0.5}), {"rounds_total": 2})
    reason = "privacy budget: another round would raise epsilon from 2.889 to 3.236, past privacy.target_epsilon 3"
    summary = {"rounds": 4, "final_accuracy": 0.5, "best_accuracy": 0.5, "median_round_time_s": 1.0,
               "total_time_s": 2.0, "total_bytes": 2e6, "epsilon": 2.889, "delta": 1e-3, "stop_reason": reason}
    first, stopped = follow.format_done(summary).splitlines()
    assert "final accuracy 50.00% (best 50.00%), epsilon 2.889 at delta 0.001" in first
    assert stopped == f"  stopped: {reason}"
