"""The attack benchmark's harness (benchmarks/attacks.py): which processes a run starts, which
goals a run misses, the table, the command line. No services are started here."""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import benchmarks.attacks as attacks
import testbed.runner as runner
from benchmarks.adversary import BEHAVIOURS
from testbed.processes import ProcessGroup
from testbed.runner import Testbed


class _Alive:
    returncode = None

    def poll(self):
        return None

    def wait(self, timeout=None):
        return 0

    def send_signal(self, sig):
        pass


class _Dead(_Alive):
    returncode = 1

    def poll(self):
        return 1


def _testbed(tmp_path: Path, behaviour: str, harmful: int, monkeypatch, process=_Alive, agents: int = 1,
             devices: int = 4):
    """A HarmfulTestbed of ``devices`` shards over ``agents`` honest agents whose children are not
    started: each start is recorded as (name, module, args); a credential is issued as the path
    ``<agent>:<shards>``."""
    calls: list[tuple[str, str, list[str]]] = []

    def spawn(self, name, module, args, env):
        calls.append((name, module, list(args)))
        return process()

    monkeypatch.setattr(ProcessGroup, "_spawn", spawn)
    monkeypatch.setattr(Testbed, "_issue_credential", lambda self, agent, shards, timeout=0: f"{agent}:{shards}")
    monkeypatch.setattr(runner, "wait_healthy", lambda *args, **kwargs: None)
    config = attacks.policy_config(attacks.base_config("fedavg"), "default").model_copy(deep=True)
    config.data.num_devices = devices
    testbed = attacks.HarmfulTestbed(config, tmp_path, BEHAVIOURS[behaviour], harmful, agents=agents)
    if BEHAVIOURS[behaviour].goes_first:
        testbed.processes.log_dir.mkdir(parents=True)
        (testbed.processes.log_dir / "adversary.ready").write_text("ready\n")
    return testbed, calls


