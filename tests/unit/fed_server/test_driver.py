"""The round driver: it waits on the coordinator's events, with the deadlines as timeouts."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from fed_server.app import create_app
from fed_server.driver import drive_rounds, wait_until
from fed_server.settings import FedServerSettings
from fed_server.coordinator import Coordinator
from fed_server.run_dir import RunDirectory
from shared.config import RunConfig
from shared.errors import Invalid, NotFound
from shared.portions import portion_state
from shared.schemas import DeviceProfileMsg, DeviceTimings, RegisterRequest, UpdateRequest, WeightsResponse
from shared.wire import decode_state, encode_state, unpackb


def test_wait_until_wakes_on_the_event_and_times_out_at_the_deadline():
    async def scenario() -> tuple[bool, float, bool, float]:
        changed = asyncio.Event()
        state = {"done": False}

        async def arrive() -> None:
            await asyncio.sleep(0.05)
            changed.set()               # a change that does not finish the wait
            await asyncio.sleep(0.05)
            state["done"] = True
            changed.set()

        started = time.monotonic()
        asyncio.get_running_loop().create_task(arrive())
        woke = await wait_until(changed, lambda: state["done"], started + 30)
        woke_after = time.monotonic() - started
        started = time.monotonic()
        timed_out = await wait_until(changed, lambda: False, started + 0.2)
        return woke, woke_after, timed_out, time.monotonic() - started

    woke, woke_after, timed_out, waited = asyncio.run(scenario())
    assert woke and woke_after < 5            # on the event, long before the 30 s deadline
    assert not timed_out and 0.2 <= waited < 5


def test_a_round_closes_on_its_last_upload_not_its_deadline(tmp_path):
    config = RunConfig.model_validate({"algorithm": "fedavg", "rounds": 1, "seed": 3,
                                       "data": {"num_devices": 2, "max_samples": 200}, "deadlines": {"round_s": 60}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    timings = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)

    async def scenario() -> float:
        driver = asyncio.get_running_loop().create_task(drive_rounds(c, FedServerSettings()))
        for i in range(2):                 # registering the last device starts the round
            c.enrolment.register(RegisterRequest(device_id=f"d{i}", shard=i, num_samples=c.enrolment.shard_sizes[i],
                                       profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
        while c.core.round is None or not c.core.round.ready:
            await asyncio.sleep(0)        # let the driver open the round
        fed_round = c.core.round
        weights = encode_state(portion_state(c.core.model, 0, c.core.num_blocks))
        for d in ("d0", "d1"):
            c.uploads.accept_update(fed_round.round_id, UpdateRequest(
                device_id=d, round_id=fed_round.round_id, num_samples=c.core.devices.get(d).num_samples, steps=1, train_loss=1.0, weights=weights,
                timings=timings, bytes_up=0, bytes_down=0), 100)
        await asyncio.wait_for(driver, 30)
        return time.monotonic() - fed_round.started_at

    took = asyncio.run(scenario())
    assert c.core.finished and [r.status for r in c.progress.history] == ["ok"]
    assert took < 30 < config.deadlines.round_s


def test_status_since_filters_on_the_logical_round_and_keeps_every_attempt(tmp_path):
    config = RunConfig.model_validate({"algorithm": "fedavg", "rounds": 2, "seed": 3,
                                       "data": {"num_devices": 2, "max_samples": 200},
                                       "deadlines": {"min_participants": 2}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    timings = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)
    for i in range(2):
        c.enrolment.register(RegisterRequest(device_id=f"d{i}", shard=i, num_samples=c.enrolment.shard_sizes[i], profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    weights = encode_state(portion_state(c.core.model, 0, c.core.num_blocks))
    for uploaders in (["d0"], ["d0", "d1"], ["d0", "d1"]):   # round 1 fails once, then rounds 1 and 2
        fed_round = c.begin_round()
        fed_round.ready = True
        for d in uploaders:
            c.uploads.accept_update(fed_round.round_id, UpdateRequest(
                device_id=d, round_id=fed_round.round_id, num_samples=c.core.devices.get(d).num_samples, steps=1, train_loss=1.0, weights=weights,
                timings=timings, bytes_up=0, bytes_down=0), 100)
        c.close_round()
        c.progress.record(c.progress.conclude(fed_round, c.aggregate_round(fed_round)))

    async def history(since: int) -> list[tuple[int, int, str]]:
        transport = httpx.ASGITransport(app=create_app(c))   # no lifespan: no round driver
        async with httpx.AsyncClient(transport=transport, base_url="http://fed") as client:
            body = (await client.get("/v1/status", params={"since": since})).json()
        return [(r["round"], r["round_id"], r["status"]) for r in body["history"]]

    assert asyncio.run(history(0)) == [(1, 1, "failed"), (1, 2, "ok"), (2, 3, "ok")]
    assert asyncio.run(history(1)) == [(2, 3, "ok")]
    assert asyncio.run(history(2)) == []


def _registered(tmp_path, rounds: int) -> Coordinator:
    config = RunConfig.model_validate({"algorithm": "fedavg", "rounds": rounds, "seed": 3,
                                       "data": {"num_devices": 2, "max_samples": 200}, "deadlines": {"round_s": 60}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    for i in range(2):
        c.enrolment.register(RegisterRequest(device_id=f"d{i}", shard=i, num_samples=c.enrolment.shard_sizes[i],
                                   profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    return c


def _upload_all(c: Coordinator, shift: float = 0.0) -> None:
    """Every selected device uploads the global model, its floating tensors plus ``shift``."""
    fed_round = c.core.round
    weights = encode_state({k: v + shift if v.is_floating_point() else v
                            for k, v in portion_state(c.core.model, 0, c.core.num_blocks).items()})
    timings = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)
    for d in fed_round.assignments:
        c.uploads.accept_update(fed_round.round_id, UpdateRequest(
            device_id=d, round_id=fed_round.round_id, num_samples=c.core.devices.get(d).num_samples, steps=1, train_loss=1.0, weights=weights,
            timings=timings, bytes_up=0, bytes_down=0), 100)


def test_the_next_round_trains_while_the_last_one_is_evaluated_and_records_stay_in_order(tmp_path):
    """The server's evaluation and record of round r run beside round r+1: round 2 opens while
    round 1's record is held back, and round 2 is not aggregated (the model round 1's record
    evaluates does not change) until that record is written."""
    c = _registered(tmp_path, rounds=3)
    record = c.progress.record
    release = threading.Event()
    order: list[str] = []

    def held_record(conclusion):
        if conclusion.record.round == 1:
            assert release.wait(25), "round 1's record was never released"
        order.append(f"record {conclusion.record.round}")
        return record(conclusion)

    aggregate = c.aggregate_round

    def logged_aggregate(fed_round):
        order.append(f"aggregate {fed_round.index}")
        return aggregate(fed_round)

    c.progress.record, c.aggregate_round = held_record, logged_aggregate

    async def scenario() -> tuple[int, int]:
        driver = asyncio.get_running_loop().create_task(drive_rounds(c, FedServerSettings()))
        for index in (1, 2, 3):
            deadline = time.monotonic() + 20
            while c.core.round is None or c.core.round.index != index or not c.core.round.ready:
                assert time.monotonic() < deadline and not driver.done(), f"round {index} did not open"
                await asyncio.sleep(0.01)
            if index == 2:   # round 2 is open and training; round 1 is not recorded yet
                opened_with = (len(c.progress.history), c.progress.rounds_recorded)
            _upload_all(c)
            if index == 2:
                await asyncio.sleep(0.2)      # round 2 is complete, yet it waits for round 1's record
                assert order == ["aggregate 1"]
                release.set()
        await asyncio.wait_for(driver, 30)
        return opened_with

    opened_with = asyncio.run(scenario())
    assert opened_with == (0, 0)
    assert order == ["aggregate 1", "record 1", "aggregate 2", "record 2", "aggregate 3", "record 3"]
    assert c.core.finished and [r.round for r in c.progress.history] == [1, 2, 3] and c.progress.rounds_recorded == 3
    assert all(r.test_accuracy is not None and r.evaluation_s is not None for r in c.progress.history)
    assert len(c.run_dir.read_metrics()) == 3


def test_a_round_is_concluded_once_and_recorded_before_the_next_conclusion(tmp_path):
    c = _registered(tmp_path, rounds=2)
    for _ in range(2):
        fed_round = c.begin_round()
        c.dispatch.open_tasks(fed_round)
        _upload_all(c)
        c.close_round()
        conclusion = c.progress.conclude(fed_round, c.aggregate_round(fed_round))
        with pytest.raises(RuntimeError, match="not recorded yet"):
            c.progress.conclude(fed_round, c.aggregate_round(fed_round))
        assert c.progress.history == [] or c.progress.history[-1].round == fed_round.index - 1
        c.progress.record(conclusion)
        with pytest.raises(RuntimeError, match="not the one concluded last"):
            c.progress.record(conclusion)
    assert c.core.finished and [r.round for r in c.progress.history] == [1, 2]


def test_a_waiting_device_gets_its_task_when_the_round_opens_not_at_its_next_poll(tmp_path):
    c = _registered(tmp_path, rounds=1)

    async def scenario() -> tuple[str, float, str, float]:
        started = time.monotonic()
        idle = await c.dispatch.next_task("d0", wait_s=0.2)              # nothing happens: held, then "wait"
        idle_after = time.monotonic() - started
        waiting = asyncio.get_running_loop().create_task(c.dispatch.next_task("d0", wait_s=20))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        started = time.monotonic()
        c.dispatch.open_tasks(c.begin_round())
        answer = await asyncio.wait_for(waiting, 20)
        return idle.status, idle_after, answer.status, time.monotonic() - started

    idle, idle_after, status, woke_after = asyncio.run(scenario())
    assert idle == "wait" and idle_after >= 0.2
    assert status == "train" and woke_after < 5                  # on the event, not after the 20 s wait
    for bad in (-1.0, 31.0, float("nan")):
        with pytest.raises(Invalid, match="wait_s"):
            asyncio.run(c.dispatch.next_task("d1", wait_s=bad))
    assert c.core.round.assignments["d1"].dispatched_at is None      # a refused request changed nothing


def test_a_rounds_client_portion_is_published_once_for_all_its_devices_and_served_while_the_attempt_lasts(tmp_path):
    c = _registered(tmp_path, rounds=2)
    ids = []
    for _ in (1, 2):
        fed_round = c.begin_round()
        c.dispatch.open_tasks(fed_round)
        tasks = [c.dispatch.task_for(d) for d in ("d0", "d1")]
        assert [t.status for t in tasks] == ["train", "train"]
        (weights_id,) = {t.weights_id for t in tasks}   # one portion named to both devices
        assert len(c.core.weights) == 1
        sent = decode_state(WeightsResponse.model_validate(unpackb(b"".join(c.core.weights.body(weights_id)))).weights)
        expected = portion_state(c.core.model, 0, c.core.num_blocks)
        assert list(sent) == list(expected)   # each device gets the current global model
        assert all(torch.equal(sent[k], v) for k, v in expected.items())
        _upload_all(c, shift=0.5)   # the next round's portion must be the new model, not this one
        c.close_round()
        with pytest.raises(NotFound):   # the attempt is over: its weights are no longer served
            c.core.weights.body(weights_id)
        c.progress.record(c.progress.conclude(fed_round, c.aggregate_round(fed_round)))
        ids.append(weights_id)
    assert ids[0] != ids[1]
