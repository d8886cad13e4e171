"""The device runner against in-memory fake servers: no HTTP, no processes.

The fakes implement device_agent.api's interfaces; the Main Server fake trains a real server
portion, so the split exchange (activations up, gradients down) is the one a real round runs.
"""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from device_agent.api import Unreachable
from device_agent.device import Device
from shared.config import TrainConfig
from shared.data import DataSpec, device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.errors import NotFound
from shared.evaluation import evaluation_counts
from shared.models import build_model, model_fingerprint
from shared.portions import portion_state
from shared.schemas import (
    EvaluationReport, JoinRequest, JoinResponse, RegisterRequest, RegisterResponse, ReportRequest, RunInfo, StepRequest, StepResponse,
    TaskResponse, UpdateRequest, WeightsResponse, WireTensor,
)
from shared.wire import decode_state, decode_tensor, encode_state, encode_tensor, packb

SPEC = DataSpec(num_devices=8, max_samples=400)
INFO = RunInfo(run_id="run-1", algorithm="s2fl", model="cnn", num_classes=10, input_shape=[1, 28, 28], data=SPEC, seed=5,
               fingerprint=model_fingerprint(build_model("cnn", 10, (1, 28, 28), seed=5), SPEC))


#: Weights the scripted tasks name, by id (what the Fed Server's weights route serves).
PUBLISHED: dict[str, WeightsResponse] = {}


def _publish(model, end: int) -> str:
    """Blocks [0, end) of ``model`` as weights a task can name."""
    weights_id = f"{len(PUBLISHED):032x}"
    PUBLISHED[weights_id] = WeightsResponse(weights=encode_state(portion_state(model, 0, end)))
    return weights_id


class FakeFed:
    """Answers polls from a script (a TaskResponse or an exception to raise), serves the weights
    the tasks name, records the rest."""

    def __init__(self, script: list, info: RunInfo = INFO) -> None:
        self.script = list(script)
        self.info = info
        self.registrations: list[RegisterRequest] = []
        self.uploads: list[UpdateRequest] = []
        self.reports: list[ReportRequest] = []
        self.evaluations: list[EvaluationReport] = []
        self.fetched: list[str] = []

    def run_info(self) -> RunInfo:
        return self.info

    def register(self, req: RegisterRequest) -> RegisterResponse:
        self.registrations.append(req)
        return RegisterResponse(run_id=INFO.run_id, device_id=req.device_id, shard=req.shard,
                                token=f"token-{len(self.registrations)}")

    def task(self, device_id: str, wait_s: float = 0.0) -> tuple[TaskResponse, int]:
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, len(packb(answer.model_dump()))

    def weights(self, device_id: str, weights_id: str) -> tuple[WeightsResponse, int]:
        self.fetched.append(weights_id)
        answer = PUBLISHED[weights_id]
        return answer, len(packb(answer.model_dump()))

    def report(self, req: ReportRequest) -> None:
        self.reports.append(req)

    def upload(self, req: UpdateRequest) -> None:
        self.uploads.append(req)

    def evaluation(self, req: EvaluationReport) -> None:
        self.evaluations.append(req)


class FakeMain:
    """A Main Server for one device: trains the server portion on every step it is sent."""

    def __init__(self, url: str, token: str | None, split: int) -> None:
        self.url, self.token = url, token
        self.bytes_up = self.bytes_down = 0
        model = build_model("cnn", seed=INFO.seed)
        self.server = model.portion(split, len(model.blocks))
        self.steps: list[int] = []
        self.closed = False

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        self.bytes_up += len(packb(req.model_dump()))
        return JoinResponse(group_id=0, members=[req.device_id], label_distance=0.0)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        self.steps.append(req.step)
        self.bytes_up += len(packb(req.model_dump()))
        fx = decode_tensor(req.fx).requires_grad_(True)
        loss = F.cross_entropy(self.server(fx), decode_tensor(req.labels))
        loss.backward()
        resp = StepResponse(dfx=WireTensor(**encode_tensor(fx.grad)), loss=loss.item(), wait_s=0.0, server_s=0.0)
        self.bytes_down += len(packb(resp.model_dump()))
        return resp

    def close(self) -> None:
        self.closed = True


def _train_task(round_id: int, split: int, main_url: str | None) -> TaskResponse:
    model = build_model("cnn", seed=INFO.seed)
    return TaskResponse(status="train", round_id=round_id, split_point=split, num_blocks=len(model.blocks),
                        weights_id=_publish(model, split), train=TrainConfig(batch_size=32),
                        main_server_url=main_url, deadline_s=120.0, algorithm="fedavg" if main_url is None else "s2fl")


