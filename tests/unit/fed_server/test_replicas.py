"""Main Server replicas at the Fed Server, without HTTP: label counts at registration, groups
formed and spread over the replicas, each device told its replica, a lost replica's unfinished
groups dropped, and portion uploads checked against the plan (docs/deployment.md)."""
from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from fed_server.coordinator import Coordinator
from fed_server.driver import confirm_replicas, probe_replica, send_plans, watch_replica
from fed_server.fed_round import OVERDUE
from fed_server.settings import FedServerSettings
from fed_server.replica_planning import spread_groups
from fed_server.run_dir import RunDirectory
from shared.algorithms.grouping import form_round_groups, group_candidate
from shared.algorithms.registry import build_grouping
from shared.errors import Conflict, Invalid
from shared.portions import portion_state
from shared.run_config import load_run_config
from shared.schemas import Ack, DeviceProfileMsg, RegisterRequest, ServerPortionUpload, WithdrawRequest
from shared.wire import encode_state, packb

A, B = "http://main-a:8081", "http://main-b:8081"
DEVICES = [f"d{i}" for i in range(6)]
SAMPLES = {"d0": 50, "d1": 40, "d2": 30, "d3": 20, "d4": 10, "d5": 5}   # label counts' totals


def _counts(device: str) -> list[int]:
    # Skewed per-device label counts, so balanced grouping has something to balance.
    i = int(device[1:])
    counts = [0] * 10
    counts[i % 10], counts[(i + 1) % 10] = SAMPLES[device] - 1, 1
    return counts


def _coordinator(tmp_path, urls, algorithm: str = "s2fl") -> Coordinator:
    config = load_run_config({"algorithm": algorithm, "rounds": 2, "seed": 3, "grouping": {"group_size": 2},
                              "data": {"num_devices": len(DEVICES), "max_samples": 200}})
    return Coordinator(config, RunDirectory(tmp_path / "run"), urls)


def _register(c: Coordinator, device: str, counts: list[int] | None) -> None:
    c.enrolment.register(RegisterRequest(device_id=device, shard=int(device[1:]), num_samples=c.enrolment.shard_sizes[int(device[1:])],
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6), label_counts=counts))


@pytest.fixture
def replicated(tmp_path) -> Coordinator:
    c = _coordinator(tmp_path, [A, B])
    for d in DEVICES:
        _register(c, d, _counts(d))
    return c


def _portion(c: Coordinator, round_id: int, group_id: int, members: list[str], dropped=(), absent=()) -> ServerPortionUpload:
    start = min(c.core.round.assignments[m].split_point for m in [*members, *dropped])
    return ServerPortionUpload(run_id=c.core.run_id, round_id=round_id, group_id=group_id, members=members,
                               dropped=list(dropped), absent=list(absent), start_block=start,
                               weights=encode_state(portion_state(c.core.model, start, c.core.num_blocks)),
                               label_distance=0.0, steps=1, train_time_s=0.1)


def test_label_counts_at_registration_only_with_several_replicas_of_a_split_algorithm(tmp_path):
    assert _coordinator(tmp_path / "a", [A, B]).enrolment.run_info().label_counts_at_registration
    assert not _coordinator(tmp_path / "b", [A]).enrolment.run_info().label_counts_at_registration
    assert not _coordinator(tmp_path / "c", [A, B], algorithm="fedavg").enrolment.run_info().label_counts_at_registration


def test_registration_without_or_with_bad_counts_is_refused_and_changes_nothing(tmp_path):
    c = _coordinator(tmp_path / "two", [A, B])
    with pytest.raises(Invalid, match="register with label_counts"):
        _register(c, "d0", None)
    with pytest.raises(Invalid, match="label_counts has 3 entries; the model has 10 classes"):
        _register(c, "d0", [1, 2, 3])
    assert len(c.core.devices) == 0
    one = _coordinator(tmp_path / "one", [A])
    with pytest.raises(Invalid, match="register without label_counts"):
        _register(one, "d0", _counts("d0"))   # one replica: the counts go to the Main Server only
    assert len(one.core.devices) == 0


