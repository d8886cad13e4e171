"""The scenario benchmark's pure parts: schedules, what a run recorded, the best fixed split in
hindsight, the goals, the table and the docs writer (benchmarks/scenarios.py)."""
from __future__ import annotations

import math

import pytest

from benchmarks import scenario_agent
from benchmarks.result_files import replace_between
from benchmarks.scenarios import (DOCS_BEGIN, DOCS_END, PATIENCE, Change, Scenario, Speeds,
                                  best_fixed, choose_pinned,
                                  fill_from_other_phases, goals_missed, judge, links_problem, lost_rounds, median_ratio,
                                  parse_args, phase_cells, report, rounds_of, run_config, scenarios, split_line, summary_table, table,
                                  time_to,
                                  update_docs, warm_up_figures)
from fed_server.time_table import warm_up_rounds
from shared.profiles import parse_kind

A, B, C = "dev-000", "dev-001", "dev-002"


def _round(n, splits, uploaded, times, accuracy=0.5, elapsed=None, round_time=1.0):
    return {"round": n, "elapsed_s": float(elapsed if elapsed is not None else n), "round_time_s": round_time,
            "accuracy": accuracy, "splits": splits, "uploaded": sorted(uploaded), "times": times}


def test_a_change_holds_from_the_round_after_it_until_the_devices_next_change():
    drop = Scenario("x", "", ("low", "mid", "high"),
                    (Change(0, 2, Speeds(link=0.1)), Change(4, 2, Speeds()), Change(6, 1, Speeds(compute=0.5))))
    assert drop.speeds(2, 1) == Speeds(link=0.1) and drop.speeds(2, 4) == Speeds(link=0.1)
    assert drop.speeds(2, 5) == Speeds() and drop.speeds(1, 6) == Speeds() and drop.speeds(1, 7) == Speeds(compute=0.5)
    assert drop.speeds(0, 8) == Speeds()
    assert drop.phases(8) == [(1, 4), (5, 6), (7, 8)]
    # A change from the start is judged after the warm-up (the paper's 3 rounds, the estimated
    # one's 1); a later one until the device's next.
    assert drop.judged(8) == [(2, 4, 4), (2, 5, 8), (1, 7, 8)]
    assert drop.judged(8, warm_up_rounds("estimated", 3)) == [(2, 2, 4), (2, 5, 8), (1, 7, 8)]


def test_the_four_scenarios_change_what_they_say():
    by_name = {s.name: s for s in scenarios(5)}
    assert set(by_name) == {"link_drop", "link_recovery", "compute_halves", "fast_device"}
    assert by_name["link_drop"].speeds(2, 5) == Speeds() and by_name["link_drop"].speeds(2, 6).link == pytest.approx(0.1)
    recovery = by_name["link_recovery"]
    assert recovery.speeds(2, 1).link == pytest.approx(0.1) and recovery.speeds(2, 6) == Speeds()
    assert by_name["compute_halves"].speeds(1, 6).compute == pytest.approx(0.5)
    fast = by_name["fast_device"]
    # 20 times faster than the others in compute (stretch) and link rate, as the agent applies them.
    stretch = [parse_kind(k).compute_stretch / fast.speeds(d, 1).compute for d, k in enumerate(fast.profiles)]
    rate = [parse_kind(k).rate * fast.speeds(d, 1).link for d, k in enumerate(fast.profiles)]
    assert stretch[0] == stretch[1] == pytest.approx(20 * stretch[2]) and stretch[2] >= 1.0
    assert rate[2] == pytest.approx(20 * rate[0]) == pytest.approx(20 * rate[1])


def test_the_scenario_agent_scales_its_kinds_compute_stretch_and_transfer_delay():
    kind = parse_kind("mid")
    try:
        scenario_agent.Speeds.compute, scenario_agent.Speeds.link = 0.5, 0.1
        assert scenario_agent._compute_stretch(kind) == pytest.approx(2 * kind.compute_stretch)
        assert scenario_agent._transfer_delay(kind, 1000, 2.0) == pytest.approx(10 * kind.transfer_delay(1000, 2.0))
    finally:
        scenario_agent.Speeds.compute = scenario_agent.Speeds.link = 1.0