def _device(fed: FakeFed, mains: list[FakeMain], split: int, keep_model: bool = True) -> Device:
    def connect(url: str, token: str | None) -> FakeMain:
        mains.append(FakeMain(url, token, split))
        return mains[-1]

    return Device("dev-003", 3, fed, connect, kind=None, stop=threading.Event(), poll_interval_s=0.01,
                  keep_model=keep_model)


def test_runner_registers_again_when_forgotten_rides_out_an_outage_and_uploads_its_round():
    blocks = len(build_model("cnn").blocks)
    fed = FakeFed([NotFound("unknown device"), Unreachable("connection refused"), _train_task(4, blocks, None),
                   TaskResponse(status="done")])
    device = _device(fed, [], blocks)
    device.run()
    assert [r.device_id for r in fed.registrations] == ["dev-003", "dev-003"]  # setup, then after the NotFound
    assert device.token == "token-2" and device.rounds_done == 1 and fed.script == []
    (upload,) = fed.uploads
    assert upload.round_id == 4 and upload.device_id == "dev-003" and upload.num_samples == len(device.data)
    assert upload.steps > 0 and upload.bytes_up == upload.bytes_down == 0  # no Main Server at full depth
    trained = decode_state(upload.weights)
    sent = portion_state(build_model("cnn", seed=INFO.seed), 0, blocks)
    assert trained.keys() == sent.keys()
    assert any(not torch.equal(trained[k], sent[k]) for k in sent if sent[k].is_floating_point())


def test_runner_trains_split_rounds_through_the_main_server_interface_with_its_current_token():
    split = build_model("cnn").split_points[0]
    mains: list[FakeMain] = []
    fed = FakeFed([_train_task(1, split, "mem://main"), NotFound("unknown device"), _train_task(2, split, "mem://main"),
                   TaskResponse(status="done")])
    device = _device(fed, mains, split)
    device.run()
    # Registering again (here after the Fed Server forgot the device) gives a new token, which
    # the next round's Main Server client presents; the old client is closed.
    assert [(m.token, m.url, m.closed) for m in mains] == [("token-1", "mem://main", True), ("token-2", "mem://main", False)]
    assert [u.round_id for u in fed.uploads] == [1, 2]
    for main, upload in zip(mains, fed.uploads):
        assert main.steps == list(range(upload.steps)) and upload.steps > 0
        assert (upload.bytes_up, upload.bytes_down) == (main.bytes_up, main.bytes_down)
        assert set(decode_state(upload.weights)) == set(portion_state(build_model("cnn"), 0, split))


@pytest.mark.parametrize("keep_model", [True, False])
def test_with_federated_evaluation_the_device_trains_on_its_training_part_and_evaluates_its_held_out_part(keep_model):
    info = INFO.model_copy(update={"holdout": 0.25})
    model = build_model("cnn", seed=INFO.seed)
    blocks = len(model.blocks)
    evaluated = build_model("cnn", seed=11)   # the "new global model" the evaluation task carries
    evaluate_task = TaskResponse(status="evaluate", round_id=4, num_blocks=blocks,
                                 weights_id=_publish(evaluated, blocks), deadline_s=30.0)
    fed = FakeFed([_train_task(4, blocks, None), evaluate_task, TaskResponse(status="done")], info)
    device = _device(fed, [], blocks, keep_model)
    device.run()
    # The same split the device made, recomputed from the run's spec: the shard, then the holdout.
    shard = device_shard(SPEC, load_dataset(SPEC)[0], 3)
    train, held_out = evaluation_holdout(shard, 0.25, INFO.seed, "dev-003")
    assert len(held_out) == len(shard) // 4 and len(train) + len(held_out) == len(shard)
    assert fed.registrations[0].num_samples == len(train) == fed.uploads[0].num_samples
    assert torch.equal(device.data.x, train.x) and torch.equal(device.held_out.y, held_out.y)
    (report,) = fed.evaluations
    correct, loss_sum = evaluation_counts(evaluated, held_out)
    assert (report.device_id, report.round_id, report.num_samples, report.correct) == ("dev-003", 4, len(held_out), correct)
    assert report.loss_sum == pytest.approx(loss_sum, rel=1e-5)
    assert (device.model is None) == (not keep_model)


