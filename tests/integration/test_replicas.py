"""Main Server replicas (docs/deployment.md, "Main Server replicas"): S2FL with two Main Server
processes on loopback trains the model one would, and survives one being killed mid-round."""
from __future__ import annotations

import datetime
import os
import signal
import time

import httpx
import torch

from fed_server.run_dir import RunDirectory
from integration_support import small_config, wait_for


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
