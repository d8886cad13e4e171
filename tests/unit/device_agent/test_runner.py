"""The device runner against in-memory fake servers: no HTTP, no processes.

The fakes implement device_agent.api's interfaces; the Main Server fake trains a real server
portion, so the split exchange (activations up, gradients down) is the one a real round runs.
"""
from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from device_agent.api import Unreachable
from device_agent.device import Device
from device_agent.task_expired import TaskExpired
from device_agent.task_training import TaskTrainer
from shared.algorithms.registry import ALGORITHMS
from shared.config import TrainConfig
from shared.data import DataSpec, device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.errors import Conflict, DomainError, Failed, Invalid, NotFound
from shared.evaluation import evaluation_sums
from shared.models import build_model, model_fingerprint
from shared.portions import portion_state
from shared.schemas import (
    AgentTaskRequest, AgentTaskResponse, DeviceTask, EvaluationReport, Refusal, RegistrationBatch,
    RegistrationBatchResponse, JoinRequest, JoinResponse, RegisterRequest, RegisterResponse, ReportRequest, RunInfo, StepRequest, StepResponse,
    PrivacyTerms, SecAggInbox, SecAggKeys, SecAggRoster, SecAggUnmaskPlan, SecureTerms, TaskResponse, UpdateRequest,
    WeightsResponse, WireTensor, WithdrawRequest,
)
from shared.secagg.protocol import SEALED_SHARE_BYTES, DeviceSecrets
from shared.wire import decode_state, decode_tensor, encode_state, encode_tensor, packb

SPEC = DataSpec(num_devices=8, max_samples=400)
INFO = RunInfo(run_id="run-1", algorithm="s2fl", model="cnn", num_classes=10, input_shape=[1, 28, 28], data=SPEC, seed=5,
               fingerprint=model_fingerprint(build_model("cnn", 10, (1, 28, 28), seed=5), SPEC))


#: Weights the scripted tasks name, by id (what the Fed Server's weights route serves).
PUBLISHED: dict[str, WeightsResponse] = {}


def _publish(model, end: int) -> str:
    """Blocks [0, end) of ``model`` as weights a task can name."""
    return _publish_state(portion_state(model, 0, end))


def _publish_state(state: dict[str, torch.Tensor]) -> str:
    """``state`` as weights a task can name."""
    weights_id = f"{len(PUBLISHED):032x}"
    PUBLISHED[weights_id] = WeightsResponse(weights=encode_state(state))
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
        self.withdrawals: list[WithdrawRequest] = []
        self.fetched: list[str] = []
        # Secure aggregation: what the device sent into the stages (stage, message), and one peer,
        # whose share for the device is altered on the way where ``forge``, and whose keys in the
        # roster are the device's own where ``copy_keys``.
        self.secagg: list[tuple[str, object]] = []
        self.peer = DeviceSecrets("dev-peer", SECURE_RUN, 1)
        self.forge = False
        self.copy_keys = False

    def run_info(self) -> RunInfo:
        return self.info

    def register(self, req: RegisterRequest) -> RegisterResponse:
        self.registrations.append(req)
        return RegisterResponse(run_id=INFO.run_id, device_id=req.device_id, shard=req.shard,
                                token=f"token-{len(self.registrations)}")

    def use_token(self, token: str | None) -> None:
        self.token = token

    def task(self, device_id: str, wait_s: float = 0.0) -> tuple[TaskResponse, int]:
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, len(packb(answer.model_dump()))

    def weights(self, device_id: str, weights_id: str, cancel=None) -> tuple[WeightsResponse, int]:
        self.fetched.append(weights_id)
        answer = PUBLISHED[weights_id]
        return answer, len(packb(answer.model_dump()))

    def report(self, req: ReportRequest) -> None:
        self.reports.append(req)

    def upload(self, req: UpdateRequest) -> None:
        self.uploads.append(req)

    def evaluation(self, req: EvaluationReport) -> None:
        self.evaluations.append(req)

    def withdraw(self, req: WithdrawRequest) -> None:
        self.withdrawals.append(req)

    def secagg_send(self, round_id: int, stage: str, req) -> None:
        self.secagg.append((stage, req))

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float, model):
        (own,) = [req for sent, req in self.secagg if sent == "keys"]
        mask_key, share_key = (own.mask_key, own.share_key) if self.copy_keys else self.peer.public_keys()
        keys = {device_id: own, "dev-peer": SecAggKeys(device_id="dev-peer", round_id=round_id, mask_key=mask_key,
                                                       share_key=share_key)}
        if stage == "roster":
            whole = len(build_model("cnn").blocks)
            return SecAggRoster(ready=True, keys=keys, threshold=2, splits={d: whole for d in keys})
        if stage == "inbox":
            dealt = self.peer.seal_shares({d: (k.mask_key, k.share_key) for d, k in keys.items()}, 2)[device_id]
            at = SEALED_SHARE_BYTES - 1   # the sealed share's tag
            return SecAggInbox(ready=True, shares={"dev-peer": dealt[:at] + bytes([dealt[at] ^ self.forge]) + dealt[at + 1:]})
        return SecAggUnmaskPlan(ready=True, survivors=sorted(keys), dropped=[])


