"""The attack benchmark's harness (benchmarks/attacks.py): which processes a run starts, which
goals a run misses, the table, the command line. No services are started here."""
from __future__ import annotations

from pathlib import Path

import pytest

import benchmarks.attacks as attacks
from benchmarks.adversary import BEHAVIOURS
from testbed.processes import ProcessGroup


class _Alive:
    returncode = None

    def poll(self):
        return None


def _started(tmp_path: Path, behaviour: str, harmful: int, monkeypatch) -> list[tuple[str, str, list[str]]]:
    calls: list[tuple[str, str, list[str]]] = []

    def spawn(self, name, module, args, env):
        calls.append((name, module, list(args)))
        return _Alive()

    monkeypatch.setattr(ProcessGroup, "_spawn", spawn)
    group = attacks.HarmfulProcessGroup(tmp_path, None, BEHAVIOURS[behaviour], harmful)
    if BEHAVIOURS[behaviour].goes_first:
        (tmp_path / "adversary.ready").write_text("ready\n")
    group.start("fed_server", "fed_server", ["--port", "1"])
    honest = group.start("agent-0", "device_agent", ["--fed-server-url", "u", "--shards", "0,1,2,3", "--kinds", ""])
    assert honest.name == "agent-0" and [s.name for s in group.services] == ["fed_server", "adversary", "agent-0"]
    return calls


@pytest.mark.parametrize("behaviour", ["update_x1e6", "sybil_burst"])
def test_the_last_shards_go_to_an_adversary_process_with_the_agents_other_arguments(tmp_path, monkeypatch, behaviour):
    calls = _started(tmp_path, behaviour, 2, monkeypatch)
    assert calls[1] == ("adversary", "benchmarks.adversary", [
        "--fed-server-url", "u", "--shards", "2,3", "--kinds", "", "--behaviour", behaviour,
        "--ready-file", str(tmp_path / "adversary.ready")])
    assert calls[2] == ("agent-0", "device_agent", ["--fed-server-url", "u", "--shards", "0,1", "--kinds", ""])


def test_a_behaviour_that_goes_first_fails_the_run_when_its_process_dies_before_it_is_ready(tmp_path, monkeypatch):
    class Dead:
        returncode = 1

        def poll(self):
            return 1

    monkeypatch.setattr(ProcessGroup, "_spawn", lambda self, name, module, args, env: Dead())
    group = attacks.HarmfulProcessGroup(tmp_path, None, BEHAVIOURS["sybil_burst"], 1)
    with pytest.raises(attacks.TestbedError, match="adversary exited before it was ready"):
        group.start("agent-0", "device_agent", ["--shards", "0,1"])
    assert [s.name for s in group.services] == ["adversary"]   # the honest agent never started


def _row(policy: str = "default", harmful: int = 1, complete: bool = True, ratio: float = 1.0, points: float = 0.0,
         accuracy: float = 0.9) -> dict:
    return {"behaviour": "silent", "algorithm": "fedavg", "policy": policy, "harmful": harmful, "status": "ran",
            "complete": complete, "time_ratio": ratio, "accuracy_points_vs_control": points, "accuracy": accuracy,
            "rounds_completed": 5 if complete else 2, "rounds_planned": 5}


@pytest.mark.parametrize("row, missed", [
    (_row(), []),
    (_row(complete=False, ratio=1.31), ["rounds", "time"]),
    (_row(policy="robust", points=-3.1, accuracy=0.2), ["accuracy"]),
    (_row(policy="robust", points=-2.9), []),
    (_row(accuracy=0.49), ["accuracy"]),
    (_row(harmful=2, accuracy=0.2, points=-50), []),   # the 50 % floor is about one harmful device
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
                    "torch": "2", "date_utc": "d", "load_average_at_start": [1.0], "load_average_at_end": [2.0]},
        "settings": {"model": "cnn", "data": "mnist", "devices": 10, "rounds": 5, "round_s": 20.0,
                     "time_limit_s": 260.0, "robust_rule": "trimmed_mean", "control": "c"},
        "goals": {"time_ratio_max": 1.3, "robust_points_below_control_max": 3.0,
                  "default_one_harmful_accuracy_min": 0.5},
        "total_s": 60.0,
        "controls": [{"algorithm": "fedavg", "policy": "default", "federated_evaluation": False,
                      "rounds_completed": 5, "rounds_planned": 5, "wall_s": 10.0, "accuracy": 0.9}],
        "runs": [{**_row(ratio=2.0), "goals_missed": ["time"]},
                 {"behaviour": "silent", "algorithm": "fedavg", "policy": "robust", "harmful": 1,
                  "status": "unsupported"},
                 {"behaviour": "activations_1e30", "algorithm": "fedavg", "policy": "default", "harmful": 1,
                  "status": "n/a"}],
    }
    table = attacks.report(results)
    assert "| silent | fedavg | 1 of 10 | 5/5 | 2.00x | +0.0 | time | unsupported |  |  |  |" in table
    assert "| activations_1e30 | fedavg | 1 of 10 | n/a |  |  |  |  |  |  |  |" in table
    assert "| fedavg | default | server | 5/5 | 10.0 | 90.0 |" in table


def test_the_command_line_selects_a_subset_and_refuses_unknown_names() -> None:
    selection, _ = attacks.parse_selection(["--behaviours", "silent,update_x1e6", "--algorithms", "fedavg",
                                            "--harmful", "2", "--policies", "robust", "--rounds", "3"])
    assert selection == attacks.Selection(("silent", "update_x1e6"), ("fedavg",), (2,), ("robust",), 3)
    for bad in (["--behaviours", "honest"], ["--harmful", "10"], ["--policies", "fast"]):
        with pytest.raises(SystemExit):
            attacks.parse_selection(bad)
