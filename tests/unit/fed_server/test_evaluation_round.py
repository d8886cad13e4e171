"""The Fed Server's federated evaluation phase, without HTTP: who is asked, which reports count,
the record's figures, the deadline, and a restart in the middle of the phase."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from fed_server.app import create_app
from fed_server.coordinator import Coordinator
from fed_server.driver import drive_rounds
from fed_server.settings import FedServerSettings
from fed_server.run_dir import RunDirectory
from fed_server.update_checks import held_out_count
from http_api.server import MSGPACK
from shared.errors import Conflict, Invalid, NotAllowed, NotFound
from shared.portions import portion_state
from shared.run_config import load_run_config
from shared.schemas import DeviceProfileMsg, DeviceTimings, EvaluationReport, RegisterRequest, UpdateRequest, WeightsResponse
from shared.wire import decode_state, encode_state, packb, unpackb

TIMINGS = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)
DEVICES = ("d0", "d1")   # their shards of 200 samples, less 20 % held out, leave 23 and 16 held-out samples


def _coordinator(tmp_path, rounds: int = 2, evaluate_s: float = 30.0) -> Coordinator:
    config = load_run_config({"algorithm": "fedavg", "rounds": rounds, "seed": 3,
                              "data": {"num_devices": 2, "max_samples": 200},
                              "evaluation": {"mode": "federated", "holdout": 0.2},
                              "deadlines": {"evaluate_s": evaluate_s}})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    for i, device in enumerate(DEVICES):
        n = c.enrolment.shard_sizes[i] - held_out_count(c.enrolment.shard_sizes[i], 0.2)   # the training part it registers
        c.enrolment.register(RegisterRequest(device_id=device, shard=i, num_samples=n, profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    return c


def _upload(c: Coordinator, device: str, round_id: int) -> UpdateRequest:
    state = {k: (v + 0.01 if v.is_floating_point() else v) for k, v in portion_state(c.core.model, 0, c.core.num_blocks).items()}
    return UpdateRequest(device_id=device, round_id=round_id, num_samples=c.core.devices.get(device).num_samples, steps=1, train_loss=1.0,
                         weights=encode_state(state), timings=TIMINGS, bytes_up=0, bytes_down=0)


def _aggregated(c: Coordinator, devices=("d0", "d1")):
    """Open a round, upload from ``devices``, close and aggregate it; (round, aggregation)."""
    fed_round = c.begin_round()
    fed_round.ready = True
    for d in devices:
        c.uploads.accept_update(fed_round.round_id, _upload(c, d, fed_round.round_id), 100)
    c.close_round()
    return fed_round, c.aggregate_round(fed_round)


def _report(device: str, round_id: int, n: int, correct: int, loss_sum: float) -> EvaluationReport:
    return EvaluationReport(device_id=device, round_id=round_id, num_samples=n, correct=correct, loss_sum=loss_sum)


def test_the_aggregated_devices_evaluate_the_new_model_and_the_record_holds_the_weighted_mean(tmp_path):
    c = _coordinator(tmp_path)
    assert c.progress.initial == {"test_accuracy": None, "test_loss": None}   # nothing evaluates round 0
    assert c.enrolment.run_info().holdout == 0.2
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    assert evaluation is not None and evaluation.asked == {"d0": 23, "d1": 16}
    task = c.dispatch.task_for("d0")
    assert (task.status, task.round_id, task.num_blocks) == ("evaluate", fed_round.round_id, c.core.num_blocks)
    sent = decode_state(WeightsResponse.model_validate(unpackb(b"".join(c.core.weights.body(task.weights_id)))).weights)
    assert all(torch.equal(sent[k], v) for k, v in c.core.model.state_dict().items())   # the aggregated model
    assert c.dispatch.task_for("d0").status == "wait"   # one evaluation task per device
    c.evaluation.accept(_report("d0", fed_round.round_id, 10, 9, 3.0))
    assert not evaluation.complete()
    c.evaluation.accept(_report("d1", fed_round.round_id, 15, 6, 12.0))
    assert evaluation.complete()
    assert c.evaluation.close() is evaluation and c.dispatch.task_for("d1").status == "wait"
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.status == "ok" and c.progress.rounds_done == 1
    assert record.test_accuracy == pytest.approx(15 / 25) and record.test_loss == pytest.approx(15.0 / 25)
    assert (record.evaluated_devices, record.evaluated_samples) == (2, 25)
    (line,) = c.run_dir.read_metrics()
    assert (line["test_accuracy"], line["evaluated_devices"], line["evaluated_samples"]) == (pytest.approx(0.6), 2, 25)


def test_bad_reports_are_refused_and_change_nothing(tmp_path):
    c = _coordinator(tmp_path)
    fed_round, aggregation = _aggregated(c, devices=("d0",))   # d1 never uploaded: not aggregated, not asked
    with pytest.raises(Conflict, match="not being evaluated"):   # no phase open yet
        c.evaluation.accept(_report("d0", fed_round.round_id, 10, 9, 3.0))
    evaluation = c.evaluation.begin(fed_round, aggregation)
    rid = fed_round.round_id
    for bad, error in ((_report("d0", rid - 1, 10, 9, 3.0), Conflict),      # a stale round
                       (_report("ghost", rid, 1, 1, 0.1), NotFound),        # an unknown device
                       (_report("d1", rid, 1, 1, 0.1), NotAllowed)):        # registered, but not asked
        with pytest.raises(error):
            c.evaluation.accept(bad)
        assert evaluation.reports == {}
    c.evaluation.accept(_report("d0", rid, 10, 9, 3.0))
    with pytest.raises(Conflict, match="already has"):                      # a duplicate
        c.evaluation.accept(_report("d0", rid, 10, 1, 9.0))
    assert evaluation.reports["d0"].correct == 9
    c.evaluation.close()
    with pytest.raises(Conflict):                                            # after the phase closed
        c.evaluation.accept(_report("d0", rid, 10, 9, 3.0))
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.test_accuracy == pytest.approx(0.9) and (record.evaluated_devices, record.evaluated_samples) == (1, 10)


def test_a_report_claiming_more_than_the_device_holds_out_is_refused_and_the_phase_does_not_wait_for_it(tmp_path):
    c = _coordinator(tmp_path)
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    rid = fed_round.round_id
    c.evaluation.accept(_report("d1", rid, 15, 6, 12.0))
    c.core.changed.clear()
    with pytest.raises(Invalid, match="exceed the 23 samples 'd0' holds out"):   # a fake count to outweigh d1
        c.evaluation.accept(_report("d0", rid, 10**9, 10**9, 0.0))
    assert evaluation.reports.keys() == {"d1"} and c.core.changed.is_set()
    assert evaluation.complete()   # d0 has no other report to send: the phase ends without its deadline
    with pytest.raises(Conflict, match="was refused"):
        c.evaluation.accept(_report("d0", rid, 10, 9, 3.0))
    c.evaluation.close()
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.test_accuracy == pytest.approx(0.4) and (record.evaluated_devices, record.evaluated_samples) == (1, 15)


def test_a_device_revoked_during_the_phase_is_not_counted_nor_waited_for(tmp_path):
    c = _coordinator(tmp_path)
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    c.evaluation.accept(_report("d0", fed_round.round_id, 10, 10, 0.0))
    evaluation.leave("d0", "its enrolment credential d0 was revoked")
    evaluation.leave("ghost", "not asked: changes nothing")
    assert not evaluation.complete()
    c.evaluation.accept(_report("d1", fed_round.round_id, 15, 6, 12.0))
    assert evaluation.complete()
    c.evaluation.close()
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.test_accuracy == pytest.approx(0.4) and (record.evaluated_devices, record.evaluated_samples) == (1, 15)


def test_a_round_without_any_report_is_applied_and_recorded_without_figures(tmp_path):
    c = _coordinator(tmp_path, rounds=1)
    before = {k: v.clone() for k, v in c.core.model.state_dict().items()}
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    c.evaluation.close()
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.status == "ok" and c.progress.rounds_done == 1 and c.core.finished
    assert (record.test_accuracy, record.test_loss, record.evaluated_devices, record.evaluated_samples) == (None, None, 0, 0)
    assert any(not torch.equal(before[k], v) for k, v in c.core.model.state_dict().items())   # the round was applied
    summary = c.progress.summary()
    assert summary["initial_accuracy"] is None and summary["final_accuracy"] is None and summary["rounds"] == 1


def test_a_failed_round_keeps_the_last_federated_figures(tmp_path):
    c = _coordinator(tmp_path, rounds=3)
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    c.evaluation.accept(_report("d0", fed_round.round_id, 10, 7, 4.0))
    c.evaluation.close()
    c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    c.config.deadlines.min_participants = 2
    failed_round, failed = _aggregated(c, devices=("d0",))
    assert not failed.ok and c.evaluation.begin(failed_round, failed) is None   # the model did not change
    record = c.progress.record(c.progress.conclude(failed_round, failed))
    assert record.status == "failed" and record.test_accuracy == pytest.approx(0.7)
    assert (record.evaluated_devices, record.evaluated_samples) == (1, 10)


def test_a_restart_during_the_evaluation_phase_neither_loses_nor_double_records_the_round(tmp_path):
    c = _coordinator(tmp_path, rounds=3)
    done, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(done, aggregation)
    c.evaluation.close()
    c.progress.record(c.progress.conclude(done, aggregation, evaluation))   # round 1: recorded, checkpointed
    checkpointed = {k: v.clone() for k, v in c.core.model.state_dict().items()}
    first, aggregation = _aggregated(c)
    c.evaluation.begin(first, aggregation)
    c.evaluation.accept(_report("d0", first.round_id, 10, 9, 3.0))
    # The server dies here: round 2's aggregated model and its reports were in memory only.
    resumed = _coordinator(tmp_path, rounds=3)
    assert resumed.resumed and resumed.progress.rounds_done == 1 and [r.round for r in resumed.progress.history] == [1]
    assert len(resumed.run_dir.read_metrics()) == 1
    assert all(torch.equal(checkpointed[k], v) for k, v in resumed.core.model.state_dict().items())
    with pytest.raises(Conflict):   # the interrupted phase's late report is stale
        resumed.evaluation.accept(_report("d1", first.round_id, 15, 6, 12.0))
    again, aggregation = _aggregated(resumed)   # the same logical round, under a new attempt id
    assert again.index == 2 and again.round_id > first.round_id
    evaluation = resumed.evaluation.begin(again, aggregation)
    resumed.evaluation.accept(_report("d0", again.round_id, 10, 8, 3.0))
    resumed.evaluation.close()
    resumed.progress.record(resumed.progress.conclude(again, aggregation, evaluation))
    # Once recorded (record, then checkpoint), a restart keeps it exactly once with its figures.
    after = _coordinator(tmp_path, rounds=3)
    assert after.resumed and after.progress.rounds_done == 2
    assert [(r.round, r.round_id, r.test_accuracy, r.evaluated_samples) for r in after.progress.history[1:]] == \
        [(2, again.round_id, pytest.approx(0.8), 10)]
    assert [line["round"] for line in after.run_dir.read_metrics()] == [1, 2]


def _drive(c: Coordinator, reporters: tuple[str, ...]) -> float:
    """Run one round through the driver; the devices in ``reporters`` report their evaluation when
    asked. Returns the seconds from the evaluation phase's start to the round's record."""
    async def scenario() -> float:
        driver = asyncio.get_running_loop().create_task(drive_rounds(c, FedServerSettings()))
        while c.core.round is None or not c.core.round.ready:
            await asyncio.sleep(0)
        fed_round = c.core.round
        for d in ("d0", "d1"):
            c.uploads.accept_update(fed_round.round_id, _upload(c, d, fed_round.round_id), 100)
        while c.core.evaluating is None:
            await asyncio.sleep(0.01)   # aggregation runs in a worker thread
        started = c.core.evaluating.started_at
        for d in reporters:
            c.evaluation.accept(_report(d, fed_round.round_id, 10, 5, 6.0))
        await asyncio.wait_for(driver, 60)
        return time.monotonic() - started

    return asyncio.run(scenario())


def test_the_driver_records_on_the_last_report_not_the_deadline(tmp_path):
    c = _coordinator(tmp_path, rounds=1, evaluate_s=60.0)
    took = _drive(c, ("d0", "d1"))
    assert took < 30 and c.core.finished
    (record,) = c.progress.history
    assert (record.test_accuracy, record.evaluated_devices, record.evaluated_samples) == (pytest.approx(0.5), 2, 20)


def test_the_driver_records_what_arrived_when_the_evaluation_deadline_passes(tmp_path):
    c = _coordinator(tmp_path, rounds=1, evaluate_s=0.5)
    took = _drive(c, ("d1",))
    assert took >= 0.5 and c.core.finished and c.core.evaluating is None
    (record,) = c.progress.history
    assert record.status == "ok" and (record.evaluated_devices, record.evaluated_samples) == (1, 10)


def test_the_evaluation_route_answers_4xx_for_bad_reports_and_stores_nothing(tmp_path):
    c = _coordinator(tmp_path)
    fed_round, aggregation = _aggregated(c)
    evaluation = c.evaluation.begin(fed_round, aggregation)
    good = _report("d0", fed_round.round_id, 10, 9, 3.0).model_dump()

    async def post(body: dict) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(c))   # no lifespan: no round driver
        async with httpx.AsyncClient(transport=transport, base_url="http://fed") as client:
            return await client.post("/v1/evaluation", content=packb(body), headers={"content-type": MSGPACK})

    async def get(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_app(c))
        async with httpx.AsyncClient(transport=transport, base_url="http://fed") as client:
            return await client.get(path)

    task = asyncio.run(get("/v1/devices/d0/task"))
    weights_path = f"/v1/devices/d0/weights/{unpackb(task.content)['weights_id']}"
    weights = asyncio.run(get(weights_path))
    assert task.status_code == weights.status_code == 200
    # Counted as bytes down: the task and the weights it names.
    assert evaluation.task_bytes == len(task.content) + len(weights.content) and len(weights.content) > 1000

    for body, code in (({**good, "correct": 11}, 422),                       # correct > num_samples
                       ({**good, "loss_sum": float("nan")}, 422),
                       ({**good, "extra": 1}, 422),
                       ({**good, "round_id": fed_round.round_id + 7}, 409),   # not the evaluated round
                       ({**good, "device_id": "ghost"}, 404)):
        answer = asyncio.run(post(body))
        assert answer.status_code == code, (body, answer.text)
        assert evaluation.reports == {}
    assert asyncio.run(post(good)).status_code == 200
    assert asyncio.run(post(good)).status_code == 409                         # the duplicate
    assert evaluation.reports["d0"].correct == 9
    c.evaluation.close()
    assert asyncio.run(get(weights_path)).status_code == 404   # the phase is over: no longer served
    before = fed_round.task_bytes
    record = c.progress.record(c.progress.conclude(fed_round, aggregation, evaluation))
    assert record.bytes_down == before + evaluation.task_bytes