class ScriptedSession:
    """An agent's session over its devices' scripted :class:`FakeFed`s: each device of a batch
    registers with its own, and each task request hands every device idle in it the next answer of
    its script."""

    def __init__(self, devices: list[Device]) -> None:
        self.feds = {device.device_id: device.fed for device in devices}
        self.idle: set[str] = set()
        self.lock = threading.Lock()

    def register_batch(self, req: RegistrationBatch) -> RegistrationBatchResponse:
        answer = RegistrationBatchResponse()
        for device in req.devices:
            try:
                answer.registered.append(self.feds[device.device_id].register(device))
            except DomainError as exc:
                answer.refused[device.device_id] = Refusal(status=409 if isinstance(exc, Conflict) else 500,
                                                           detail=str(exc))
        return answer

    def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
        with self.lock:
            self.idle.update(device.device_id for device in req.add)
            tasks = [DeviceTask(device_id=d, task=self.feds[d].task(d)[0]) for d in sorted(self.idle)]
            self.idle.clear()
        if not tasks:
            time.sleep(min(req.wait_s, 0.05))
        return AgentTaskResponse(tasks=tasks)


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
    return TaskResponse(status="train", round_id=round_id, round_index=round_id, split_point=split, num_blocks=len(model.blocks),
                        weights_id=_publish(model, split), train=TrainConfig(batch_size=32),
                        main_server_url=main_url, deadline_s=120.0, algorithm="fedavg" if main_url is None else "s2fl")


def _device(fed: FakeFed, mains: list[FakeMain], split: int, keep_model: bool = True,
            main: type[FakeMain] = FakeMain) -> Device:
    def connect(url: str, token: str | None) -> FakeMain:
        mains.append(main(url, token, split))
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
    assert device.token == "token-2" and device.tasks_trained == 1 and fed.script == []
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
    if keep_model:   # a device that keeps its model keeps its data; a virtual one loads it for each task
        assert torch.equal(device.data.x, train.x) and torch.equal(device.held_out.y, held_out.y)
    else:
        assert device.data is None and device.held_out is None
    (report,) = fed.evaluations
    sums = evaluation_sums(evaluated, held_out)
    correct, loss_sum = sums.correct, sums.loss_sum
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
    # Memory: the task's weights are fetched by id and shared through the agent's cache
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
        def weights(self, device_id: str, weights_id: str, cancel=None):
            raise Unreachable("connection refused")

    device = _device(Gone([TaskResponse(status="done", num_blocks=blocks, weights_id="f" * 32)]), [], blocks)
    device.run()
    assert "final global model could not be fetched" in caplog.text


