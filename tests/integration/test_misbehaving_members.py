"""A group member or Main Server replica that is alive but wrong cannot stall its round: real services.

Each case starts a real Fed Server and Main Server (S2FL) on loopback. In the member cases, two
real devices train in threads, ``dev-000`` honest and ``dev-001`` harmful: its steps go out by hand
through an httpx client speaking msgpack, altered, and once refused it falls silent until the test
ends (it neither withdraws nor sends again), so only the Main Server's own report of the drop can
take it out of the round. Deadlines are far longer than the tests wait: a round that ends did not
wait for the member or the group that could not contribute.

Cases:

* a member whose step is harmful (activations x1e30, finite in float32 but far beyond
  ``grouping.max_activation``) or does not fit the group's batch (float64 activations, one label
  too many): refused (422) and dropped at once; the honest member of its group trains every step.
* a member whose step makes its group's training fail (a one-sample step through a model with
  ``BatchNorm1d`` after the cut): the step fails (500) and drops it; the round completes without it.
* a Main Server replica whose group portions the Fed Server refuses
  (``tests/integration/misbehaving_main_server.py``): that replica's devices are left out, each
  because its group portion never arrived, and the round completes with the other replica's group.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from device_agent.clients import HttpFedClient, HttpMainClient
from device_agent.device import Device
from integration_support import ServerPair, final_status, server_pair, small_config, wait_for
from shared.config import RunConfig
from shared.errors import Invalid
from shared.schemas import API, JoinRequest, JoinResponse, StepRequest, StepResponse, WireTensor
from shared.wire import decode_tensor, encode_tensor, packb
from testbed.processes import ProcessGroup, free_port, wait_healthy
from testbed.warm_start import shared_starter

STEP_S = 600.0   # a step deadline this test never reaches: the honest steps must not wait for it
ROUND_S = STEP_S + 60
WATCH_S = 150.0  # how long the test follows the round's watch stream at most
HERE = Path(__file__).resolve().parent

#: What the harmful member does to its step's activations and labels.
Tamper = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


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
    """Joins as the device would; sends its first step by hand, altered by ``tamper``, records the
    answer, and falls silent until ``stop`` (a device that says nothing more, not even a withdrawal)."""

    def __init__(self, url: str, token: str | None, tamper: Tamper, stop: threading.Event) -> None:
        super().__init__(url, token)
        self.tamper = tamper
        self.stop = stop
        self.raw = httpx.Client(timeout=60.0, headers={
            "content-type": "application/msgpack", "accept": "application/msgpack",
            **({"authorization": f"Bearer {token}"} if token else {})})
        self.answers: list[tuple[int, str]] = []   # (status, detail)

    def step(self, round_id: int, req: StepRequest, timeout: float) -> StepResponse:
        fx, labels = self.tamper(decode_tensor(req.fx, what="fx"), decode_tensor(req.labels, what="labels"))
        body = {**req.model_dump(), "fx": WireTensor(**encode_tensor(fx)).model_dump(),
                "labels": WireTensor(**encode_tensor(labels)).model_dump()}
        resp = self.raw.post(f"{self.url}{API}/rounds/{round_id}/step", content=packb(body))
        detail = resp.json()["detail"] if resp.headers["content-type"].startswith("application/json") else ""
        self.answers.append((resp.status_code, detail))
        self.stop.wait()
        raise Invalid(detail or f"status {resp.status_code}")   # the device abandons the round

    def close(self) -> None:
        self.raw.close()
        super().close()


@dataclass
class MemberRun:
    """What a run with a harmful member came to."""

    honest: HonestClient
    harmful: HarmfulClient
    lines: list[dict]        # the Main Server's watch stream of the round, to its last line
    groups: list[dict]       # the Main Server's groups at the end (its /v1/status)
    history: list[dict] = field(default_factory=list)   # the Fed Server's round records, if followed
    main_log: str = ""


def run_with_a_harmful_member(config: RunConfig, tamper: Tamper, model_ref: str | None = None,
                              follow_fed_server: bool = False) -> MemberRun:
    """Start the servers and the two devices, follow the Main Server's watch stream of the round
    to its last line (and the Fed Server to the run's end if ``follow_fed_server``); stop the
    devices and the servers."""
    clients: dict[str, HttpMainClient] = {}
    stop = threading.Event()

    def connector(device_id: str, make: Callable[[str, str | None], HttpMainClient]):
        def connect(url: str, token: str | None) -> HttpMainClient:
            clients[device_id] = make(url, token)
            return clients[device_id]
        return connect

    history: list[dict] = []
    main_args = ["--model", model_ref] if model_ref else []
    with server_pair(config, "misbehaving-member", main_args=main_args) as servers:
        devices = [
            Device("dev-000", 0, HttpFedClient(servers.fed_url), connector("dev-000", HonestClient), kind=None,
                   stop=stop, model_ref=model_ref),
            Device("dev-001", 1, HttpFedClient(servers.fed_url),
                   connector("dev-001", lambda url, token: HarmfulClient(url, token, tamper, stop)), kind=None,
                   stop=stop, model_ref=model_ref),
        ]
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
            lines = _watch_round(servers)
            if follow_fed_server:
                status = final_status(servers.fed_url, WATCH_S)
                assert status["state"] == "finished" and status["driver_error"] is None, status
                history = status["history"]
            groups = httpx.get(f"{servers.main_url}{API}/status", timeout=10).json()["round"]["groups"]
        finally:
            stop.set()
            for t in threads:
                t.join(30)
            main_log = servers.main.log_tail(40)
    assert not errors, errors
    return MemberRun(clients["dev-000"], clients["dev-001"], lines, groups, history, main_log)


def _watch_round(servers: ServerPair) -> list[dict]:
    """The Main Server's watch stream of the run's first round, as the Fed Server reads it, with
    a heartbeat longer than the round takes: every line but the first comes from a change (a
    drop, the end). Up to its last line, or ``WATCH_S``."""
    def open_round() -> int | None:
        status = httpx.get(f"{servers.main_url}{API}/status", timeout=10).json()["round"]
        return None if status is None else status["round_id"]
    wait_for(lambda: open_round() is not None, 120, "the round plan at the Main Server")
    lines: list[dict] = []
    given_up_at = time.monotonic() + WATCH_S
    with httpx.stream("GET", f"{servers.main_url}{API}/rounds/{open_round()}/watch",
                      params={"heartbeat_s": 60}, timeout=120) as stream:
        for line in stream.iter_lines():
            lines.append(json.loads(line))
            if lines[-1]["state"] != "open" or time.monotonic() > given_up_at:
                break
    return lines


def _assert_honest_member_trained(run: MemberRun) -> None:
    """The honest member finished every step it owed, each answered with finite values."""
    honest = run.honest
    assert honest.num_steps and len(honest.answers) == honest.num_steps, (honest.num_steps, honest.answers)
    assert all(finite and math.isfinite(loss) for finite, loss in honest.answers), honest.answers


def _assert_dropped_by_the_main_server(run: MemberRun, reason: str) -> None:
    """The stream reported dev-001's drop for ``reason`` (the Main Server's own, not a departure
    passed on from the Fed Server), then ended with every group's portion delivered."""
    last = run.lines[-1]
    assert last["state"] == "done" and last["undelivered"] == [], (run.lines, run.main_log)
    assert last["dropped"]["dev-001"].startswith(reason), run.lines
    assert [line["state"] for line in run.lines[:-1]] == ["open"] * (len(run.lines) - 1), run.lines


