"""A group member that is alive but wrong cannot break its group: real services.

A real Fed Server and Main Server (S2FL, cnn, the two devices in one group) with a real honest
device, ``dev-000``, training in a thread, and a harmful member, ``dev-001``, a real device whose
steps a hand-driven httpx client sends as msgpack with the activations multiplied by 1e30 (finite
in float32, far beyond ``grouping.max_activation``). Joined into the group batch, they used to
make the group's copy NaN: the honest member got non-finite gradients and its agent stopped.

Its first step must be refused (422) and drop it; the honest member must finish every step with
finite results, without waiting for the step deadline (longer than this test waits); the group
must upload; the Main Server's watch stream must report the drop.
"""
from __future__ import annotations

import json
import math
import threading
import time

import httpx
import torch

from device_agent.clients import HttpFedClient, HttpMainClient
from device_agent.device import Device
from integration_support import server_pair, small_config, wait_for
from shared.errors import Invalid
from shared.schemas import API, JoinRequest, JoinResponse, StepRequest, StepResponse, WireTensor
from shared.wire import decode_tensor, encode_tensor, packb

STEP_S = 600.0   # a step deadline this test never reaches: the honest steps must not wait for it
WATCH_S = 150.0  # how long the test follows the round's watch stream at most


class HonestClient(HttpMainClient):
    """The honest device's own client, recording how many steps it owes and what each step got."""

    def __init__(self, url: str, token: str | None) -> None:
        super().__init__(url, token)
        self.num_steps: int | None = None
        self.answers: list[tuple[bool, float]] = []   # (dfx all finite, loss)

    def join(self, round_id: int, req: JoinRequest, timeout: float) -> JoinResponse:
        self.num_steps = req.num_steps
        return super().join(round_id, req, timeout)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        resp = super().step(round_id, req, timeout)
        dfx = decode_tensor(resp.dfx, require_finite=False, what="dfx")
        self.answers.append((bool(torch.isfinite(dfx).all()), resp.loss))
        return resp


class HarmfulClient(HttpMainClient):
    """Joins as the device would; sends each step by hand, its activations x1e30, and records the answers."""

    def __init__(self, url: str, token: str | None) -> None:
        super().__init__(url, token)
        self.raw = httpx.Client(timeout=60.0, headers={
            "content-type": "application/msgpack", "accept": "application/msgpack",
            **({"authorization": f"Bearer {token}"} if token else {})})
        self.answers: list[tuple[int, str]] = []   # (status, detail)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        fx = decode_tensor(req.fx, what="fx") * 1e30
        body = {**req.model_dump(), "fx": WireTensor(**encode_tensor(fx)).model_dump()}
        resp = self.raw.post(f"{self.url}{API}/rounds/{round_id}/step", content=packb(body))
        detail = resp.json()["detail"] if resp.headers["content-type"].startswith("application/json") else ""
        self.answers.append((resp.status_code, detail))
        raise Invalid(detail or f"status {resp.status_code}")   # the device abandons the round

    def close(self) -> None:
        self.raw.close()
        super().close()


def test_a_member_sending_activations_x1e30_is_dropped_and_its_group_trains_and_uploads():
    config = small_config(algorithm="s2fl", rounds=1, **{
        "data.num_devices": 2, "data.max_samples": 300, "train.batch_size": 32,
        "deadlines.round_s": STEP_S + 60, "deadlines.join_s": 20, "deadlines.step_s": STEP_S})
    clients: dict[str, HttpMainClient] = {}

    def connector(device_id: str, kind: type[HttpMainClient]):
        def connect(url: str, token: str | None) -> HttpMainClient:
            clients[device_id] = kind(url, token)
            return clients[device_id]
        return connect

    stop = threading.Event()
    lines: list[dict] = []
    with server_pair(config, "misbehaving") as servers:
        devices = [Device("dev-000", 0, HttpFedClient(servers.fed_url), connector("dev-000", HonestClient), kind=None, stop=stop),
                   Device("dev-001", 1, HttpFedClient(servers.fed_url), connector("dev-001", HarmfulClient), kind=None, stop=stop)]
        errors: list[BaseException] = []

        def run(device: Device) -> None:
            try:
                device.run()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(d,), daemon=True) for d in devices]
        for t in threads:
            t.start()
        try:
            def open_round() -> int | None:
                status = httpx.get(f"{servers.main_url}{API}/status", timeout=10).json()["round"]
                return None if status is None else status["round_id"]
            wait_for(lambda: open_round() is not None, 120, "the round plan at the Main Server")
            # The watch stream as the Fed Server reads it, with a heartbeat longer than the round
            # takes: every line but the first comes from a change (a drop, the end).
            given_up_at = time.monotonic() + WATCH_S
            with httpx.stream("GET", f"{servers.main_url}{API}/rounds/{open_round()}/watch",
                              params={"heartbeat_s": 60}, timeout=120) as stream:
                for line in stream.iter_lines():
                    lines.append(json.loads(line))
                    if lines[-1]["state"] != "open" or time.monotonic() > given_up_at:
                        break
            group = httpx.get(f"{servers.main_url}{API}/status", timeout=10).json()["round"]["groups"][0]
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            main_log = servers.main.log_tail(40)

    assert not errors, errors
    honest, harmful = clients["dev-000"], clients["dev-001"]
    assert group["members"] == ["dev-000", "dev-001"], group
    # The harmful member's first step was refused, naming why, and it was dropped: it sent no other.
    assert len(harmful.answers) == 1, harmful.answers
    status, detail = harmful.answers[0]
    assert status == 422 and "beyond the bound" in detail and "dropped" in detail, (status, detail)
    # The honest member finished every step it owed, each answered with finite values.
    assert honest.num_steps and len(honest.answers) == honest.num_steps, (honest.num_steps, honest.answers)
    assert all(finite and math.isfinite(loss) for finite, loss in honest.answers), honest.answers
    assert group["done"] == ["dev-000"] and group["dropped"] == ["dev-001"] and group["finished"], (group, main_log)
    # The stream reported the drop with its reason, then ended with the group's portion delivered.
    assert lines[-1]["state"] == "done" and lines[-1]["undelivered"] == [], (lines, main_log)
    assert "beyond the bound" in lines[-1]["dropped"]["dev-001"], lines
    assert [line["state"] for line in lines[:-1]] == ["open"] * (len(lines) - 1), lines