def _without(args: list[str], *flags: str) -> list[str]:
    """``args`` less each ``flag VALUE`` pair named."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in flags:
            skip = True
        else:
            out.append(arg)
    return out


@pytest.mark.parametrize("behaviour", ["update_x1e6", "sybil_burst"])
def test_the_last_shards_go_to_an_adversary_process_each_agent_with_its_own_credential(tmp_path, monkeypatch, behaviour):
    testbed, calls = _testbed(tmp_path, behaviour, 2, monkeypatch)
    try:
        testbed.start()
    finally:
        testbed.stop(agent_grace_s=0)
    assert [name for name, _, _ in calls] == ["fed_server", "adversary", "agent-0"]
    fed_args = calls[0][2]
    assert "--enrolment-key-file" in fed_args and "--enrolment-secret-file" not in fed_args
    (_, module, adversary), (_, honest_module, honest) = calls[1], calls[2]
    assert (module, honest_module) == ("benchmarks.adversary", "device_agent")
    assert adversary[adversary.index("--shards"):adversary.index("--shards") + 2] == ["--shards", "2-3"]
    assert honest[honest.index("--shards"):honest.index("--shards") + 2] == ["--shards", "0-1"]
    assert adversary[-6:] == ["--enrolment-secret-file", "adversary:[2, 3]", "--behaviour", behaviour,
                              "--ready-file", str(testbed.processes.log_dir / "adversary.ready")]
    assert honest[-2:] == ["--enrolment-secret-file", "agent-0:[0, 1]"]
    # Otherwise the same command line.
    assert _without(adversary, "--shards", "--enrolment-secret-file", "--behaviour", "--ready-file") == \
        _without(honest, "--shards", "--enrolment-secret-file")


def test_with_several_agents_the_adversary_takes_the_last_shards_and_the_agents_share_the_others(tmp_path,
                                                                                                monkeypatch):
    testbed, calls = _testbed(tmp_path, "update_x1e6", 3, monkeypatch, agents=2, devices=10)
    try:
        testbed.start()
    finally:
        testbed.stop(agent_grace_s=0)
    assert [name for name, _, _ in calls] == ["fed_server", "adversary", "agent-0", "agent-1"]
    shards = [args[args.index("--shards") + 1] for _, _, args in calls[1:]]
    assert shards == ["7-9", "0-3", "4-6"]


def test_the_reference_row_starts_no_process_for_its_shards(tmp_path, monkeypatch):
    testbed, calls = _testbed(tmp_path, "absent", 2, monkeypatch)
    try:
        testbed.start()
    finally:
        testbed.stop(agent_grace_s=0)
    assert [name for name, _, _ in calls] == ["fed_server", "agent-0"]
    honest = calls[1][2]
    assert honest[honest.index("--shards"):honest.index("--shards") + 2] == ["--shards", "0-1"]


def test_a_behaviour_that_goes_first_fails_the_run_when_its_process_dies_before_it_is_ready(tmp_path, monkeypatch):
    testbed, calls = _testbed(tmp_path, "honest", 1, monkeypatch, process=_Dead)
    testbed.behaviour = BEHAVIOURS["sybil_burst"]
    try:
        with pytest.raises(attacks.TestbedError, match="adversary exited before it was ready"):
            testbed.start()
    finally:
        testbed.stop(agent_grace_s=0)
    assert [name for name, _, _ in calls] == ["fed_server", "adversary"]   # the honest agent never started


def _row(policy: str = "default", harmful: int = 1, complete: bool = True, ratio: float = 1.0, points: float = 0.0,
         accuracy: float = 0.9) -> dict:
    return {"behaviour": "silent", "algorithm": "fedavg", "policy": policy, "harmful": harmful, "status": "ran",
            "complete": complete, "time_ratio": ratio, "accuracy_points_vs_control": points, "accuracy": accuracy,
            "rounds_completed": 5 if complete else 2, "rounds_planned": 5}


@pytest.mark.parametrize("row, missed", [
    (_row(), []),
    ({**_row(policy="robust", points=-0.9), "behaviour": "backdoor", "attack_success": 0.1}, []),
    ({**_row(policy="robust", points=-1.1), "behaviour": "backdoor", "attack_success": 0.11},
     ["accuracy", "attack success"]),
    ({**_row(points=-5), "behaviour": "backdoor", "attack_success": 0.9}, []),   # the default rule has no such goal
    (_row(complete=False, ratio=1.31), ["rounds", "time"]),
    (_row(policy="robust", points=-3.1, accuracy=0.2), ["accuracy"]),
    (_row(policy="robust", points=-2.9), []),
    (_row(policy="robust", points=100 * (0.882 - 0.912)), []),   # 30 images of 1,000: exactly the bound
    (_row(policy="robust", points=100 * (0.881 - 0.912)), ["accuracy"]),
    (_row(accuracy=0.49), ["accuracy"]),
    (_row(harmful=2, accuracy=0.2, points=-50), []),   # the 50 % floor is about one harmful device
    ({**_row(policy="robust", ratio=3.0, points=-9, accuracy=0.2), "behaviour": "absent"}, []),   # the reference
])
def test_goals_missed(row: dict, missed: list[str]) -> None:
    assert attacks.goals_missed(row) == missed


def test_a_policy_this_build_does_not_know_is_reported_unsupported_not_run(monkeypatch) -> None:
    monkeypatch.setitem(attacks.POLICIES, "robust", {"aggregation.no_such_key": 1})
    assert attacks.policy_config(attacks.base_config("fedavg"), "robust") is None
    assert attacks.policy_config(attacks.base_config("fedavg"), "default").rounds == attacks.ROUNDS


def test_split_only_behaviours_do_not_apply_under_fedavg() -> None:
    fedavg, s2fl = (attacks.policy_config(attacks.base_config(a), "default") for a in ("fedavg", "s2fl"))
    assert not attacks.applies("activations_1e30", fedavg) and attacks.applies("activations_1e30", s2fl)
    assert attacks.applies("silent", fedavg)


def test_the_table_has_one_row_per_behaviour_algorithm_and_count_with_both_policies() -> None:
    results = {
        "machine": {"cpu_model": "cpu", "cpus_usable": 2, "cpu_count": 2, "memory_gib": 8, "python": "3",
                    "torch": "2", "date_utc": "2026-12-05T08:00:00Z", "load_average_at_start": [1.0],
                    "load_average_at_end": [2.0]},
        "settings": {"model": "cnn", "data": "mnist", "devices": 10, "rounds": 5, "round_s": 20.0,
                     "time_limit_s": 260.0, "robust_rule": "trimmed_mean", "control": "c", "controls": 2},
        "goals": {"time_ratio_max": 1.3, "robust_points_below_control_max": 3.0,
                  "default_one_harmful_accuracy_min": 0.5},
        "total_s": 60.0,
        "controls": [{"algorithm": "fedavg", "policy": "default", "federated_evaluation": False, **attacks.control_summary(
            [{"rounds_completed": 5, "rounds_planned": 5, "wall_s": 9.0, "accuracy": 0.85, "attack_success": 0.01,
              "fed_log_bytes": 1000, "cpu_s": {"fed_server": 3.0, "agent-0": 20.0}},
             {"rounds_completed": 5, "rounds_planned": 5, "wall_s": 11.0, "accuracy": 0.95, "attack_success": 0.03,
              "fed_log_bytes": 3000, "cpu_s": {"fed_server": 5.0, "agent-0": 22.0}}])}],
        "runs": [{**_row(ratio=2.0), "goals_missed": ["time"]},
                 {**_row(policy="robust", points=-0.5), "behaviour": "backdoor", "attack_success": 0.042,
                  "goals_missed": []},
                 {**_row(), "behaviour": "registration_loop", "fed_log_bytes": 2560, "fed_cpu_ratio": 2.5,
                  "goals_missed": []},
                 {"behaviour": "silent", "algorithm": "fedavg", "policy": "robust", "harmful": 1,
                  "status": "unsupported"},
                 {"behaviour": "activations_1e30", "algorithm": "fedavg", "policy": "default", "harmful": 1,
                  "status": "n/a"}],
    }
    table = attacks.report(results)
    assert "| silent | fedavg | 1 of 10 | 5/5 | 2.00x | +0.0 | time (2026-12-05) | unsupported |  |  |  |" in table
    assert "| activations_1e30 | fedavg | 1 of 10 | n/a |  |  |  |  |  |  |  |" in table
    assert "| backdoor | fedavg | 1 of 10 |  |  |  |  | 5/5 | 1.00x | -0.5; attack success 4.2 % | met (2026-12-05) |" in table
    assert ("| registration_loop | fedavg | 1 of 10 | 5/5 | 1.00x | +0.0; log 2.5 KiB; Fed Server CPU 2.50x | "
            "met (2026-12-05) |") in table
    assert ("| fedavg | default | server | 2026-12-05 | 5/5 | 10.0 | 90.0 | 85.0 to 95.0 | 10.0 | 2.0 | 2.0 | 4.0 | "
            "9.0, 85.0; 11.0, 95.0 |") in table
    assert "run 2 times: a cell compares with the controls' mean" in table


def test_the_command_line_selects_a_subset_and_refuses_unknown_names() -> None:
    selection, _ = attacks.parse_selection(["--behaviours", "silent,update_x1e6", "--algorithms", "fedavg",
                                            "--harmful", "2", "--policies", "robust", "--rounds", "3",
                                            "--controls", "2"])
    assert selection == attacks.Selection(("silent", "update_x1e6"), ("fedavg",), (2,), ("robust",), 3, 2)
    for bad in (["--behaviours", "honest"], ["--harmful", "10"], ["--policies", "fast"], ["--controls", "0"]):
        with pytest.raises(SystemExit):
            attacks.parse_selection(bad)


def test_the_docs_table_is_written_between_its_markers_and_a_page_without_them_is_refused(tmp_path) -> None:
    results = {"machine": {"cpu_model": "cpu", "cpus_usable": 2, "date_utc": "2026-12-05T08:00:00Z",
                           "load_average_at_start": [1.0], "load_average_at_end": [2.0]},
               "settings": {"devices": 10, "rounds": 15, "controls": 3}, "total_s": 600.0, "controls": [],
               "runs": [{**_row(), "goals_missed": []}]}
    page = tmp_path / "security.md"
    page.write_text(f"# Security\n\nbefore\n{attacks.DOCS_BEGIN}\nold table\n{attacks.DOCS_END}\nafter\n")
    attacks.update_docs(results, page, tmp_path / "2026-12-05_attacks" / "results.json")
    text = page.read_text()
    assert "old table" not in text and text.startswith("# Security\n\nbefore\n") and text.endswith("after\n")
    assert "| silent | fedavg | 1 of 10 | 5/5 | 1.00x | +0.0 | met (2026-12-05) |" in text
    assert ("- 2026-12-05, fedavg/default, 15 rounds, 3 controls: cpu (2 CPUs usable" in text
            and "[2026-12-05_attacks/](2026-12-05_attacks/results.json)" in text)
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    with pytest.raises(ValueError, match="no place for the attack table"):
        attacks.update_docs(results, bare, Path("results.json"))
    with pytest.raises(SystemExit):
        attacks.parse_selection(["--docs", str(bare)])


def _invocation(date: str, runs: list[dict], controls: list[dict]) -> dict:
    return {"machine": {"cpu_model": "cpu", "cpus_usable": 2, "date_utc": f"{date}T08:00:00Z",
                        "load_average_at_start": [1.0], "load_average_at_end": [2.0]},
            "settings": {"devices": 10, "rounds": 15, "controls": 3}, "total_s": 600.0, "controls": controls,
            "runs": runs}


def _control(algorithm: str, policy: str, accuracy: float) -> dict:
    return {"algorithm": algorithm, "policy": policy, "federated_evaluation": False, **attacks.control_summary(
        [{"rounds_completed": 5, "rounds_planned": 5, "wall_s": 10.0, "accuracy": accuracy, "attack_success": 0.0,
          "fed_log_bytes": 1000, "cpu_s": {"fed_server": 2.0}}])}


def test_a_partial_invocation_replaces_only_its_cells_in_the_docs_table_each_with_its_date_and_controls(
        tmp_path) -> None:
    page = tmp_path / "docs" / "security.md"
    page.parent.mkdir()
    page.write_text(f"before\n{attacks.DOCS_BEGIN}\n{attacks.DOCS_END}\nafter\n")
    first = tmp_path / "results" / "2026-12-04_attacks" / "results.json"
    first.parent.mkdir(parents=True)
    whole = _invocation("2026-12-04", [{**_row(points=-1.0), "goals_missed": []},
                                       {**_row(policy="robust", points=-2.0), "goals_missed": []}],
                        [_control("fedavg", "default", 0.91), _control("fedavg", "robust", 0.81)])
    first.write_text(json.dumps(whole))
    attacks.update_docs(whole, page, first)
    second = tmp_path / "results" / "2026-12-05_attacks_robust" / "results.json"
    second.parent.mkdir(parents=True)
    part = _invocation("2026-12-05", [{**_row(policy="robust", points=+0.5), "goals_missed": []}],
                       [_control("fedavg", "robust", 0.77)])
    second.write_text(json.dumps(part))
    attacks.update_docs(part, page, second)
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("after\n")
    # The default cell stays from the first invocation, the robust one is the second's.
    assert ("| silent | fedavg | 1 of 10 | 5/5 | 1.00x | -1.0 | met (2026-12-04) | 5/5 | 1.00x | +0.5 | "
            "met (2026-12-05) |") in text
    # Controls: the first invocation's robust control is no longer any shown cell's.
    assert "| fedavg | default | server | 2026-12-04_attacks | 5/5 | 10.0 | 91.0 |" in text
    assert "| fedavg | robust | server | 2026-12-05_attacks_robust | 5/5 | 10.0 | 77.0 |" in text
    assert "81.0" not in text
    assert (f"{attacks.DOCS_SOURCES} ../results/2026-12-04_attacks/results.json "
            "../results/2026-12-05_attacks_robust/results.json -->") in text
    # An invocation that measures every cell again leaves only itself.
    third = tmp_path / "results" / "2026-12-06_attacks" / "results.json"
    third.parent.mkdir(parents=True)
    again = _invocation("2026-12-06", whole["runs"], whole["controls"])
    third.write_text(json.dumps(again))
    attacks.update_docs(again, page, third)
    text = page.read_text()
    assert f"{attacks.DOCS_SOURCES} ../results/2026-12-06_attacks/results.json -->" in text
    assert "2026-12-04" not in text and "2026-12-05" not in text


def test_an_invocation_writes_its_figures_after_every_run(tmp_path, monkeypatch) -> None:
    """A stopped invocation of hours keeps the runs it finished: ``progress`` sees each one."""
    results_of = iter([0.9, 0.8])
    monkeypatch.setattr(attacks, "WarmStarter", lambda modules: types.SimpleNamespace(close=lambda: None))
    monkeypatch.setattr(attacks, "run_once", lambda *args, **kwargs: attacks.RunResult(
        rounds_completed=1, rounds_planned=1, wall_s=1.0, accuracy=next(results_of), attack_success=0.0,
        recorded_accuracy=None, fed_log_bytes=0, harmful_actions=1, failed_attempts=0, error=None,
        cpu_s={"fed_server": 1.0}))
    seen: list[tuple[int, int, bool]] = []
    attacks.run(attacks.Selection(("silent",), ("fedavg",), (1,), ("default",), 1, 1), log=lambda text: None,
                progress=lambda so_far: seen.append((len(so_far["controls"]), len(so_far["runs"]),
                                                     so_far["finished"])))
    assert seen == [(1, 0, False), (1, 1, False), (1, 1, True)]
