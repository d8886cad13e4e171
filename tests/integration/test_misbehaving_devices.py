"""Devices that are alive but wrong, against the real services: none may stop, stall or steer a run.

Each case starts its own Fed Server and Main Server (``server_pair``) and plays the devices by hand
with an httpx client speaking msgpack, so a device does exactly the one wrong thing the case is
about. The rounds' deadlines are long (``round_s`` 120 s): a run that finishes well before
it did not wait for the device that could not contribute; the records say why it was left out.

Cases, by what the device does wrong:

* Fed Server, registration: claims more samples than its shard holds.
* Fed Server, uploads: an upload the Fed Server refuses; a withdrawal.
* Fed Server, federated evaluation: claims more held-out samples than it holds.
* Fed Server, plan phase: a Main Server replica that accepts connections and never answers.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from fed_server.update_checks import held_out_count, shard_sizes, trained_samples
from integration_support import ServerPair, server_pair, small_config, wait_for
from shared.config import RunConfig
from shared.schemas import (
    API, DeviceProfileMsg, DeviceTimings, EvaluationReport, RegisterRequest, TaskResponse, UpdateRequest,
    WeightsResponse, WithdrawRequest,
)
from shared.wire import packb, unpackb

HEADERS = {"content-type": "application/msgpack", "accept": "application/msgpack"}
ROUND_S = 120.0
DEVICES = ("dev-0", "dev-1")


# --- helpers: a device played by hand ---------------------------------------------------------

@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0, headers=HEADERS) as c:
        yield c


def _config(**overrides) -> RunConfig:
    return small_config(algorithm="fedavg", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200,
                                                         "deadlines.round_s": ROUND_S, **overrides})


def _post(client: httpx.Client, url: str, message) -> httpx.Response:
    return client.post(url, content=packb(message.model_dump() if hasattr(message, "model_dump") else message))


def _register(client: httpx.Client, fed_url: str, device: str, shard: int, num_samples: int,
              label_counts: list[int] | None = None) -> httpx.Response:
    return _post(client, f"{fed_url}{API}/devices/register", RegisterRequest(
        device_id=device, shard=shard, num_samples=num_samples, profile=DeviceProfileMsg(flops=1e9, rate=1e6),
        label_counts=label_counts))


def _trains_on(config: RunConfig, shard: int) -> int:
    """The sample count the device of ``shard`` registers with: its shard less its held-out part."""
    size = shard_sizes(config.data)[shard]
    return trained_samples(size, config.evaluation.holdout if config.evaluation.mode == "federated" else None)


def _register_all(client: httpx.Client, config: RunConfig, fed_url: str) -> None:
    for shard, device in enumerate(DEVICES):
        answer = _register(client, fed_url, device, shard, _trains_on(config, shard))
        assert answer.status_code == 200, answer.text


def _task(client: httpx.Client, fed_url: str, device: str, status: str, timeout: float = 60.0) -> TaskResponse:
    """Long-poll ``device``'s task until it is ``status``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = client.get(f"{fed_url}{API}/devices/{device}/task", params={"wait_s": 5})
        assert answer.status_code == 200, answer.text
        task = TaskResponse.model_validate(unpackb(answer.content))
        if task.status == status:
            return task
    raise AssertionError(f"{device} got no {status!r} task in {timeout:.0f}s")


def _honest_update(client: httpx.Client, config: RunConfig, fed_url: str, device: str, task: TaskResponse) -> UpdateRequest:
    """The update of a device that trained and changed nothing: the weights it was sent, back."""
    answer = client.get(f"{fed_url}{API}/devices/{device}/weights/{task.weights_id}")
    assert answer.status_code == 200, answer.text
    weights = WeightsResponse.model_validate(unpackb(answer.content)).weights
    return UpdateRequest(device_id=device, round_id=task.round_id, num_samples=_trains_on(config, DEVICES.index(device)),
                         steps=1, train_loss=1.0, weights=weights, bytes_up=0, bytes_down=0,
                         timings=DeviceTimings(compute_s=1.0, transfer_s=0.1, wait_s=0.0, server_s=0.0, total_s=1.1))