def test_groups_are_the_main_servers_and_spread_largest_first(replicated):
    c = replicated
    r = c.begin_round()
    plans = c.replicas.plans(r, [A, B])
    r.ready = True
    # The same function, plug-in, size and rng the Main Server uses on the joins, from what the
    # plans say of each participant.
    said = {p.device_id: p for plan in plans.values() for p in plan.participants}
    members = {d: group_candidate(said[d], _counts(d)) for d in DEVICES}
    expected = form_round_groups(build_grouping(c.core.algorithm.grouping()), members, 2, c.config.seed, r.index)
    assert list(r.planned_groups.values()) == expected
    loads = {g: sum(c.core.devices.devices[m].num_samples for m in members) for g, members in r.planned_groups.items()}
    # Every group on one replica, its members told that replica, the plans holding only theirs.
    for url, plan in plans.items():
        assert sorted(p.device_id for p in plan.participants) == sorted(m for g in plan.groups for m in g.members)
        for g in plan.groups:
            assert r.planned_groups[g.group_id] == g.members and r.group_replica[g.group_id] == url
            assert all(c.dispatch.task_for(m).main_server_url == url for m in g.members)
    largest = max(loads, key=lambda g: (loads[g], -g))
    assert r.group_replica[largest] == A    # LPT: the largest group first, to the first replica
    per_replica = {u: sum(loads[g] for g, v in r.group_replica.items() if v == u) for u in (A, B)}
    assert set(per_replica) == {A, B} and all(per_replica.values())
    # Deterministic: planning again spreads the same way.
    again = c.replicas.plans(r, [A, B])
    assert {u: p.model_dump() for u, p in again.items()} == {u: p.model_dump() for u, p in plans.items()}


def _measure(c: Coordinator, times: dict[str, dict[int, float]], rates: dict[str, float]) -> None:
    """Time table cells (device -> candidate j -> seconds) and measured link rates, as rounds leave them."""
    for device, row in times.items():
        for j, seconds in row.items():
            c.table.record(device, j, seconds)
    for device, rate in rates.items():
        c.core.devices.measure_rate(device, rate)


def test_the_plans_tell_the_main_server_all_the_fed_server_knows_of_each_participant(replicated):
    c = replicated
    _measure(c, {"d0": {0: 4.0, 2: 1.5}, "d3": {1: 2.5}}, {"d0": 3e6})
    r = c.begin_round()
    said = {p.device_id: p for plan in c.replicas.plans(r, [A, B]).values() for p in plan.participants}
    assert sorted(said) == DEVICES
    splits = c.planner.split_points
    assert said["d0"].round_times == [(splits[0], 4.0), (splits[2], 1.5)] and said["d0"].link_rate == 3e6
    assert said["d3"].round_times == [(splits[1], 2.5)] and said["d3"].link_rate is None
    assert said["d1"].round_times == [] and said["d1"].link_rate is None      # never measured
    for d, p in said.items():
        record = c.core.devices.devices[d]
        assert p.kind == record.kind == "unknown"   # as registered (_register sends no kind)
        assert (p.split_point, p.num_samples, p.token_nonce) == (r.assignments[d].split_point, record.num_samples,
                                                                 record.token_nonce)


def test_a_grouping_by_time_groups_by_the_fed_servers_time_table(tmp_path):
    config = load_run_config({"algorithm": "s2fl", "rounds": 2, "seed": 3, "grouping": {"group_size": 2, "method": "speed"},
                              "data": {"num_devices": len(DEVICES), "max_samples": 200}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), [A, B])
    for d in DEVICES:
        _register(c, d, _counts(d))
    # Round 1 is the warm-up's first (every device at the first cut): measured there in an order
    # that is not the id order, so the groups follow the table, not the ids or the counts.
    seconds = {"d0": 6.0, "d1": 1.0, "d2": 5.0, "d3": 2.0, "d4": 4.0, "d5": 3.0}
    _measure(c, {d: {0: t} for d, t in seconds.items()}, {})
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    assert list(r.planned_groups.values()) == [["d1", "d3"], ["d5", "d4"], ["d2", "d0"]]