# --- a task the device cannot carry out ----------------------------------------------------------
class _DroppedAtJoin(FakeMain):
    """A Main Server whose group refuses the device when it joins attempt 1."""

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        if round_id == 1:
            raise Conflict("round 1: dev-003 was dropped from its group")
        return super().join(round_id, req, timeout)


class _DroppedMidRound(FakeMain):
    """A Main Server that refuses the device's second step of attempt 1 (its group dropped it)."""

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        if round_id == 1 and req.step == 1:
            raise Invalid("step 1: dev-003 is no longer in group 0")
        return super().step(round_id, req, timeout)


class _NonFiniteGradients(FakeMain):
    """A Main Server whose group copy went non-finite in attempt 1: it answers NaN gradients."""

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        resp = super().step(round_id, req, timeout)
        if round_id == 1:
            shape = decode_tensor(resp.dfx).shape
            resp = resp.model_copy(update={"dfx": WireTensor(**encode_tensor(torch.full(shape, float("nan"))))})
        return resp


class _Broken(FakeMain):
    """A Main Server client that fails in a way no task failure should (a bug, for the device)."""

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        if round_id == 1:
            raise RuntimeError("boom")
        return super().step(round_id, req, timeout)


def _undecodable_weights_task(round_id: int, split: int) -> TaskResponse:
    state = portion_state(build_model("cnn", seed=INFO.seed), 0, split)
    first = next(iter(state))
    state[first] = torch.zeros(3)   # well-formed on the wire, but not the shape the layout has
    return _train_task(round_id, split, None).model_copy(update={"weights_id": _publish_state(state)})


def _full(round_id: int) -> TaskResponse:
    return _train_task(round_id, len(build_model("cnn").blocks), None)


def _split(round_id: int) -> TaskResponse:
    return _train_task(round_id, build_model("cnn").split_points[0], "mem://main")


# (the task of attempt 1, the Main Server, a word the reason names, a split round)
FAILED_TASKS = {
    "unknown algorithm": (lambda: _full(1).model_copy(update={"algorithm": "no-such"}), FakeMain,
                          "'no-such' is not one this agent knows"),
    "params the device logic refuses": (lambda: _full(1).model_copy(update={
        "algorithm": "fedbc", "params": {"local_test_fraction": 5.0}}), FakeMain, "local_test_fraction"),
    "extras that do not parse": (lambda: _full(1).model_copy(update={
        "algorithm": "fedbc", "extras": {"lambda": -1.0, "gamma": 0.0, "split_seed": 1}}), FakeMain, "task extras: lambda"),
    "weights that do not decode": (lambda: _undecodable_weights_task(1, len(build_model("cnn").blocks)), FakeMain,
                                   "task weights"),
    "no training settings": (lambda: _full(1).model_copy(update={"train": None}), FakeMain, "must name"),
    "group dropped it at join": (lambda: _split(1), _DroppedAtJoin, "dropped from its group"),
    "group dropped it mid-round": (lambda: _split(1).model_copy(update={"train": TrainConfig(batch_size=8)}),
                                   _DroppedMidRound, "no longer in group 0"),
    "non-finite gradients": (lambda: _split(1), _NonFiniteGradients, "dfx"),
}


