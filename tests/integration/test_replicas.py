"""Main Server replicas (docs/deployment.md, "Main Server replicas"): S2FL with two Main Server
processes on loopback trains the model one would, survives one being killed mid-round, and plans
around one frozen mid-round until it answers its health check again."""
from __future__ import annotations

import datetime
import os
import re
import signal
import time

import httpx
import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config, wait_for
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def _config(**overrides):
    # Fixed split points (split.sliding off): the sliding split follows measured times, which differ
    # between two runs; everything else of S2FL (balanced groups, Algorithm 1) stays.
    return small_config(**{"split.sliding": False, "data.max_samples": 600, **overrides})


def _groups(metrics: list[dict]) -> list[list[tuple[int, list[str]]]]:
    return [sorted((g["group_id"], g["members"]) for g in m["groups"]) for m in metrics]


def test_two_replicas_train_the_model_one_replica_trains(run_testbed):
    config = _config()
    one, one_metrics, one_dir = run_testbed(config)
    two, two_metrics, two_dir = run_testbed(config, main_servers=2)
    for status, metrics in ((one, one_metrics), (two, two_metrics)):
        assert status["state"] == "finished"
        assert [(m["round"], m["status"]) for m in metrics] == [(1, "ok"), (2, "ok")]
        assert all(m["lost_replicas"] == [] for m in metrics)
    # The one-replica run groups at the Main Server from the joins, the two-replica run at the Fed
    # Server from the counts sent at registration: by construction the same groups.
    assert _groups(one_metrics) == _groups(two_metrics)
    assert all(len(m["groups"]) == 2 for m in two_metrics)
    # Both replicas served a group: the two-replica run really spread them.
    logs = two_dir / "logs"
    for name in ("main_server.log", "main_server-1.log"):
        assert "group(s)" in (logs / name).read_text(), f"{name} formed no round's groups"
    _, one_state, _ = RunDirectory(one_dir).read_checkpoint()
    _, two_state, _ = RunDirectory(two_dir).read_checkpoint()
    assert one_state.keys() == two_state.keys()
    # Bit for bit: every step is deterministic (1 torch thread per process, the group's union
    # batch in device order, aggregation in device order), whichever process trains a group.
    different = [k for k in one_state if not torch.equal(one_state[k], two_state[k])]
    assert different == [], f"weights differ: {different}"


def test_a_replica_killed_mid_round_costs_only_its_groups(run_testbed):
    round_s = 90.0
    config = _config(**{"deadlines.round_s": round_s, "deadlines.step_s": 20, "train.batch_size": 16})
    killed: dict = {}

    def kill_second_replica_while_stepping(testbed):
        victim, url = testbed.mains[1], testbed.main_urls[1]

        def stepping() -> bool:
            r = httpx.get(f"{url}/v1/status", timeout=5).json()["round"]
            return r is not None and any(g["step"] >= 1 for g in r["groups"])
        wait_for(stepping, 120, "the second replica's first step to be answered")
        members = [m for g in httpx.get(f"{url}/v1/status", timeout=5).json()["round"]["groups"] for m in g["members"]]
        os.kill(victim.process.pid, signal.SIGKILL)
        killed_at, killed["wall"] = time.monotonic(), time.time()
        victim.process.wait()
        killed.update(url=url, members=members)

        def recorded() -> bool:
            history = httpx.get(f"{testbed.fed_url}/v1/status", timeout=5).json()["history"]
            return any(r["lost_replicas"] for r in history)
        wait_for(recorded, round_s, "the attempt with the lost replica to be recorded")
        killed["to_record_s"] = time.monotonic() - killed_at

    status, metrics, run_dir = run_testbed(config, main_servers=2, during=kill_second_replica_while_stepping)
    assert status["state"] == "finished", status
    hit = [m for m in metrics if m["lost_replicas"]]
    assert len(hit) == 1 and hit[0]["lost_replicas"] == [killed["url"]], [(m["round_id"], m["lost_replicas"]) for m in metrics]
    lost = hit[0]
    # The lost replica's devices are not aggregated, its group is not recorded, the other's is.
    assert killed["members"] and not set(killed["members"]) & set(lost["aggregated"])
    assert set(killed["members"]) <= set(lost["dropped"])
    assert lost["status"] == "ok" and lost["aggregated"], "the surviving replica's group completes the attempt"
    assert not any(set(killed["members"]) & set(g["members"]) for g in lost["groups"])
    # Completed on the loss, not at the deadline.
    assert lost["round_time_s"] < round_s / 3, lost["round_time_s"]
    # No round lost or counted twice; attempt ids unique; the run finished on the surviving replica.
    assert [m["round"] for m in metrics if m["status"] == "ok"] == [1, 2]
    ids = [m["round_id"] for m in metrics]
    assert len(ids) == len(set(ids))
    last = metrics[-1]
    assert last["status"] == "ok" and sorted(last["aggregated"]) == sorted(last["selected"])
    assert killed["to_record_s"] < round_s / 3
    # The loss is known from the watch stream closing (the killed process's socket), well before
    # its silence would time out (FedServerSettings.replica_timeout_s, 10 s).
    line = next(x for x in (run_dir / "logs" / "fed_server.log").read_text().splitlines() if " lost (" in x)
    detected_s = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp() - killed["wall"]
    assert detected_s < 5.0, line
    print(f"\nreplica killed mid-round: loss logged {detected_s:.2f}s after the kill; attempt {lost['round_id']} "
          f"recorded {killed['to_record_s']:.2f}s after the kill, once the surviving group finished "
          f"(whole attempt {lost['round_time_s']:.2f}s; round deadline {round_s:.0f}s)")


