"""An agent's session through the real services: an agent hosting several devices registers them
in batches and asks for their tasks in one held request, never one request per device; the
endpoints refuse what does not fit, and a batch registers or refuses each device on its own."""
from __future__ import annotations


import httpx
import pytest

from integration_support import body_bytes, server_pair, small_config
from shared.data import device_shard, load_dataset
from shared.schemas import (
    API, AgentTaskResponse, DeviceProfileMsg, RegisterRequest, RegistrationBatchResponse, RunInfo,
)
from shared.wire import packb, unpackb
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

MSGPACK = {"content-type": "application/msgpack"}
ENROL = "enrolment-secret-for-tests"
AGENT = "a" * 32


def test_an_agent_hosting_several_devices_gets_every_task_through_its_session(tmp_path):
    config = small_config(algorithm="fedavg", rounds=2, devices_per_round=3, **{"data.num_devices": 6,
                                                                                "data.max_samples": 600})
    with Testbed(config, tmp_path / "run", agents=1, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
        metrics = httpx.get(f"{testbed.fed_url}/metrics", timeout=30).text
    assert status["state"] == "finished" and status["rounds_done"] == 2, status
    assert body_bytes(metrics, f"{API}/agents/{{agent_id}}/tasks") > 0
    assert body_bytes(metrics, f"{API}/devices/{{device_id}}/task") == 0, metrics   # no device polled on its own
    assert body_bytes(metrics, f"{API}/devices/registrations") > 0
    assert body_bytes(metrics, f"{API}/devices/register") == 0   # nor registered on its own


@pytest.fixture(scope="module")
def servers():
    # The tests register the same device ids in turn: no re-registration limit here.
    config = small_config(algorithm="fedavg", **{"data.num_devices": 4, "data.max_samples": 200,
                                                 "deadlines.registration_s": 3600,
                                                 "deadlines.reregistration_s": 0.0})
    with server_pair(config, "agent-tasks", fed_env={"SFL_SERVICE_SECRET": "service", "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": "service"}) as pair:
        yield pair.fed_url


def _ask(fed_url: str, body, agent: str = AGENT) -> httpx.Response:
    return httpx.post(f"{fed_url}{API}/agents/{agent}/tasks", content=packb(body), headers=MSGPACK, timeout=30)


def _registration(fed_url: str, device: str, shard: int, samples: int | None = None) -> RegisterRequest:
    """What an honest device of ``shard`` registers with (``samples``: another count)."""
    run = RunInfo.model_validate(unpackb(httpx.get(f"{fed_url}{API}/run").content))
    held = len(device_shard(run.data, load_dataset(run.data)[0], shard))
    return RegisterRequest(device_id=device, shard=shard, num_samples=held - int(held * (run.holdout or 0))
                           if samples is None else samples, profile=DeviceProfileMsg(flops=1e9, rate=1e6))


def _register(fed_url: str, device: str, shard: int) -> str:
    req = _registration(fed_url, device, shard)
    answer = httpx.post(f"{fed_url}{API}/devices/register", content=packb(req.model_dump()),
                        headers={**MSGPACK, "x-enrolment-secret": ENROL}, timeout=30)
    assert answer.status_code == 200, answer.text
    return unpackb(answer.content)["token"]


@pytest.mark.parametrize("agent, body, word", [
    ("not-hex", {"add": []}, "agent_id"),
    ("A" * 32, {"add": []}, "agent_id"),
    (AGENT, {"add": [{"device_id": f"dev-{i}"} for i in range(1001)]}, "add"),
    (AGENT, {"add": [{"device_id": "dev-0"}, {"device_id": "dev-0"}]}, "more than once"),
    (AGENT, {"add": [], "wait_s": 31}, "wait_s"),
    (AGENT, {"add": [{"device_id": "../x"}]}, "device_id"),
    (AGENT, {"add": [], "extra": 1}, "extra"),
])
def test_a_session_request_that_does_not_fit_is_refused_with_one_line(servers, agent, body, word):
    answer = _ask(servers, body, agent)
    assert answer.status_code == 422 and word in answer.text, answer.text


def test_only_devices_with_their_current_tokens_join_a_session(servers):
    token_a, token_b = _register(servers, "dev-a", 0), _register(servers, "dev-b", 1)
    answer = _ask(servers, {"add": [{"device_id": "dev-a", "token": token_b}, {"device_id": "dev-b", "token": token_b},
                                    {"device_id": "dev-x", "token": token_a}, {"device_id": "dev-c"}]})
    assert answer.status_code == 200, answer.text
    result = AgentTaskResponse.model_validate(unpackb(answer.content))
    assert result.new_session and result.tasks == []
    assert sorted(result.unknown) == ["dev-c", "dev-x"] and list(result.refused) == ["dev-a"]
    again = AgentTaskResponse.model_validate(unpackb(_ask(servers, {"add": [], "wait_s": 0.2}).content))
    assert not again.new_session and again.tasks == []   # the run waits for its other devices


def _batch(fed_url: str, body, secret: str | None = ENROL) -> httpx.Response:
    headers = {**MSGPACK, **({"x-enrolment-secret": secret} if secret else {})}
    return httpx.post(f"{fed_url}{API}/devices/registrations", content=packb(body), headers=headers, timeout=30)


def test_a_registration_batch_registers_each_device_on_its_own(servers):
    good = _registration(servers, "dev-c", 2)
    held = _registration(servers, "dev-d", 0)   # shard 0 is dev-a's (registered by the test above, or now)
    _register(servers, "dev-a", 0)
    lying = _registration(servers, "dev-e", 3, samples=10**9)
    body = {"devices": [d.model_dump() for d in (good, held, lying)]}
    assert _batch(servers, body, secret=None).status_code == 401
    assert _batch(servers, body, secret="wrong").status_code == 401
    answer = _batch(servers, body)
    assert answer.status_code == 200, answer.text
    result = RegistrationBatchResponse.model_validate(unpackb(answer.content))
    assert [r.device_id for r in result.registered] == ["dev-c"] and result.registered[0].token
    assert {d: r.status for d, r in result.refused.items()} == {"dev-d": 409, "dev-e": 422}
    assert "already held" in result.refused["dev-d"].detail
    # The registered device's token works; the refused ones hold none.
    task = httpx.get(f"{servers}{API}/devices/dev-c/task", headers={"authorization": f"Bearer {result.registered[0].token}"})
    assert task.status_code == 200


@pytest.mark.parametrize("devices, word", [
    ([], "devices"),
    ([{"device_id": f"dev-{i}"} for i in range(101)], "devices"),
])
def test_a_registration_batch_that_does_not_fit_is_refused_with_one_line(servers, devices, word):
    body = {"devices": [_registration(servers, d["device_id"], 1).model_dump() for d in devices]}
    answer = _batch(servers, body)
    assert answer.status_code == 422 and word in answer.text, answer.text


def test_a_registration_batch_naming_a_device_twice_is_refused(servers):
    device = _registration(servers, "dev-f", 1).model_dump()
    answer = _batch(servers, {"devices": [device, device]})
    assert answer.status_code == 422 and "more than once" in answer.text