def _problems(caplog) -> list:
    return [r for r in caplog.records if r.name == "device_agent" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("case", FAILED_TASKS)
def test_a_task_the_device_cannot_carry_out_is_one_warning_and_one_withdrawal_and_the_device_trains_the_next(case, caplog):
    make_task, main, word = FAILED_TASKS[case]
    task = make_task()
    fed = FakeFed([task, _split(2) if task.main_server_url else _full(2), TaskResponse(status="done")])
    device = _device(fed, [], task.split_point, main=main)
    device.run()
    (line,) = _problems(caplog)
    assert line.levelname == "WARNING" and not line.exc_info
    assert line.getMessage().startswith("dev-003: round 1 (attempt 1) abandoned, withdrawing: ") and word in line.getMessage()
    (withdrawal,) = fed.withdrawals
    assert (withdrawal.device_id, withdrawal.round_id) == ("dev-003", 1) and word in withdrawal.reason
    assert "\n" not in withdrawal.reason
    assert [u.round_id for u in fed.uploads] == [2] and device.tasks_trained == 1 and fed.script == []


def test_an_unexpected_error_in_a_task_is_logged_with_its_traceback_and_the_device_withdraws_and_goes_on(caplog):
    fed = FakeFed([_split(1), _split(2), TaskResponse(status="done")])
    device = _device(fed, [], build_model("cnn").split_points[0], main=_Broken)
    device.run()
    (line,) = _problems(caplog)
    assert line.levelname == "ERROR" and line.exc_info and line.exc_info[0] is RuntimeError
    assert line.getMessage() == "dev-003: round 1 (attempt 1) abandoned, withdrawing: RuntimeError: boom"
    assert [(w.round_id, w.reason) for w in fed.withdrawals] == [(1, "RuntimeError: boom")]
    assert [u.round_id for u in fed.uploads] == [2]


@pytest.mark.parametrize("refusal", [Unreachable("connection refused"), Conflict("attempt 1 is not open"),
                                     NotFound("no such route")])
def test_a_withdrawal_that_fails_is_one_more_line_and_the_device_goes_on(refusal, caplog):
    class Refusing(FakeFed):
        def withdraw(self, req: WithdrawRequest) -> None:
            raise refusal

    fed = Refusing([_full(1).model_copy(update={"algorithm": "no-such"}), _full(2), TaskResponse(status="done")])
    _device(fed, [], len(build_model("cnn").blocks)).run()
    assert [r.getMessage() for r in _problems(caplog)][1:] == [f"dev-003: round 1 (attempt 1): withdrawal not taken: {refusal}"]
    assert [u.round_id for u in fed.uploads] == [2]


def test_a_task_past_its_deadline_is_given_up_without_a_withdrawal(caplog):
    # The Fed Server closed the attempt at that deadline: there is nothing left to withdraw from.
    fed = FakeFed([_full(1).model_copy(update={"deadline_s": 1e-9}), _full(2), TaskResponse(status="done")])
    _device(fed, [], len(build_model("cnn").blocks)).run()
    (line,) = _problems(caplog)
    assert line.getMessage() == "dev-003: round 1 (attempt 1) abandoned: deadline passed before the task started"
    assert fed.withdrawals == [] and [u.round_id for u in fed.uploads] == [2]


def test_a_task_whose_attempt_the_fed_server_closed_gives_up_its_weights_download_without_a_withdrawal(caplog):
    # The download stands for one over a link that slowed down: it goes on until the device is
    # told the attempt closed without it (its agent's session: Device.taken_out), then gives up.
    class SlowLink(FakeFed):
        def weights(self, device_id: str, weights_id: str, cancel=None) -> tuple[WeightsResponse, int]:
            if not self.fetched:   # the first task's weights
                self.fetched.append(weights_id)
                device.taken_out(2)   # another attempt's close: not this task's
                device.taken_out(1)
                assert cancel is not None and cancel.is_set()
                raise TaskExpired("the Fed Server closed the task's attempt; its weights' download was given up")
            assert cancel is not None and not cancel.is_set()   # the next task's download is its own
            return super().weights(device_id, weights_id, cancel)

    fed = SlowLink([_full(1), _full(2), TaskResponse(status="done")])
    device = _device(fed, [], len(build_model("cnn").blocks))
    device.run()
    (line,) = _problems(caplog)
    assert line.getMessage().startswith("dev-003: round 1 (attempt 1) abandoned: the Fed Server closed the task's attempt")
    assert fed.withdrawals == [] and [u.round_id for u in fed.uploads] == [2]


def test_a_task_whose_attempt_closed_while_it_trained_is_not_uploaded(caplog, monkeypatch):
    fed = FakeFed([_full(1), _full(2), TaskResponse(status="done")])
    device = _device(fed, [], len(build_model("cnn").blocks))
    train = TaskTrainer.train

    def train_then_closed(trainer, task, task_bytes, received_at):
        body = train(trainer, task, task_bytes, received_at)
        if task.round_id == 1:
            device.taken_out(1)   # the Fed Server closed attempt 1 as its training ended
        return body

    monkeypatch.setattr(TaskTrainer, "train", train_then_closed)
    device.run()
    (line,) = _problems(caplog)
    assert line.getMessage() == ("dev-003: round 1 (attempt 1) abandoned: the Fed Server closed the task's attempt "
                                 "before the upload")
    assert fed.withdrawals == [] and [u.round_id for u in fed.uploads] == [2]


def test_a_device_whose_tasks_fail_leaves_the_agents_other_devices_training():
    from device_agent.agent import Agent

    agent = Agent("http://127.0.0.1:9", [3, 4], None, compute_slots=0)
    failing = FakeFed([_full(1).model_copy(update={"algorithm": "no-such"}),
                       _full(2).model_copy(update={"params": {"unknown": 1}, "algorithm": "fedbc"}),
                       TaskResponse(status="done")])
    honest = FakeFed([_full(1), _full(2), TaskResponse(status="done")])
    agent.devices[0].fed, agent.devices[1].fed = failing, honest   # type: ignore[assignment]
    agent.tasks_fed = ScriptedSession(agent.devices)   # type: ignore[assignment]
    assert agent.run() == 0 and agent.errors == {}
    assert [w.round_id for w in failing.withdrawals] == [1, 2] and failing.uploads == [] and failing.script == []
    assert [u.round_id for u in honest.uploads] == [1, 2] and honest.withdrawals == []
    assert [d.tasks_trained for d in agent.devices] == [0, 2]


@pytest.mark.parametrize("update, message", [
    ({"algorithm": "no-such"}, f"the run's algorithm 'no-such' is not one this agent knows ({', '.join(ALGORITHMS)}): "
                               "run an agent of the Fed Server's version"),
    ({"model": "no_such_model"}, "unknown model 'no_such_model'"),
    ({"model": "my_pkg.nets:declared"}, "start this process with"),
])
def test_an_agent_refuses_a_run_it_cannot_train_in_one_line_before_any_device_registers(agent_cli, capsys, update,
                                                                                        message):
    from device_agent.agent import Agent

    feds: list[FakeFed] = []

    def agent(*args, **kwargs) -> Agent:   # the real agent, its devices talking to a Fed Server of the test's
        built = Agent(*args, **kwargs)
        for device in built.devices:
            feds.append(FakeFed([], INFO.model_copy(update=update)))
            device.fed = feds[-1]
        return built

    with pytest.raises(SystemExit) as exit_:
        agent_cli.run(["--shards", "0-1"], agent)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith(f"python -m device_agent: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert [f.registrations for f in feds] == [[], []]


class StartingFed(FakeFed):
    """A Fed Server that does not answer its first ``down`` run-spec requests (still starting)."""

    def __init__(self, script: list, down: int = 0) -> None:
        super().__init__(script)
        self.down = down
        self.asked = 0

    def run_info(self) -> RunInfo:
        self.asked += 1
        if self.asked <= self.down:
            raise Unreachable("ConnectError: [Errno 111] Connection refused")
        return super().run_info()


class NoWait(threading.Event):
    """A stop event whose waits return at once (the retries' delays are not what is tested)."""

    def wait(self, timeout: float | None = None) -> bool:
        return self.is_set()


def test_waiting_for_a_fed_server_that_is_starting_is_one_warning_then_one_line_when_it_answers(caplog):
    from device_agent.run_spec import wait_for_run

    caplog.set_level(logging.DEBUG, "device_agent")
    fed = StartingFed([], down=5)
    assert wait_for_run(fed, NoWait(), "the Fed Server at http://fed") == INFO and fed.asked == 6
    by_level = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "device_agent"]
    assert by_level[0] == ("WARNING", "waiting for the Fed Server at http://fed: not reachable yet "
                                      "(ConnectError: [Errno 111] Connection refused); retrying")
    assert [level for level, _ in by_level[1:-1]] == ["DEBUG"] * 4
    assert by_level[-1][0] == "INFO" and by_level[-1][1].startswith("the Fed Server at http://fed is reachable")


@pytest.mark.parametrize("refused, code", [((0,), 2), ((0, 1), 2), ((), 0)])
def test_a_device_the_fed_server_refuses_is_one_line_and_the_agent_exits_2_while_its_other_devices_train(
        refused, code, caplog):
    from device_agent.agent import Agent

    class Refusing(StartingFed):
        def register(self, req: RegisterRequest) -> RegisterResponse:
            raise Conflict(f"http://fed/v1/devices/register: HTTP 409: shard {req.shard} is already held by device 'x'")

    agent = Agent("http://127.0.0.1:9", [3, 4], None, compute_slots=0)
    feds = [(Refusing if i in refused else StartingFed)([_full(1), TaskResponse(status="done")], down=2)
            for i in range(2)]
    for device, fed in zip(agent.devices, feds):
        device.fed = fed   # type: ignore[assignment]
    agent.tasks_fed = ScriptedSession(agent.devices)   # type: ignore[assignment]
    assert agent.run() == code
    # The agent asked for the run spec for both its devices, which did not ask again.
    assert [f.asked for f in feds] == [3, 0]
    assert [d.tasks_trained for d in agent.devices] == [0 if i in refused else 1 for i in range(2)]
    lines = [r for r in _problems(caplog) if "waiting for" not in r.getMessage()]
    assert sorted((r.levelname, r.getMessage()) for r in lines) == [
        ("ERROR", f"dev-00{3 + i}: not registered: refused by the Fed Server: http://fed/v1/devices/register: "
                  f"HTTP 409: shard {3 + i} is already held by device 'x'") for i in refused]
    assert all(r.exc_info is None for r in lines)


def test_an_agent_with_one_device_gives_up_a_download_when_its_session_says_the_attempt_closed_without_it():
    # The session's answers are what name a task whose attempt closed (``ended``): a device on its
    # own task poll would never hear of it, and would go on downloading weights nobody trains from
    # (over a link that slowed down, past its next task's start).
    from device_agent.agent import Agent

    class Stalled(FakeFed):
        """Attempt 1's weights never arrive: their download ends only when it is given up."""
        def __init__(self, script: list) -> None:
            super().__init__(script)
            self.downloading = threading.Event()

        def weights(self, device_id: str, weights_id: str, cancel=None) -> tuple[WeightsResponse, int]:
            self.downloading.set()
            assert cancel is not None and cancel.wait(30), "the download was never given up"
            raise TaskExpired("the Fed Server closed the task's attempt; its weights' download was given up")

    class Closing(ScriptedSession):
        """Hands the device attempt 1, then, once its download runs, says the attempt closed."""
        told = False

        def agent_tasks(self, agent_id: str, req: AgentTaskRequest) -> AgentTaskResponse:
            if fed.downloading.is_set() and not self.told:
                self.told = True
                return AgentTaskResponse(ended={"dev-003": 1})
            if not req.add and fed.script and fed.script[0].status == "done":
                fed.downloading.wait(30)   # the holder's request, held while attempt 1 runs
            return super().agent_tasks(agent_id, req)

    agent = Agent("http://127.0.0.1:9", [3], None, compute_slots=0)
    fed = Stalled([_full(1), TaskResponse(status="done")])
    agent.devices[0].fed = fed   # type: ignore[assignment]
    agent.tasks_fed = session = Closing(agent.devices)   # type: ignore[assignment]
    assert agent.run() == 0 and agent.errors == {}
    assert session.told and fed.uploads == [] and fed.withdrawals == [] and fed.script == []
    assert agent.devices[0].tasks_trained == 0


def test_a_registration_the_fed_server_fails_to_carry_out_is_no_refusal(caplog):
    from device_agent.agent import Agent

    class Failing(FakeFed):
        def register(self, req: RegisterRequest) -> RegisterResponse:
            raise Failed("http://fed/v1/devices/register: HTTP 500: the disk is full")

    agent = Agent("http://127.0.0.1:9", [3], None, compute_slots=0)
    agent.devices[0].fed = Failing([])   # type: ignore[assignment]
    agent.tasks_fed = ScriptedSession(agent.devices)   # type: ignore[assignment]
    assert agent.run() == 1 and isinstance(agent.errors["dev-003"], Failed)


def test_a_shard_the_run_does_not_have_is_refused_before_the_device_loads_data():
    from device_agent.device import RegistrationRefused

    fed = FakeFed([])
    device = Device("dev-009", SPEC.num_devices, fed, lambda url, token: None, kind=None)  # type: ignore[arg-type,return-value]
    with pytest.raises(RegistrationRefused, match=r"^shard 8 does not exist: the run has 8 shards \(0..7\)$"):
        device.setup()
    assert fed.registrations == []


#: The run a secure task's shares are bound to: the Fed Server's current one, not the one the device
#: registered in (as after a Fed Server that restarted into a new run), which the device must follow.
SECURE_RUN = "run-2"


def _secure(round_id: int) -> TaskResponse:
    return _full(round_id).model_copy(update={"secure_aggregation": SecureTerms(fraction_bits=40, value_range=1.0,
                                                                               run_id=SECURE_RUN)})


def test_a_secure_task_shares_its_secrets_uploads_masked_words_and_answers_the_unmasking_stage():
    fed = FakeFed([_secure(1), TaskResponse(status="done")])
    device = _device(fed, [], len(build_model("cnn").blocks))
    device.run()
    assert [stage for stage, _ in fed.secagg] == ["keys", "shares", "unmask"]
    (upload,) = fed.uploads
    assert upload.extras == {} and all(w.dtype == "int64" for w in upload.weights.values())
    answer = fed.secagg[-1][1]
    assert sorted(answer.seed_shares) == ["dev-003", "dev-peer"] and answer.key_shares == {}
    assert fed.withdrawals == []


@pytest.mark.parametrize("fault, problem, stages", [
    ("forge", "the share from 'dev-peer' does not decrypt", ["keys", "shares"]),
    ("copy_keys", "the roster repeats a public key among ['dev-003', 'dev-peer']", ["keys"]),
], ids=["share-that-does-not-verify", "roster-repeating-a-key"])
def test_a_share_or_roster_the_device_refuses_is_one_warning_naming_the_peer_and_one_withdrawal(
        caplog, fault: str, problem: str, stages: list[str]):
    # A forged share is found when the device opens its inbox; a repeated key before any share leaves.
    fed = FakeFed([_secure(1), TaskResponse(status="done")])
    setattr(fed, fault, True)
    device = _device(fed, [], len(build_model("cnn").blocks))
    device.run()
    (line,) = _problems(caplog)
    assert line.levelname == "WARNING" and problem in line.getMessage()
    (withdrawal,) = fed.withdrawals
    assert "dev-peer" in withdrawal.reason and fed.uploads == []
    assert [stage for stage, _ in fed.secagg] == stages


@pytest.mark.parametrize("bound, inside", [(1e-9, False), (1e9, True)])
def test_a_private_upload_says_whether_the_change_was_inside_the_bound_before_it_was_clipped(bound: float, inside: bool):
    fed = FakeFed([_full(1).model_copy(update={"privacy": PrivacyTerms(clip_norm=bound)}), TaskResponse(status="done")])
    device = _device(fed, [], len(build_model("cnn").blocks))
    device.run()
    (upload,) = fed.uploads
    assert upload.inside_clip is inside
