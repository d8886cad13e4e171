"""The device runner against in-memory fake servers: no HTTP, no processes.

The fakes implement device_agent.api's interfaces; the Main Server fake trains a real server
portion, so the split exchange (activations up, gradients down) is the one a real round runs.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from device_agent.api import Unreachable
from device_agent.device import Device
from shared.config import TrainConfig
from shared.data import DataSpec
from shared.errors import NotFound
from shared.models import build_model, model_fingerprint
from shared.portions import portion_state
from shared.schemas import (
    JoinRequest, JoinResponse, RegisterRequest, RegisterResponse, ReportRequest, RunInfo, StepRequest, StepResponse,
    TaskResponse, UpdateRequest, WireTensor,
)
from shared.wire import decode_state, decode_tensor, encode_state, encode_tensor, packb

SPEC = DataSpec(num_devices=8, max_samples=400)
INFO = RunInfo(run_id="run-1", algorithm="s2fl", model="cnn", num_classes=10, input_shape=[1, 28, 28], data=SPEC, seed=5,
               fingerprint=model_fingerprint(build_model("cnn", 10, (1, 28, 28), seed=5), SPEC))


class FakeFed:
    """Answers polls from a script (a TaskResponse or an exception to raise), records the rest."""

    def __init__(self, script: list) -> None:
        self.script = list(script)
        self.registrations: list[RegisterRequest] = []
        self.uploads: list[UpdateRequest] = []
        self.reports: list[ReportRequest] = []

    def run_info(self) -> RunInfo:
        return INFO

    def register(self, req: RegisterRequest) -> RegisterResponse:
        self.registrations.append(req)
        return RegisterResponse(run_id=INFO.run_id, device_id=req.device_id, shard=req.shard,
                                token=f"token-{len(self.registrations)}")

    def task(self, device_id: str, final_weights: bool) -> tuple[TaskResponse, int]:
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer, len(packb(answer.model_dump()))

    def report(self, req: ReportRequest) -> None:
        self.reports.append(req)

    def upload(self, req: UpdateRequest) -> None:
        self.uploads.append(req)


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
                        weights=encode_state(portion_state(model, 0, split)), train=TrainConfig(batch_size=32),
                        main_server_url=main_url, deadline_s=120.0, algorithm="fedavg" if main_url is None else "s2fl")


def _device(fed: FakeFed, mains: list[FakeMain], split: int) -> Device:
    def connect(url: str, token: str | None) -> FakeMain:
        mains.append(FakeMain(url, token, split))
        return mains[-1]

    return Device("dev-003", 3, fed, connect, kind=None, stop=threading.Event(), poll_interval_s=0.01)


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