def test_a_device_that_held_nothing_out_reports_zero_samples_and_the_server_evaluation_splits_nothing():
    blocks = len(build_model("cnn").blocks)
    fed = FakeFed([TaskResponse(status="evaluate", round_id=2, num_blocks=blocks), TaskResponse(status="done")])
    device = _device(fed, [], blocks)
    device.run()
    assert device.held_out is None and fed.registrations[0].num_samples == len(device.data)
    (report,) = fed.evaluations   # no weights needed: nothing to evaluate
    assert (report.num_samples, report.correct, report.loss_sum) == (0, 0, 0.0)


def test_agent_compute_slots_are_compute_threads_shared_by_its_devices():
    """``compute_slots=N``: every device of the agent computes on the same N compute threads; 0
    computes on each device's own thread; the default is one compute thread per usable core when
    the agent hosts more devices than that (else 0); a negative count is refused."""
    from device_agent.agent import Agent
    from device_agent.compute import ComputeThreads, InlineCompute
    from shared.machine import compute_workers

    workers = compute_workers()
    assert all(isinstance(d.compute, InlineCompute) for d in Agent("http://127.0.0.1:9", [0, 1], None, compute_slots=0).devices)
    few = Agent("http://127.0.0.1:9", list(range(workers)), None)
    assert few.compute_slots == 0 and all(isinstance(d.compute, InlineCompute) for d in few.devices)
    many = Agent("http://127.0.0.1:9", list(range(workers + 1)), None)
    assert many.compute_slots == workers and isinstance(many.devices[0].compute, ComputeThreads)
    assert many.devices[0].compute.count == workers
    many.compute.close()
    three = Agent("http://127.0.0.1:9", [0, 1, 2], None, compute_slots=3)
    assert three.compute_slots == 3 and len({id(d.compute) for d in three.devices}) == 1
    assert {id(d.weights_cache) for d in three.devices} == {id(three.weights)}   # one fetch serves them all
    compute = three.devices[0].compute
    assert isinstance(compute, ComputeThreads) and compute.count == 3
    names = {compute.run(lambda: threading.current_thread().name)[0] for _ in range(3)}
    assert names and all(n.startswith("compute") and n != threading.current_thread().name for n in names)
    compute.close()
    with pytest.raises(ValueError, match="compute_slots"):
        Agent("http://127.0.0.1:9", [0, 1], None, compute_slots=-1)


def test_the_named_weights_are_held_only_while_the_device_trains_and_without_keep_model_the_model_is_freed_before_the_upload():
    # Memory (issue 16): the task's weights are fetched by id and shared through the agent's cache
    # only while a device uses them, and a device that does not keep its model frees it before the
    # upload, which may wait on a busy Fed Server. The trained weights are the same either way.
    blocks = len(build_model("cnn").blocks)
    uploads = {}
    for keep_model in (True, False):
        task = _train_task(4, blocks, None)
        at_upload = {}

        class RecordingFed(FakeFed):
            def upload(self, req: UpdateRequest) -> None:
                at_upload["model"] = device.model
                at_upload["cached"] = len(device.weights_cache)
                super().upload(req)

        fed = RecordingFed([task, TaskResponse(status="done")])
        device = _device(fed, [], blocks, keep_model)
        device.run()
        assert fed.fetched == [task.weights_id] and at_upload["cached"] == 0
        assert (at_upload["model"] is None) == (not keep_model)
        (upload,) = fed.uploads
        uploads[keep_model] = decode_state(upload.weights)
    assert all(torch.equal(uploads[True][k], uploads[False][k]) for k in uploads[True])


def test_a_device_that_keeps_its_model_fetches_the_final_model_and_a_virtual_one_does_not():
    blocks = len(build_model("cnn").blocks)
    final = build_model("cnn", seed=21)
    for keep_model in (True, False):
        done = TaskResponse(status="done", num_blocks=blocks, weights_id=_publish(final, blocks))
        fed = FakeFed([done], INFO)
        device = _device(fed, [], blocks, keep_model)
        device.run()
        assert fed.fetched == ([done.weights_id] if keep_model else [])
        if keep_model:
            assert all(torch.equal(device.model.state_dict()[k], v) for k, v in final.state_dict().items())


def test_a_final_model_that_cannot_be_fetched_ends_the_device_cleanly(caplog):
    # Once the run is done the Fed Server may be going away: the device ends, warning, not failing.
    blocks = len(build_model("cnn").blocks)

    class Gone(FakeFed):
        def weights(self, device_id: str, weights_id: str):
            raise Unreachable("connection refused")

    device = _device(Gone([TaskResponse(status="done", num_blocks=blocks, weights_id="f" * 32)]), [], blocks)
    device.run()
    assert "final global model could not be fetched" in caplog.text