def test_a_replica_that_refused_gets_its_groups_spread_over_the_others(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    groups = dict(r.planned_groups)
    plans = c.replicas.plans(r, [A])
    assert list(plans) == [A] and r.planned_groups == groups   # same groups, one replica
    assert sorted(g.group_id for g in plans[A].groups) == sorted(groups)
    assert {a.main_server_url for a in r.assignments.values()} == {A}


def test_one_replica_gets_every_participant_and_no_groups(tmp_path):
    c = _coordinator(tmp_path, [A])
    for d in DEVICES:
        _register(c, d, None)
    r = c.begin_round()
    plans = c.replicas.plans(r, [A])
    assert list(plans) == [A] and plans[A].groups is None and r.planned_groups is None
    assert len(plans[A].participants) == len(r.assignments)


def test_a_lost_replica_drops_only_its_groups_without_a_portion(replicated):
    c = replicated
    r = c.begin_round()
    r.ready = True
    c.replicas.plans(r, [A, B])
    on_b = sorted(g for g, u in r.group_replica.items() if u == B)
    assert len(on_b) >= 2, r.group_replica
    uploaded, unfinished = on_b[0], on_b[1:]
    c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, uploaded, r.planned_groups[uploaded]), 10)
    c.core.changed.clear()
    c.replicas.lost(r, B, "test")
    assert c.core.changed.is_set() and r.lost_replicas == [B] and B in c.replicas.down
    assert set(r.excluded) == {m for g in unfinished for m in r.planned_groups[g]}   # the uploaded group stays
    assert set(r.excluded.values()) == {f"its Main Server replica {B} was lost (test)"}
    # A portion of the lost replica's unfinished group is refused, changing nothing.
    with pytest.raises(Conflict, match="declared lost"):
        c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, unfinished[0], r.planned_groups[unfinished[0]]), 10)
    assert unfinished[0] not in r.portions
    # Declared again, or for a closed round: nothing more happens.
    c.replicas.lost(r, B, "again")
    assert r.lost_replicas == [B]
    c.close_round()
    c.replicas.lost(r, A, "after the round")
    assert r.lost_replicas == [B]


def test_a_single_lost_main_server_drops_every_device_without_a_portion(tmp_path):
    c = _coordinator(tmp_path, [A])
    for d in DEVICES:
        _register(c, d, None)
    r = c.begin_round()
    c.replicas.plans(r, [A])
    c.replicas.lost(r, A, "killed")
    assert set(r.excluded) == set(r.assignments) and r.complete()   # the attempt ends now, not at the deadline


def test_portions_must_match_the_planned_group(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    g0, g1 = r.planned_groups[0], r.planned_groups[1]
    with pytest.raises(Invalid, match="are not in it"):
        c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, 0, [g0[0], g1[0]]), 10)
    with pytest.raises(Invalid, match="no planned group 99"):
        c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, 99, g0), 10)
    assert r.portions == {}
    # A subset is fine (a member dropped at a step deadline, or absent); the same group twice is not.
    c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, 0, g0[:1], dropped=g0[1:]), 10)
    with pytest.raises(Conflict, match="already received"):
        c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, 0, g0), 10)
    assert list(r.portions) == [0]


DONE = b'{"round_id": ROUND, "state": "open"}\n{"round_id": ROUND, "state": "done"}\n'