def test_the_rounds_keep_each_rounds_last_successful_attempt():
    records = [{"round": 1, "status": "ok", "elapsed_s": 2.0, "round_time_s": 2.0, "test_accuracy": 0.3,
                "split_points": {A: 1}, "aggregated": [A], "table_times": {A: 1.5}},
               {"round": 2, "status": "failed", "elapsed_s": 5.0, "round_time_s": 3.0, "test_accuracy": None,
                "split_points": {A: 2}, "aggregated": [], "table_times": {}},
               {"round": 2, "status": "ok", "elapsed_s": 7.0, "round_time_s": 2.0, "test_accuracy": 0.4,
                "split_points": {A: 3}, "aggregated": [A], "table_times": {A: 1.8}}]
    rounds = rounds_of(records)
    assert [r["round"] for r in rounds] == [1, 2] and rounds[1]["splits"] == {A: 3} and rounds[1]["accuracy"] == 0.4


def test_lost_rounds_time_to_and_split_line_read_the_uploads():
    rounds = [_round(1, {A: 1, B: 1}, [A, B], {A: 1, B: 1}, 0.2), _round(2, {A: 3, B: 2}, [B], {B: 1}, 0.5),
              _round(3, {B: 2}, [B], {B: 1}, 0.4), _round(5, {A: 1, B: 2}, [A, B], {A: 1, B: 1}, 0.6)]
    assert lost_rounds(rounds, A, 2, 5) == [2, 3, 4]   # cut, sat out, a round with no successful attempt
    assert lost_rounds(rounds, B, 1, 5) == [4]
    assert time_to(rounds, 0.45) == 2.0 and time_to(rounds, 0.6) == 5.0 and time_to(rounds, 0.9) is None
    assert split_line(rounds, A) == "1 3x - 1"


def test_a_split_a_device_was_cut_at_in_a_phase_is_infinite_there_and_missing_cells_come_from_another_phase():
    rounds = [_round(1, {A: 1, B: 1}, [A, B], {A: 2.0, B: 4.0}), _round(2, {A: 2, B: 2}, [A, B], {A: 3.0, B: 5.0}),
              _round(3, {A: 2, B: 2}, [A, B], {A: 5.0, B: 5.0}),
              _round(4, {A: 2, B: 2}, [B], {B: 5.0}), _round(5, {A: 1, B: 2}, [A, B], {A: 20.0, B: 5.0})]
    before, after = phase_cells(rounds, 1, 3), phase_cells(rounds, 4, 5)
    assert before == {A: {1: 2.0, 2: 4.0}, B: {1: 4.0, 2: 5.0}}   # the median of A's two entries at 2
    assert after == {A: {2: math.inf, 1: 20.0}, B: {2: 5.0}}
    filled = fill_from_other_phases([before, after])
    # A is 10x slower after (20 against 2 at split 1): its cut split stays infinite, not estimated.
    assert filled[1][A] == {1: 20.0, 2: math.inf}
    assert filled[1][B] == {2: 5.0, 1: 4.0}   # B's split 1 priced by its unchanged split 2
    assert filled[0] == before


def test_the_best_fixed_split_minimises_the_runs_time_and_ties_go_deeper():
    phases = [{A: {1: 2.0, 2: 3.0, 3: 9.0}, B: {1: 4.0, 2: 4.0, 3: 4.0}},
              {A: {1: 5.0, 2: math.inf, 3: math.inf}, B: {1: 4.0, 2: 4.0, 3: 4.0}}]
    # A at 2 or 3 is infinite after the change, so 1 (5 s a round); B is never the slowest of the
    # round, so its deepest.
    assert best_fixed(phases, [3, 3], [1, 2, 3]) == {A: 1, B: 3}
    # Without the second phase A fits at 2 under B's 4 s: the deeper of the splits of equal cost.
    assert best_fixed(phases[:1], [3], [1, 2, 3]) == {A: 2, B: 3}
    with pytest.raises(ValueError):
        best_fixed([{}], [3], [1, 2, 3])


def test_the_best_fixed_split_counts_a_portion_that_holds_up_the_group_on_both_sides_of_its_steps():
    # Measured on shaped links: Low (A) 3.07 s at split 2 with 0.09 s uploads; High (B) 2.25 s at
    # split 3 with 0.9 s uploads (its 6.6 MB portion), 1.9 s at split 2 with 0.03 s. The cells alone
    # tie (Low's 3.07 s) and go deeper; rounds with High at 3 took about 4.2 s, at 2 about 3.2 s.
    cells = [{A: {1: 3.9, 2: 3.07, 3: 10.4}, B: {1: 2.0, 2: 1.9, 3: 2.25}}]
    uploads = [{A: {1: 0.04, 2: 0.09, 3: 2.9}, B: {1: 0.005, 2: 0.03, 3: 0.9}}]
    assert best_fixed(cells, [10], [1, 2, 3]) == {A: 2, B: 3}
    assert best_fixed(cells, [10], [1, 2, 3], uploads) == {A: 2, B: 2}