def _scaled_1e30(fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fx * 1e30, labels


def _float64(fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fx.to(torch.float64), labels


def _one_label_too_many(fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fx, torch.cat([labels, labels[:1]])


def _one_sample(fx: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return fx[:1], labels[:1]


@pytest.mark.parametrize("tamper, why", [
    (_scaled_1e30, "step 0 refused: fx: |activation| up to"),
    (_float64, "step 0 refused: fx: dtype float64"),
    (_one_label_too_many, "step 0 refused: labels: shape"),
], ids=["activations_x1e30", "activations_float64", "one_label_too_many"])
def test_a_member_whose_step_is_harmful_or_does_not_fit_is_dropped_and_its_group_trains_and_uploads(tamper, why):
    config = small_config(algorithm="s2fl", rounds=1, **{
        "data.num_devices": 2, "data.max_samples": 300, "train.batch_size": 32,
        "deadlines.round_s": ROUND_S, "deadlines.join_s": 20, "deadlines.step_s": STEP_S})
    run = run_with_a_harmful_member(config, tamper)
    (group,) = run.groups
    assert group["members"] == ["dev-000", "dev-001"], group
    # Its first step was refused, naming why, and it was dropped.
    assert len(run.harmful.answers) == 1, run.harmful.answers
    status, detail = run.harmful.answers[0]
    assert status == 422 and detail.startswith(why) and "dropped" in detail, (status, detail)
    _assert_honest_member_trained(run)
    assert group["done"] == ["dev-000"] and group["dropped"] == ["dev-001"] and group["finished"], (group, run.main_log)
    _assert_dropped_by_the_main_server(run, why)


def test_a_member_whose_step_makes_its_groups_training_fail_is_dropped_and_the_round_completes(monkeypatch):
    # Every device is a group of its own (group_size 1), its server side ending in BatchNorm1d:
    # dev-001's one-sample step cannot be trained. Shards of 100 (80 trained, 20 held out), steps
    # of 16: every honest step has 16 samples.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p))
    config = small_config(algorithm="s2fl", rounds=1, model="batchnorm_model:net", **{
        "data.num_devices": 2, "data.partition": "iid", "data.max_samples": 200, "train.batch_size": 16,
        "grouping.group_size": 1, "evaluation.mode": "federated",
        "deadlines.round_s": ROUND_S, "deadlines.join_s": 20, "deadlines.step_s": STEP_S})
    run = run_with_a_harmful_member(config, _one_sample, model_ref="batchnorm_model:net", follow_fed_server=True)
    failed = "step 0 failed"
    status, detail = run.harmful.answers[0]
    assert len(run.harmful.answers) == 1 and status == 500, run.harmful.answers
    assert failed in detail and "Expected more than 1 value per channel" in detail and "dropped" in detail, detail
    _assert_honest_member_trained(run)
    by_member = {tuple(g["members"]): g for g in run.groups}
    assert by_member[("dev-000",)]["done"] == ["dev-000"], run.groups
    assert by_member[("dev-001",)]["dropped"] == ["dev-001"] and by_member[("dev-001",)]["finished"], run.groups
    _assert_dropped_by_the_main_server(run, f"server-side training of {failed}")
    # The Fed Server took it out on the Main Server's word (the device itself said nothing more),
    # aggregated the other, and did not wait for the round deadline.
    (record,) = run.history
    assert record["status"] == "ok" and record["aggregated"] == ["dev-000"], record
    assert list(record["left"]) == ["dev-001"], record["left"]
    assert record["left"]["dev-001"].startswith(f"dropped by the Main Server: server-side training of {failed}"), record
    assert record["round_time_s"] < 60, record["round_time_s"]


def test_a_replica_whose_group_portions_are_refused_costs_only_its_devices_and_the_round_completes():
    config = small_config(algorithm="s2fl", rounds=1, **{
        "data.num_devices": 4, "data.max_samples": 600, "grouping.group_size": 2, "split.sliding": False,
        "deadlines.round_s": ROUND_S, "deadlines.step_s": STEP_S})
    bad_url = f"http://127.0.0.1:{free_port()}"
    # Two replicas: the real Main Server, and the one whose portions the Fed Server refuses.
    with server_pair(config, "misbehaving-replica", fed_args=["--main-server-url", bad_url]) as servers:
        logs = Path(tempfile.mkdtemp(prefix="sfl-misbehaving-replica-"))
        processes = ProcessGroup(logs, shared_starter())
        try:
            bad = processes.start("misbehaving_main_server", "tests.integration.misbehaving_main_server", [
                "--fed-server-url", servers.fed_url, "--port", bad_url.rsplit(":", 1)[1]])
            wait_healthy(bad_url, bad, timeout=60)
            processes.start("agent", "device_agent", [
                "--fed-server-url", servers.fed_url, "--shards", "0,1,2,3", "--prefix", "dev", "--kinds", "high",
                "--time-scale", str(config.devices.time_scale)])
            status = final_status(servers.fed_url, WATCH_S)
            bad_round = httpx.get(f"{bad_url}{API}/status", timeout=10).json()["round"]
            bad_log = bad.log_tail(40)
        finally:
            processes.stop()
            shutil.rmtree(logs, ignore_errors=True)
    assert status["state"] == "finished" and status["driver_error"] is None, status
    (record,) = status["history"]
    # The bad replica trained its group to the end and sent its portion, cut short, which the
    # Fed Server refused: once, not tried again.
    (group,) = bad_round["groups"]
    assert group["finished"] and sorted(group["done"]) == sorted(group["members"]), bad_round
    assert "cut short" in bad_log and "HTTP 422" in bad_log and "retrying" not in bad_log, bad_log
    # Its devices are left out for that, at its watch stream's "done", not at the round deadline;
    # the other replica's group is aggregated.
    never_arrived = f"its group portion never arrived (groups [{group['group_id']}] could not be delivered)"
    assert record["left"] == {d: never_arrived for d in group["members"]}, record["left"]
    assert record["status"] == "ok" and record["aggregated"], record
    assert sorted(record["aggregated"] + group["members"]) == ["dev-000", "dev-001", "dev-002", "dev-003"], record
    assert group["group_id"] not in [g["group_id"] for g in record["groups"]], record["groups"]
    assert record["round_time_s"] < 60, record["round_time_s"]