def _upload(client: httpx.Client, fed_url: str, update: UpdateRequest) -> httpx.Response:
    return _post(client, f"{fed_url}{API}/rounds/{update.round_id}/updates", update)


def _status(client: httpx.Client, fed_url: str) -> dict:
    answer = client.get(f"{fed_url}{API}/status")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _finished(client: httpx.Client, servers: ServerPair, timeout: float = 60.0) -> dict:
    """The run's status once it has finished: well inside ``ROUND_S``, so no round waited it out."""
    wait_for(lambda: _status(client, servers.fed_url)["state"] == "finished", timeout, "the run to finish", poll_s=0.2)
    status = _status(client, servers.fed_url)
    assert status["driver_error"] is None, status["driver_error"]
    return status


def _detail(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, (answer.status_code, answer.text)
    return answer.json()["detail"]


# --- Fed Server: registration -------------------------------------------------------------------

def test_a_registration_claiming_more_samples_than_its_shard_is_refused_and_changes_nothing(client):
    config = _config()
    with server_pair(config, "misbehaving-register") as servers:
        before = _status(client, servers.fed_url)
        for claimed in (10**12, _trains_on(config, 0) + 1):
            detail = _detail(_register(client, servers.fed_url, "dev-0", 0, claimed), 422)
            assert f"num_samples={claimed}" in detail and f"trains on {_trains_on(config, 0)} samples" in detail
        assert _status(client, servers.fed_url) == before
        assert _register(client, servers.fed_url, "dev-0", 0, _trains_on(config, 0)).status_code == 200
        assert _status(client, servers.fed_url)["registered"] == 1


# --- Fed Server: uploads ------------------------------------------------------------------------

def test_a_refused_upload_takes_the_device_out_and_the_round_ends_without_it(client):
    config = _config()
    with server_pair(config, "misbehaving-refused") as servers:
        _register_all(client, config, servers.fed_url)
        tasks = {d: _task(client, servers.fed_url, d, "train") for d in DEVICES}
        honest = {d: _honest_update(client, config, servers.fed_url, d, t) for d, t in tasks.items()}
        # Timings beyond the round deadline: refused for the device's own fault.
        late = honest["dev-1"].model_copy(update={"timings": honest["dev-1"].timings.model_copy(
            update={"compute_s": ROUND_S * 2})})
        refusal = _detail(_upload(client, servers.fed_url, late), 422)
        assert "deadline" in refusal
        # Out of the attempt: even its honest upload is too late now.
        assert "taken out" in _detail(_upload(client, servers.fed_url, honest["dev-1"]), 409)
        assert _upload(client, servers.fed_url, honest["dev-0"]).status_code == 200
        status = _finished(client, servers)
    (record,) = status["history"]
    assert record["status"] == "ok" and record["aggregated"] == ["dev-0"] and record["dropped"] == ["dev-1"]
    assert record["left"] == {"dev-1": f"upload refused: {refusal}"}
    assert record["round_time_s"] < ROUND_S / 2


def test_a_withdrawal_ends_the_wait_for_the_device(client):
    config = _config()
    with server_pair(config, "misbehaving-withdraw") as servers:
        _register_all(client, config, servers.fed_url)
        tasks = {d: _task(client, servers.fed_url, d, "train") for d in DEVICES}
        round_id = tasks["dev-1"].round_id
        withdrawal = WithdrawRequest(device_id="dev-1", round_id=round_id, reason="unknown algorithm 'x'")
        url = f"{servers.fed_url}{API}/rounds/{round_id}/withdrawals"
        assert "not open" in _detail(_post(client, f"{servers.fed_url}{API}/rounds/{round_id + 1}/withdrawals",
                                           withdrawal.model_copy(update={"round_id": round_id + 1})), 409)
        assert "reason" in _detail(_post(client, url, {**withdrawal.model_dump(), "reason": "x" * 501}), 422)
        for _ in range(2):   # idempotent
            answer = _post(client, url, withdrawal)
            assert answer.status_code == 200 and unpackb(answer.content)["ok"], answer.text
        honest = _honest_update(client, config, servers.fed_url, "dev-0", tasks["dev-0"])
        assert _upload(client, servers.fed_url, honest).status_code == 200
        status = _finished(client, servers)
    (record,) = status["history"]
    assert record["aggregated"] == ["dev-0"] and record["left"] == {"dev-1": "withdrew: unknown algorithm 'x'"}
    assert record["round_time_s"] < ROUND_S / 2


# --- Fed Server: federated evaluation -----------------------------------------------------------

def test_an_evaluation_claiming_more_held_out_samples_than_the_device_holds_is_refused(client):
    # The evaluation deadline is longer than _finished waits: the phase must end without it.
    config = _config(**{"evaluation.mode": "federated", "evaluation.holdout": 0.2, "deadlines.evaluate_s": 120})
    held = {d: held_out_count(shard_sizes(config.data)[i], 0.2) for i, d in enumerate(DEVICES)}
    with server_pair(config, "misbehaving-evaluation") as servers:
        _register_all(client, config, servers.fed_url)
        for device in DEVICES:
            task = _task(client, servers.fed_url, device, "train")
            update = _honest_update(client, config, servers.fed_url, device, task)
            assert _upload(client, servers.fed_url, update).status_code == 200
        round_id = _task(client, servers.fed_url, "dev-1", "evaluate").round_id
        url = f"{servers.fed_url}{API}/evaluation"
        inflated = EvaluationReport(device_id="dev-1", round_id=round_id, num_samples=held["dev-1"] + 1,
                                    correct=held["dev-1"] + 1, loss_sum=0.0)
        assert f"the {held['dev-1']} samples 'dev-1' holds out" in _detail(_post(client, url, inflated), 422)
        # Its one report was unusable: it has no other in this phase, and the phase stops waiting for it.
        honest = inflated.model_copy(update={"num_samples": held["dev-1"], "correct": held["dev-1"]})
        assert "was refused" in _detail(_post(client, url, honest), 409)
        _task(client, servers.fed_url, "dev-0", "evaluate")
        assert _post(client, url, EvaluationReport(device_id="dev-0", round_id=round_id, num_samples=held["dev-0"],
                                                   correct=0, loss_sum=1.0)).status_code == 200
        status = _finished(client, servers)
    (record,) = status["history"]
    assert record["evaluated_samples"] == held["dev-0"] and record["test_accuracy"] == 0.0


# --- Fed Server: plan phase ---------------------------------------------------------------------

class BlackHole:
    """A TCP server that accepts every connection and reads what it is sent, but never answers: a
    frozen (SIGSTOPped) process, as its peers see it."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:   # closed
                return
            self.held.append(conn)
            threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()

    @staticmethod
    def _swallow(conn: socket.socket) -> None:
        try:
            while conn.recv(1 << 16):
                pass
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for conn in self.held:
            conn.close()


def test_a_frozen_replica_does_not_hold_the_plan_phase_and_its_groups_go_to_the_live_one(client):
    config = small_config(algorithm="s2fl", rounds=1, **{"data.num_devices": 2, "data.max_samples": 200,
                                                         "deadlines.round_s": ROUND_S})
    frozen = BlackHole()
    try:
        # Two replicas: the real Main Server, and one that takes the plan and never answers.
        with server_pair(config, "misbehaving-frozen-replica", fed_args=["--main-server-url", frozen.url]) as servers:
            for shard, device in enumerate(DEVICES):
                answer = _register(client, servers.fed_url, device, shard, _trains_on(config, shard),
                                   label_counts=[10] * 10)
                assert answer.status_code == 200, answer.text
            # The tasks go out once the plan phase is over: one try of replica_timeout_s (10 s) for
            # the frozen replica, then its groups planned on the live one. It used to take minutes.
            tasks = [_task(client, servers.fed_url, d, "train", timeout=60.0) for d in DEVICES]
            assert {t.main_server_url for t in tasks} == {servers.main_url}
    finally:
        frozen.close()