def test_a_devices_upload_seconds_are_its_table_time_less_what_it_timed_itself():
    record = {"round": 1, "status": "ok", "elapsed_s": 4.0, "round_time_s": 4.0, "test_accuracy": 0.3,
              "split_points": {A: 3, B: 2}, "aggregated": [A], "table_times": {A: 2.25},
              "device_times": {A: {"compute_s": 0.3, "transfer_s": 0.95, "server_s": 0.1, "wait_s": 1.9},
                               B: {"compute_s": 0.3, "transfer_s": 0.95, "server_s": 0.1, "wait_s": 1.9}}}
    assert rounds_of([record])[0]["uploads"] == {A: pytest.approx(0.9)}


def test_choose_pinned_reads_the_sliding_runs_table_by_the_scenarios_phases():
    drop = Scenario("drop", "", ("low", "high"), (Change(2, 1, Speeds(link=0.1)),))
    rounds = [_round(1, {A: 1, B: 3}, [A, B], {A: 4.0, B: 2.0}), _round(2, {A: 1, B: 2}, [A, B], {A: 4.0, B: 1.0}),
              _round(3, {A: 1, B: 3}, [A], {A: 4.0}), _round(4, {A: 1, B: 2}, [A, B], {A: 4.0, B: 3.5})]
    # After the drop B was cut at 3 and fits at 2 (3.5 s, under A's 4 s): pinned at 2, not at the
    # 3 it could afford before the drop.
    assert choose_pinned(rounds, drop, 4, [1, 2, 3]) == {A: 1, B: 2}


def _seed(seed=1, sliding_final=0.8, pinned_reaches_at=None, judged=((0, 1, 2),)):
    """One seed of a scenario: its sliding and pinned runs and their goal figures."""
    sliding = [_round(1, {A: 1}, [A], {A: 1}, 0.5, 10.0), _round(2, {A: 1}, [A], {A: 1}, sliding_final, 20.0)]
    pinned = [_round(1, {A: 1}, [A], {A: 1}, 0.5, 8.0),
              _round(2, {A: 1}, [A], {A: 1}, 0.9 if pinned_reaches_at else 0.7, pinned_reaches_at or 16.0)]
    runs = {"sliding": {"rounds": sliding, "failed_attempts": 0, "error": None},
            "pinned": {"rounds": pinned, "failed_attempts": 0, "error": None}}
    return {"seed": seed, "pinned": {A: 1}, "runs": runs, "goals": judge(runs, judged)}


def _result(*seeds):
    """A scenario of ``seeds`` (default one seed whose pinned run reaches the target at 16 s)."""
    seeds = seeds or (_seed(pinned_reaches_at=16.0),)
    return {"name": "x", "judged": [(0, 1, 2)], "seeds": list(seeds), "goals_missed": goals_missed(seeds),
            "time_ratio": median_ratio([x["goals"]["time_ratio"] for x in seeds])}


def test_the_goals_name_a_device_that_lost_rounds_and_a_sliding_run_slower_than_the_pinned_one():
    slower = _seed(pinned_reaches_at=16.0)
    assert slower["goals"]["lost"][0]["rounds"] == [] and slower["goals"]["time_ratio"] == pytest.approx(20.0 / 16.0)
    assert goals_missed([slower]) == ["time to accuracy 1.25x the best fixed split's, the median over 1 seeds (goal <= 1.2x)"]
    # A pinned run that never reaches the sliding run's final accuracy: the sliding run was faster.
    faster = _seed()
    assert faster["goals"]["pinned_time_s"] is None and goals_missed([faster]) == []
    for run_ in faster["runs"]["sliding"]["rounds"]:
        run_["uploaded"] = []
    assert judge(faster["runs"], [(0, 1, 2)])["lost"][0]["rounds"] == [1, 2]
    faster["goals"] = judge(faster["runs"], [(0, 1, 5)])
    assert goals_missed([faster]) == ["seed 1: dev-000 lost 5 rounds (goal <= 2)"]


