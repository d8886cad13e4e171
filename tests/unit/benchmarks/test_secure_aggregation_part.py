"""Part (l)'s pure parts (benchmarks/secure_aggregation.py): its cases and their runs, the ratios
against the plain round, the verdict and the table."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import secure_aggregation as part
from benchmarks.attacks import ATTACKS
from benchmarks.run import DEFAULT_PARTS, PARTS


def test_each_size_runs_plain_secure_and_each_dropout_within_its_threshold():
    cases = part.cases((10, 100))
    sparse = f"{part.NEIGHBOURS} neighbours"
    assert [(c.devices, c.label, c.dropped) for c in cases] == [
        (10, "plain", 0), (10, "secure", 0), (10, "secure, 10% drop", 1), (10, "secure, 30% drop", 3),
        (100, "plain", 0), (100, "secure", 0), (100, f"secure, {sparse}", 0), (100, f"secure, {sparse}, 10% drop", 10),
        (100, f"secure, {sparse}, 30% drop", 30)]
    # Past 100 devices the complete graph's quadratic work is left out.
    assert [c.label for c in part.cases((1000,))] == [
        "plain", f"secure, {sparse}", f"secure, {sparse}, 10% drop", f"secure, {sparse}, 30% drop"]
    for case in cases:
        config = part.bench_config(case, rounds=3)
        secure = config.secure_aggregation
        assert secure.enabled == case.secure and secure.neighbours == case.neighbours
        assert config.per_round == case.devices == config.data.num_devices
        if case.neighbours is None:
            # The default threshold is a majority of the devices that sent keys: the survivors must reach it.
            assert secure.threshold is None and case.devices - case.dropped >= case.devices // 2 + 1
        else:
            assert secure.threshold == part.SPARSE_THRESHOLD <= case.neighbours + 1


def _row(devices: int, case: str, median: float | None, secure: bool = True, attempts: int = 3,
         neighbours: int | None = None) -> dict:
    return {"devices": devices, "case": case, "secure": secure, "neighbours": neighbours, "median_round_s": median,
            "state": "finished",
            "rounds_ok": 3, "attempts": attempts, "fed_cpu_s_per_round": 0.5, "fed_peak_pss_mib": 200.0,
            "fed_kib_per_device_round": 70.0, "agents_cpu_s": 4.0, "final_accuracy": 0.86}


def test_the_verdict_judges_every_secure_case_at_100_devices_against_its_plain_round():
    rows = [_row(10, "plain", 1.0, secure=False), _row(10, "secure", 5.0), _row(100, "plain", 2.0, secure=False),
            _row(100, "secure", 2.9), _row(100, "secure, 10% drop", 3.0)]
    part.add_ratios(rows)
    assert [r["round_ratio"] for r in rows] == [1.0, 5.0, 1.0, 1.45, 1.5]
    assert part.verdict(rows) == "met"   # 10 devices' 5x is not the goal's size
    rows.append(_row(100, "secure, 30% drop", 3.1))
    part.add_ratios(rows)
    assert part.verdict(rows) == "not met: secure, 30% drop"
    retried = [*rows[:4], _row(100, "secure, 10% drop", 2.5, attempts=4)]
    part.add_ratios(retried)
    assert part.verdict(retried) == "not met: secure, 10% drop"   # a round was retried: not recovered
    assert part.verdict(rows[:2]) == "not measured at 100 devices"
    # With a sparse graph measured, the dropouts ran on it: the complete graph's row is a reference.
    sparse = [*rows[:4], _row(100, "secure, 20 neighbours", 2.5, neighbours=20),
              _row(100, "secure, 20 neighbours, 10% drop", 2.8, neighbours=20)]
    part.add_ratios(sparse)
    assert part.verdict(sparse) == "met"
    sparse[-1]["median_round_s"] = 3.2
    part.add_ratios(sparse)
    assert part.verdict(sparse) == "not met: secure, 20 neighbours, 10% drop"


def test_the_table_has_a_row_per_case_with_its_ratio():
    rows = [_row(10, "plain", 0.25, secure=False), _row(10, "secure", 0.64)]
    part.add_ratios(rows)
    lines = part.table({"rows": rows})
    assert len(lines) == 4 and lines[3].startswith("| 10 | secure | 3 (3) | 0.64 | 2.56x | 0.50 | 200.0 | 70 |")


def test_the_part_runs_only_when_named_and_its_dropout_is_no_attack_row():
    assert "l" in PARTS and "l" not in DEFAULT_PARTS
    assert "drops_after_sharing" not in ATTACKS and "silent" in ATTACKS


def test_the_report_names_the_agent_processes_and_a_count_below_one_is_refused(capsys):
    results = {"machine": {"cpu_model": "x", "cpus_usable": 16}, "model": "logreg", "data": "mnist", "rounds": 3,
               "rows": [], "goal": {"devices": 100, "round_ratio_max": 1.5}, "verdict": "met"}
    assert "the devices in one agent process;" in part.report(results)
    assert "the devices in 8 agent processes;" in part.report({**results, "agents": 8})
    with pytest.raises(SystemExit):
        part.main(["--agents", "0"])
    assert "--agents takes a positive count" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["2", "10,x", ""])
def test_sizes_below_a_threshold_or_not_counts_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="at least 3"):
        part.parse_sizes(text)


def test_the_sparse_threshold_recovers_the_dropouts_where_a_majority_would_fail_attempts():
    sparse = part.SPARSE_THRESHOLD
    majority = (part.NEIGHBOURS + 1) // 2 + 1
    assert part.failed_attempts(100, part.NEIGHBOURS, sparse, 30, trials=400) < 0.02
    assert part.failed_attempts(100, part.NEIGHBOURS, majority, 30, trials=400) > 0.15
    assert part.failed_attempts(100, part.NEIGHBOURS, majority, 10, trials=400) == 0.0



def test_a_split_run_on_the_sparse_graph_aggregates_fewer_of_the_blocks_its_devices_hold():
    # With 98 neighbours of 100 devices (all but one other) a third of them holds each deeper
    # block, far above the threshold: all are aggregated. Over 20 neighbours some are not.
    assert part.blocks_aggregated(100, 98, part.SPARSE_THRESHOLD, trials=20) == 1.0
    assert 0.7 < part.blocks_aggregated(100, part.NEIGHBOURS, part.SPARSE_THRESHOLD, trials=20) < 0.95
    results = {"machine": {"cpu_model": "x", "cpus_usable": 2}, "model": "m", "data": "d", "rounds": 1, "rows": [],
               "goal": {"devices": 100, "round_ratio_max": 1.5}, "verdict": "v",
               "sparse_blocks_aggregated": [{"devices": 100, "threshold": 8, "aggregated": 0.846}]}
    assert ("In a split run over 20 neighbours with threshold 8, 100 devices cut at random after 1 to 3 blocks mask and "
            "upload 84.6% of the blocks they hold (300 random rings)") in part.report(results)


def test_the_protocol_computation_is_timed_step_by_step_over_the_graph_the_dropouts_run_on():
    assert part.graph_of(10) == (None, 6)
    assert part.graph_of(100) == (part.NEIGHBOURS, part.SPARSE_THRESHOLD)
    measured = part.protocol_cpu(5)
    assert (measured["devices"], measured["neighbours"], measured["threshold"]) == (5, None, 3)
    assert set(measured["cpu_s"]) == {"keys", "shares", "inbox", "mask"} and all(v > 0 for v in measured["cpu_s"].values())
    assert measured["total_cpu_s"] == pytest.approx(sum(measured["cpu_s"].values()), abs=1e-3)
    line = next(l for l in part.report({
        "machine": {"cpu_model": "x", "cpus_usable": 2}, "model": "logreg", "data": "mnist", "rounds": 3, "rows": [],
        "goal": {"devices": 100, "round_ratio_max": 1.5}, "verdict": "met", "protocol_cpu": [measured]}).splitlines()
        if l.startswith("The devices' protocol computation"))
    assert "at 5 devices (the complete graph, threshold 3)" in line