@pytest.mark.parametrize("answer, lost, why", [
    (DONE, False, "its group portion never arrived"),      # ended, but none of its portions came
    (b'{"round_id": ROUND, "state": "open"}\n', True, "was lost (watch stream ended"),    # ends without done
    (b'{"round_id": ROUND, "state": "open"}\n{"round_id": ROUND, "state": "replaced"}\n', True, "replaced"),
    (None, True, "was lost (watch failed"),                                                   # falls silent
    (b'{"round_id": ROUND, "state": "open", "dropped": {"DEV": "missed step 3"}}\n'
     b'{"round_id": ROUND, "state": "done", "dropped": {"DEV": "missed step 3"}, "undelivered": [GROUP]}\n',
     False, "its group portion never arrived (groups [GROUP] could not be delivered)"),
], ids=["done", "no done", "replaced", "silent", "dropped and undelivered"])
def test_the_watch_decides_whether_a_replica_is_lost_and_who_leaves_the_attempt(replicated, answer, lost, why):
    # A raw loopback peer stands in for the replica, so a frozen one (heartbeats stop, the
    # connection stays open) can be played without freezing a process.
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    on_b = sorted(d for d, a in r.assignments.items() if a.main_server_url == B)
    group = min(g for g, url in r.group_replica.items() if url == B)
    why = why.replace("GROUP", str(group))

    async def scenario() -> float:
        async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n")
            if answer is None:   # one heartbeat, then silence on an open connection
                writer.write(b"content-length: 1000\r\n\r\n" + f'{{"round_id": {r.round_id}, "state": "open"}}\n'.encode())
                await writer.drain()
                await asyncio.sleep(30)
            body = (answer.replace(b"ROUND", str(r.round_id).encode()).replace(b"DEV", on_b[0].encode())
                    .replace(b"GROUP", str(group).encode()))
            writer.write(f"content-length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            writer.close()
        server = await asyncio.start_server(replica, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        for a in r.assignments.values():
            if a.main_server_url == B:
                a.main_server_url = url
        started = time.monotonic()
        await asyncio.wait_for(watch_replica(c, r, url, FedServerSettings(heartbeat_s=0.1, replica_timeout_s=0.5)), 10)
        server.close()
        return time.monotonic() - started

    took = asyncio.run(scenario())
    assert bool(r.lost_replicas) == lost and sorted(r.excluded) == on_b   # A's devices stay in
    dropped = b"dropped" in (answer or b"")
    if dropped:   # the member the replica dropped leaves with the replica's reason
        assert r.excluded[on_b[0]] == "dropped by the Main Server: missed step 3"
    assert all(why in r.excluded[d] for d in on_b[int(dropped):]), r.excluded
    assert took < 5


def test_a_replica_speaks_only_for_its_own_devices_and_only_in_the_open_attempt(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    on_a = sorted(d for d, a in r.assignments.items() if a.main_server_url == A)
    on_b = sorted(d for d, a in r.assignments.items() if a.main_server_url == B)
    c.replicas.dropped(r, B, {on_a[0]: "not its device", on_b[0]: "missed step 1"})
    assert r.excluded == {on_b[0]: "dropped by the Main Server: missed step 1"}
    # A portion that arrived keeps its group in, whatever the done line says.
    uploaded = next(g for g, url in r.group_replica.items() if url == A)
    c.uploads.accept_portion(r.round_id, _portion(c, r.round_id, uploaded, r.planned_groups[uploaded]), 10)
    c.replicas.done(r, A, [uploaded])
    assert set(r.excluded) == {on_b[0], *(set(on_a) - set(r.planned_groups[uploaded]))}
    c.close_round()
    c.replicas.dropped(r, B, {on_b[1]: "too late"})
    c.replicas.done(r, B, [])
    assert on_b[1] not in r.excluded


def test_devices_that_leave_at_the_fed_server_are_reported_to_their_replica_and_no_other_exclusion_is(replicated):
    c = replicated
    told: list[tuple[int, str, dict[str, str]]] = []
    c.core.on_departure = lambda fed_round, url, reasons: told.append((fed_round.round_id, url, reasons))
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    r.ready = True
    on_a = sorted(d for d, a in r.assignments.items() if a.main_server_url == A)
    on_b = sorted(d for d, a in r.assignments.items() if a.main_server_url == B)
    c.uploads.withdraw(r.round_id, WithdrawRequest(device_id=on_a[0], round_id=r.round_id, reason="no data"))
    assert told == [(r.round_id, A, {on_a[0]: "withdrew: no data"})]
    c.uploads.withdraw(r.round_id, WithdrawRequest(device_id=on_a[0], round_id=r.round_id, reason="again"))
    assert len(told) == 1   # already out: nothing new to tell
    # What a replica itself reported is not sent back to it.
    c.replicas.dropped(r, B, {on_b[0]: "missed step 1"})
    c.replicas.done(r, B, [])
    assert len(told) == 1 and on_b[0] in r.excluded


async def _live_and_frozen_replicas(plans_seen: list[bytes], frozen_connections: list[int]
                                    ) -> tuple[list[asyncio.Server], list[str]]:
    """Two loopback peers standing in for replicas, and their URLs: a live one that takes each plan
    (kept in ``plans_seen``) and answers Ack, and a frozen one whose kernel takes each request and
    whose process answers nothing (a SIGSTOPped Main Server), each connection counted."""
    async def live(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        plans_seen.append(await reader.readexactly(length))
        body = packb(Ack().model_dump())
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/msgpack\r\nconnection: close\r\n"
                     + f"content-length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()

    async def frozen(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frozen_connections.append(1)
        await reader.read()   # takes everything, answers nothing

    servers = [await asyncio.start_server(handler, "127.0.0.1", 0) for handler in (live, frozen)]
    return servers, [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]


def test_a_frozen_replica_costs_the_plan_phase_one_try_and_its_groups_go_to_the_live_one(tmp_path):
    # The frozen replica's kernel accepts the connection and takes the body; the process never
    # answers (a SIGSTOPped Main Server). Each plan try waits replica_timeout_s, and a try without
    # an answer is not retried: it used to wait 120 s, five times over.
    plans_seen: list[bytes] = []

    async def scenario() -> tuple[Coordinator, float, list[str]]:
        servers, urls = await _live_and_frozen_replicas(plans_seen, [])
        c = _coordinator(tmp_path, urls)
        for d in DEVICES:
            _register(c, d, _counts(d))
        r = c.begin_round()
        started = time.monotonic()
        await asyncio.wait_for(send_plans(c, r, FedServerSettings(replica_timeout_s=0.5)), 30)
        took = time.monotonic() - started
        for s in servers:
            s.close()
        return c, took, urls

    c, took, (live_url, frozen_url) = asyncio.run(scenario())
    r = c.core.round
    assert r.plan_failed is None and {a.main_server_url for a in r.assignments.values()} == {live_url}
    assert frozen_url in c.replicas.down and live_url not in c.replicas.down
    assert len(plans_seen) == 2   # its own plan, then the one with every group
    assert took < 20   # one 0.5 s try for the frozen replica, not 5 x 120 s


def test_spread_groups_is_longest_processing_time_first():
    # Largest first, each to the least-loaded replica: 9->r0, 7->r1, 5->r1 (7 < 9), 4->r0 (9 < 12), 3->r1 (12 < 13).
    assert spread_groups([5, 9, 3, 7, 4], 2) == [1, 0, 1, 1, 0]
    # Ties: the lower group index first, then the lower replica index.
    assert spread_groups([4, 4, 4, 4], 2) == [0, 1, 0, 1]
    assert spread_groups([1, 2], 3) == [1, 0]            # more replicas than groups: some get none
    assert spread_groups([3, 1, 2], 1) == [0, 0, 0]      # a re-spread onto the one replica left
    assert spread_groups([], 2) == []
    with pytest.raises(ValueError):
        spread_groups([1], 0)


def test_spread_groups_balances_loads_within_lpts_bound():
    rng = np.random.default_rng(0)
    for _ in range(50):
        loads = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(1, 12)))]
        replicas = int(rng.integers(1, 5))
        placed = spread_groups(loads, replicas)
        assert placed == spread_groups(list(loads), replicas)   # deterministic
        totals = [sum(l for l, r in zip(loads, placed) if r == k) for k in range(replicas)]
        lower = max(max(loads), sum(loads) / replicas)          # no spread beats this
        assert max(totals) <= 4 / 3 * lower + 1e-9             # Graham's LPT bound


# --- a replica that failed is set aside until it answers its health check, and costs no device a miss ----
def _excluded_overdue(c: Coordinator, r, url: str) -> str:
    """One device of replica ``url`` that took its task, taken out for its own deadline."""
    device = min(d for d, a in r.assignments.items() if a.main_server_url == url)
    r.assignments[device].dispatched_at = time.monotonic()
    c.core.exclude(r, [device], OVERDUE)
    return device


def test_a_lost_replica_is_set_aside_and_planned_around_until_it_answers_its_health_check(replicated, caplog):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    with caplog.at_level(logging.INFO, logger="fed_server"):
        c.replicas.lost(r, B, "watch failed")
        c.replicas.lost(r, B, "again")
        c.close_round()
        assert c.replicas.available() == [A] and c.replicas.live() == 1
        nxt = c.begin_round()
        assert list(c.replicas.plans(nxt, c.replicas.available())) == [A]
        c.close_round()
        c.replicas.back(B)
        c.replicas.back(B)
    assert c.replicas.available() == [A, B] and c.core.changed.is_set()
    lines = [m for m in caplog.messages if "set aside" in m or "health check again" in m]
    assert lines == [f"Main Server replica {B} set aside (lost in round 1 (attempt 1)): no attempt is planned onto "
                     f"it until it answers its health check",
                     f"Main Server replica {B} answers its health check again: attempts are planned onto it again"]


def test_a_device_that_missed_its_deadline_on_a_lost_replica_is_not_charged(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    late_on_a, late_on_b = _excluded_overdue(c, r, A), _excluded_overdue(c, r, B)
    c.replicas.lost(r, B, "watch failed")   # after the device's own deadline cut it
    left = r.left([])
    assert left[late_on_b] == f"its Main Server replica {B} was lost (watch failed)"
    assert left[late_on_a] == OVERDUE   # a live replica's device is charged as before
    assert late_on_b not in r.missed_deadline([]) and late_on_a in r.missed_deadline([])


def test_a_replica_silent_past_a_heartbeat_takes_its_devices_misses(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    late_on_a, late_on_b = _excluded_overdue(c, r, A), _excluded_overdue(c, r, B)
    c.replicas.heard(r, A, 1.9, 4.0)   # a heartbeat on time
    c.replicas.heard(r, B, 6.5, 4.0)   # frozen for a while, then running again
    assert r.failed_replicas == {B: "fell silent for 6.5s"} and r.lost_replicas == []
    assert late_on_a in r.missed_deadline([]) and late_on_b not in r.missed_deadline([])
    assert r.left([])[late_on_b] == f"its Main Server replica {B} fell silent for 6.5s"


def test_a_miss_waits_for_its_replica_to_be_heard_from_after_it(replicated):
    c = replicated
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    c.replicas.heard(r, A, 0.0, 4.0)
    c.replicas.heard(r, B, 0.0, 4.0)
    late = _excluded_overdue(c, r, B)   # after B last spoke
    awaited = min(d for d, a in r.assignments.items() if a.main_server_url == A)
    r.exclude(set(r.assignments) - {late, awaited}, "withdrew: test")   # no deadline missed
    end = time.monotonic() + 1   # the attempt ends with A's device still awaited: it misses the end
    assert r.unconfirmed_misses(end) == {A: end, B: r.excluded_at[late]}
    c.replicas.heard(r, B, 0.5, 4.0)   # alive after the miss: the miss is the device's
    c.replicas.done(r, A, [])          # its stream ended with done: alive to the end
    assert r.unconfirmed_misses(end) == {}


@pytest.mark.parametrize("speaks", [True, False], ids=["heartbeat after the miss", "silent"])
def test_an_attempt_ends_once_it_knows_whether_the_replica_was_alive_after_a_miss(replicated, speaks):
    """The attempt is otherwise complete: one device of B missed its own deadline, every other is
    out for other reasons. B's next heartbeat charges the device; its silence makes it B's loss."""
    c = replicated
    settings = FedServerSettings(heartbeat_s=0.1, replica_timeout_s=0.3)

    async def close() -> float:
        r = c.begin_round()
        c.replicas.plans(r, [A, B])
        late = _excluded_overdue(c, r, B)
        r.exclude(set(r.assignments) - {late}, "withdrew: test")
        if speaks:
            asyncio.get_running_loop().call_later(0.05, c.replicas.heard, r, B, 0.1, 0.2)
        started = time.monotonic()
        await confirm_replicas(c, r, settings)
        return time.monotonic() - started

    took = asyncio.run(close())
    r = c.close_round()
    [late] = [d for d, why in r.excluded.items() if why == OVERDUE]
    if speaks:
        assert r.missed_deadline([]) == {late} and r.lost_replicas == [] and took < 0.3
    else:
        assert r.missed_deadline([]) == set() and r.lost_replicas == [B] and B in c.replicas.down
        assert r.left([])[late] == (f"its Main Server replica {B} was lost (not heard from after its devices "
                                    f"missed their deadlines)")


def test_devices_a_lost_replica_may_hold_are_not_selected_until_they_call_again(replicated):
    c = replicated   # every device is selected while it may be
    r = c.begin_round()
    c.replicas.plans(r, [A, B])
    r.ready = True
    on_b = sorted(d for d, a in r.assignments.items() if a.main_server_url == B)
    took, idle = on_b[0], on_b[1]
    assert c.dispatch.task_for(took).status == "train"
    c.replicas.lost(r, B, "watch failed")
    assert set(c.replicas.held) == {took}
    # Taken out before it took its task, the other gets none: its replica is gone.
    assert c.dispatch.task_for(idle).status == "wait"
    c.close_round()
    assert took not in c.begin_round().assignments   # its call to the lost replica may still hang
    c.close_round()
    c.core.devices.get(took)   # it called the Fed Server: whatever held it is over
    assert took in c.begin_round().assignments and c.replicas.held == {}


def test_held_devices_reach_the_quorum_when_nobody_else_can_and_are_not_charged_for_the_replica(tmp_path):
    c = _coordinator(tmp_path, [A])
    for d in DEVICES:
        _register(c, d, None)
    r = c.begin_round()
    c.replicas.plans(r, [A])
    r.ready = True
    assert all(c.dispatch.task_for(d).status == "train" for d in DEVICES)
    c.replicas.lost(r, A, "killed")   # every device had taken its task on it
    c.close_round()
    assert set(c.replicas.held) == set(DEVICES)
    nxt = c.begin_round()   # none is free: all are selected rather than none
    assert set(nxt.assignments) == set(DEVICES)
    c.replicas.plans(nxt, [A])
    c.core.exclude(nxt, [DEVICES[0]], OVERDUE)
    assert nxt.left([])[DEVICES[0]] == f"still held by Main Server replica {A}, lost in an earlier attempt"
    assert DEVICES[0] not in nxt.missed_deadline([])


def test_plans_skip_a_set_aside_replica_and_wait_for_one_when_all_are(tmp_path):
    # A frozen replica's kernel takes a plan and its process never answers; a live one answers
    # plans and health checks. Once set aside, the frozen one is sent nothing more.
    frozen_connections: list[int] = []

    async def scenario() -> tuple[Coordinator, list[str], list, float]:
        servers, urls = await _live_and_frozen_replicas([], frozen_connections)
        c = _coordinator(tmp_path, urls)
        for d in DEVICES:
            _register(c, d, _counts(d))
        settings = FedServerSettings(replica_timeout_s=0.5)
        rounds = []
        for _ in range(3):   # the first attempt finds the frozen replica out; the next two skip it
            rounds.append(c.begin_round())
            await send_plans(c, rounds[-1], settings)
            c.close_round()
        c.replicas.set_aside(urls[0], "test")   # every replica set aside: the plan phase waits for one
        asyncio.get_running_loop().call_later(0.3, c.replicas.back, urls[0])
        started = time.monotonic()
        rounds.append(c.begin_round())
        await send_plans(c, rounds[-1], settings)
        waited = time.monotonic() - started
        for s in servers:
            s.close()
        return c, urls, rounds, waited

    c, (live_url, frozen_url), rounds, waited = asyncio.run(scenario())
    assert len(frozen_connections) == 1   # one plan, before it was set aside; none after
    assert all(r.plan_failed is None and {a.main_server_url for a in r.assignments.values()} == {live_url}
               for r in rounds)
    assert list(c.replicas.down) == [frozen_url] and 0.3 <= waited < 5


def test_the_plan_phase_fails_when_no_replica_comes_back_within_the_join_deadline(tmp_path):
    config = load_run_config({"algorithm": "s2fl", "rounds": 2, "seed": 3, "grouping": {"group_size": 2},
                              "deadlines": {"join_s": 0.3}, "data": {"num_devices": len(DEVICES), "max_samples": 200}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), [A, B])
    for d in DEVICES:
        _register(c, d, _counts(d))
    c.replicas.set_aside(A, "lost in round 1 (attempt 1)")
    c.replicas.set_aside(B, "did not accept the plan")
    r = c.begin_round()
    asyncio.run(send_plans(c, r, FedServerSettings()))
    assert r.plan_failed == (f"every Main Server replica is set aside until it answers its health check: "
                             f"{A} (lost in round 1 (attempt 1)); {B} (did not accept the plan)")
    assert r.left([])[DEVICES[0]] == "no Main Server replica accepted the round plan"   # nobody is charged


def test_a_set_aside_replica_is_probed_until_its_health_check_answers(tmp_path):
    answered: list[float] = []

    async def scenario() -> tuple[Coordinator, str, float]:
        async def healthz(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            if len(answered) < 2:   # down for its first two probes (a restarting replica)
                answered.append(time.monotonic())
                writer.close()
                return
            writer.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"status":"ok"}')
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(healthz, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        c = _coordinator(tmp_path, [url, B])
        c.replicas.set_aside(url, "test")
        started = time.monotonic()
        await asyncio.wait_for(probe_replica(c, url, FedServerSettings(replica_timeout_s=1.0)), 10)
        server.close()
        return c, url, time.monotonic() - started

    c, url, took = asyncio.run(scenario())
    assert c.replicas.available() == [url, B]
    # Two failed probes, waits of 0.5 s then 1 s between them: a backoff, not a busy loop.
    assert len(answered) == 2 and answered[1] - answered[0] >= 0.45 and took >= 1.4


def test_devices_are_told_each_replicas_address_for_devices_and_plans_keep_the_servers_own(tmp_path):
    config = load_run_config({"algorithm": "s2fl", "rounds": 2, "seed": 3, "grouping": {"group_size": 2},
                              "data": {"num_devices": len(DEVICES), "max_samples": 200}})
    public = {A: "https://main-0.example.org", B: "https://main-1.example.org"}
    c = Coordinator(config, RunDirectory(tmp_path / "run"), [A, B], main_server_device_urls=[public[A], public[B]])
    for d in DEVICES:
        _register(c, d, _counts(d))
    r = c.begin_round()
    assert set(c.replicas.plans(r, [A, B])) == {A, B}
    r.ready = True
    told = {m: c.dispatch.task_for(m).main_server_url for m in DEVICES}
    assert told == {m: public[r.assignments[m].main_server_url] for m in DEVICES}
    assert set(told.values()) == set(public.values())


def test_one_address_for_devices_per_replica(tmp_path):
    config = load_run_config({"algorithm": "s2fl", "rounds": 2, "data": {"num_devices": 4, "max_samples": 200}})
    with pytest.raises(ValueError, match=r"1 Main Server URLs for the devices \(--main-server-public-url\) for 2 "
                                         r"replicas \(--main-server-url\): give one per replica, in the same order"):
        Coordinator(config, RunDirectory(tmp_path / "run"), [A, B], main_server_device_urls=["https://x"])