def test_the_time_goal_is_the_median_over_the_seeds_and_lost_rounds_count_at_any_seed():
    # One seed's noisy threshold (1.25x) among two that meet it does not miss the goal; two do.
    met, slow = _seed(1, pinned_reaches_at=19.0), _seed(2, pinned_reaches_at=16.0)
    assert median_ratio([met["goals"]["time_ratio"], slow["goals"]["time_ratio"], 1.0]) == pytest.approx(20.0 / 19.0)
    assert goals_missed([met, slow, _seed(3, pinned_reaches_at=20.0)]) == []
    assert goals_missed([met, slow, _seed(3, pinned_reaches_at=16.0)]) == [
        "time to accuracy 1.25x the best fixed split's, the median over 3 seeds (goal <= 1.2x)"]
    # A pinned run that never got there counts below every ratio; an even count takes the higher.
    assert median_ratio([None, None, 1.3]) is None and median_ratio([None, 1.3, 1.1]) == 1.1
    assert median_ratio([1.0, 1.3]) == 1.3 and median_ratio([]) is None
    lost = _seed(2, pinned_reaches_at=20.0, judged=[(0, 1, 2)])
    for run_ in lost["runs"]["sliding"]["rounds"]:
        run_["uploaded"] = []
    lost["goals"] = judge(lost["runs"], [(0, 1, 5)])
    assert goals_missed([met, lost]) == ["seed 2: dev-000 lost 5 rounds (goal <= 2)"]


def test_the_warm_up_comparison_sums_the_warm_up_rounds_and_times_each_run_to_the_same_accuracy():
    every = [_round(n, {A: n}, [A], {A: 1}, 0.2 * n, 10.0 * n, round_time=10.0) for n in range(1, 5)]
    estimated = [_round(n, {A: 1}, [A], {A: 1}, 0.25 * n, 4.0 * n, round_time=4.0) for n in range(1, 5)]
    figures = warm_up_figures(every, estimated)
    assert figures["warm_up_s"] == 30.0 and figures["estimated_warm_up_s"] == 12.0 and figures["saved_s"] == 18.0
    assert figures["time_to_target_s"] == 40.0 and figures["estimated_time_to_target_s"] == 16.0


def _results(*scenario_results, seeds=1):
    return {"mode": "quick", "total_s": 60.0, "scenarios": list(scenario_results), "warm_up": None,
            "machine": {"cpu_model": "CPU", "cpus_usable": 2, "cpu_count": 2, "date_utc": "2026-12-05T10:00:00",
                        "load_average_at_start": [1.0], "load_average_at_end": [1.0]},
            "settings": {"rounds": 2, "change_after": 1, "links": "real", "links_note": None, "patience": 1.2,
                         "seeds": seeds, "goal_lost_rounds": 2, "goal_time_ratio": 1.2}}


def test_the_table_shows_every_seed_every_device_of_both_runs_and_the_missed_goals():
    result = _result(_seed(1, pinned_reaches_at=16.0), _seed(2, pinned_reaches_at=19.0))
    lines = table(_results(result, seeds=2))
    summary = summary_table(_results(result, seeds=2))[2:]
    assert all(line in lines for line in summary)
    assert len(summary) == 2 and "1.25x" in summary[0] and "1.05x" in summary[1]
    assert "missed: time to accuracy 1.25x the best fixed split's, the median over 2 seeds" in summary[0]
    assert summary[1].count("20.0 / 19.0") == 2   # its time to the final accuracy, then the whole runs
    # Both runs of both seeds, round by round; only the first seed's where asked.
    assert sum(line.count(f"| {A} | 1 1 |") for line in lines) == 4
    assert sum(line.count(f"| {A} | 1 1 |") for line in table(_results(result, seeds=2), seeds=[1])) == 2
    # A device judged over two windows (a change from the start, then another) shows both.
    result["seeds"][0]["goals"]["lost"] = [{"device": A, "first": 4, "last": 4, "rounds": [4]},
                                           {"device": A, "first": 5, "last": 8, "rounds": []}]
    assert any("dev-000: 1 of rounds 4-4; dev-000: 0 of rounds 5-8" in line for line in table(_results(result)))


def test_the_docs_writer_replaces_only_the_marked_block_and_refuses_a_page_without_one(tmp_path):
    text = f"before\n{DOCS_BEGIN}\nold\n{DOCS_END}\nafter\n"
    assert replace_between(text, DOCS_BEGIN, DOCS_END, ["new"]) == f"before\n{DOCS_BEGIN}\nnew\n{DOCS_END}\nafter\n"
    with pytest.raises(ValueError):
        replace_between("no markers", DOCS_BEGIN, DOCS_END, ["new"])
    page = tmp_path / "page.md"
    page.write_text("no markers\n")
    with pytest.raises(SystemExit):
        parse_args(["--docs", str(page)])
    with pytest.raises(SystemExit):
        parse_args(["--scenarios", "link_drop,nonsense"])
    assert parse_args(["--scenarios", "link_drop"]).scenarios == ("link_drop",)