#: The Fed Server's line for an attempt it begins, and a Main Server's for a plan it opens.
BEGUN = re.compile(r"\(attempt (\d+)\): \d+ devices, splits")
OPENED = re.compile(r"\(attempt (\d+)\) opened")


def _log_lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _attempts(lines: list[str], pattern: re.Pattern) -> list[int]:
    return [int(a) for line in lines for a in pattern.findall(line)]


def test_a_frozen_replica_is_planned_around_and_used_again_once_it_answers(tmp_path):
    """SIGSTOP the second replica mid-round, SIGCONT it once its devices have trained on the first,
    stop once an attempt planned onto it again is recorded. Judged by what the run recorded: the
    attempt it froze in, the attempts begun while it was set aside (the Fed Server's log), the plans
    the replica logged once running again (a plan sent to it while frozen would be among them)."""
    # More rounds than the test needs: it stops the run itself once it has seen everything.
    config = _config(rounds=100, **{"deadlines.round_s": 15, "deadlines.join_s": 10, "deadlines.step_s": 10,
                                    "train.batch_size": 16})
    run_dir = tmp_path / "run"
    fed_log, main_log = run_dir / "logs" / "fed_server.log", run_dir / "logs" / "main_server-1.log"
    with Testbed(config, run_dir, main_servers=2, warm=shared_starter()) as testbed:
        victim, url = testbed.mains[1], testbed.main_urls[1]

        def history() -> list[dict]:
            return httpx.get(f"{testbed.fed_url}/v1/status", timeout=5).json()["history"]

        def stepping() -> bool:
            r = httpx.get(f"{url}/v1/status", timeout=5).json()["round"]
            return r is not None and r["round_id"] >= 2 and any(g["step"] >= 1 for g in r["groups"])
        wait_for(stepping, 120, "the second replica's first step of a later round")
        members = [m for g in httpx.get(f"{url}/v1/status", timeout=5).json()["round"]["groups"] for m in g["members"]]
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            def trained_elsewhere() -> bool:
                records = history()
                lost = [r["round_id"] for r in records if url in r["lost_replicas"]]
                return bool(lost) and any(r["round_id"] > lost[0] and set(members) & set(r["aggregated"])
                                          for r in records)
            wait_for(trained_elsewhere, 180, "a device of the frozen replica to train on the other one")
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        wait_for(lambda: any("answers its health check again" in x for x in _log_lines(fed_log)), 60,
                 "the replica to answer its health check")
        back_at = next(i for i, x in enumerate(_log_lines(fed_log)) if "answers its health check again" in x)
        begun_before = max(_attempts(_log_lines(fed_log)[:back_at], BEGUN))

        def recorded_on_it_again() -> bool:
            again = [a for a in _attempts(_log_lines(main_log), OPENED) if a > begun_before]
            return bool(again) and any(r["round_id"] == again[0] for r in history())
        wait_for(recorded_on_it_again, 120, "an attempt planned onto the replica again to be recorded")
        # Read before the testbed stops: stopping both replicas fails the attempt then in flight.
        metrics = read_metrics(run_dir)
        fed_lines, main_lines = _log_lines(fed_log), _log_lines(main_log)
    # Detected once, in the attempt it froze in, and set aside; one line each way.
    hit = [m for m in metrics if m["lost_replicas"]]
    assert [m["lost_replicas"] for m in hit] == [[url]], [(m["round_id"], m["lost_replicas"]) for m in metrics]
    aside = [i for i, x in enumerate(fed_lines) if f"Main Server replica {url} set aside" in x]
    back = [i for i, x in enumerate(fed_lines) if f"Main Server replica {url} answers its health check again" in x]
    assert len(aside) == 1 and len(back) == 1 and aside[0] < back[0], (aside, back)
    assert f"lost in round {hit[0]['round']} (attempt {hit[0]['round_id']})" in fed_lines[aside[0]]
    # No device was charged for it: its devices left the frozen attempt for the replica's loss, and
    # no device missed a deadline anywhere in the run.
    assert all(hit[0]["left"][d].startswith(f"its Main Server replica {url} was lost") for d in members), hit[0]["left"]
    assert not [x for x in fed_lines if "missed a deadline" in x or "sit out" in x]
    # Set aside, it was sent no plan: every attempt begun between the two lines was planned onto the
    # other replica alone, and none failed or lost a replica.
    window = _attempts(fed_lines[aside[0]:back[0]], BEGUN)
    opened = set(_attempts(main_lines, OPENED))
    assert window and not opened & set(window), (window, sorted(opened))
    by_id = {m["round_id"]: m for m in metrics}
    assert all(by_id[a]["status"] == "ok" and by_id[a]["plan_error"] is None for a in window if a in by_id)
    assert not [x for x in fed_lines[aside[0]:] if "did not accept the plan" in x]
    # Its devices went on training on the other replica while it was frozen...
    assert any(set(members) & set(by_id[a]["aggregated"]) for a in window if a in by_id)
    # ... and once it answered again, an attempt was planned onto it and completed.
    used_again = min(a for a in opened if a > max(window))
    assert by_id[used_again]["status"] == "ok" and not by_id[used_again]["lost_replicas"]
    print(f"\nreplica frozen in attempt {hit[0]['round_id']} ({hit[0]['round_time_s']:.1f}s), set aside for attempts "
          f"{window[0]}-{window[-1]} (round times {[round(by_id[a]['round_time_s'], 1) for a in window if a in by_id]} s), "
          f"used again from attempt {used_again}")