def test_the_patience_option_sets_every_runs_deadlines_patience_and_refuses_one_below_1():
    assert parse_args([]).patience == PATIENCE == 1.2
    assert parse_args(["--patience", "1.5"]).patience == 1.5
    with pytest.raises(SystemExit):
        parse_args(["--patience", "0.9"])
    scenario = scenarios(4)[0]
    assert run_config(scenario, 8).deadlines.patience == PATIENCE
    assert run_config(scenario, 8, pinned={"dev-000": 2}, patience=1.5).deadlines.patience == 1.5


def test_the_paper_rule_option_runs_every_run_without_the_rule_s_extensions_and_says_so():
    assert parse_args([]).paper_rule is False and parse_args(["--paper-rule"]).paper_rule is True
    scenario = scenarios(4)[0]
    default = run_config(scenario, 8).split
    assert default.bottleneck_cap is True and default.undominated is True
    paper = run_config(scenario, 8, pinned={"dev-000": 2}, paper_rule=True).split
    assert paper.bottleneck_cap is False and paper.undominated is False
    results = _results()
    results["settings"]["paper_rule"] = True
    assert "split.bottleneck_cap and split.undominated false (the paper rule as written)" in report(results)
    results["settings"]["paper_rule"] = False
    assert "paper rule" not in report(results)
    # The sliding runs' warm-up: the run config's default (estimated) unless --warm-up says
    # otherwise, and the report says which.
    assert parse_args([]).warm_up == "estimated" and parse_args(["--warm-up", "every_split"]).warm_up == "every_split"
    assert run_config(scenario, 8).split.warm_up == "estimated"
    with pytest.raises(SystemExit):
        parse_args(["--warm-up", "none"])
    results["settings"]["warm_up"] = "every_split"
    assert "split.warm_up every_split" in report(results)
    results["settings"]["warm_up"] = "estimated"
    assert "split.warm_up estimated" in report(results)


def test_the_docs_writer_puts_the_measured_tables_between_the_markers_with_a_link_to_its_results(tmp_path):
    results = _results(_result(_seed(1, pinned_reaches_at=16.0), _seed(2, pinned_reaches_at=19.0)), seeds=2)
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"intro\n{DOCS_BEGIN}\nold table\n{DOCS_END}\nrest\n")
    results_file = tmp_path / "results" / "2026-12-05_scenarios" / "results.json"
    update_docs(results, page, results_file)
    text = page.read_text()
    block = text.split(DOCS_BEGIN)[1].split(DOCS_END)[0]
    assert text.startswith("intro\n") and text.endswith(f"{DOCS_END}\nrest\n") and "old table" not in text
    assert "(../results/2026-12-05_scenarios/results.json)" in block and "| x | 1 | sliding | dev-000 |" in block
    assert "deadlines.patience 1.2" in block and "2 seeds a scenario" in block
    # Every seed's goals, the first seed's splits round by round.
    assert "|  | 2 | dev-000: 1 |" in block and "| 2 | sliding |" not in block


def test_the_seeds_option_defaults_by_mode_and_refuses_fewer_than_one():
    assert parse_args([]).seeds is None and parse_args(["--seeds", "2"]).seeds == 2
    with pytest.raises(SystemExit):
        parse_args(["--seeds", "0"])
    scenario = scenarios(4)[0]
    config = run_config(scenario, 8, seed=3)
    assert config.seed == 3 and config.data.seed == 3 and run_config(scenario, 8).seed == 1


def test_links_fall_back_to_emulation_with_the_reason_and_real_links_asked_for_where_they_cannot_be_refuse(monkeypatch):
    import testbed.links

    assert links_problem("emulated") == "emulated links asked for (--links emulated)"
    monkeypatch.setattr(testbed.links, "problem_here", lambda: "real links need root")
    assert links_problem("auto") == "real links need root"
    with pytest.raises(SystemExit, match="--links real: real links need root"):
        links_problem("real")
    monkeypatch.setattr(testbed.links, "problem_here", lambda: None)
    assert links_problem("auto") is None and links_problem("real") is None
