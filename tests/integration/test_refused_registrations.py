"""A refused registration leaves its trace in the real Fed Server's log, naming the device and the
reason, whether the enrolment refused it (a claim the run rules out) or its body was refused before
(a fingerprint in an older format); the line that starts the rounds says how many devices of the
expected number registered and how many were refused."""
from __future__ import annotations

import httpx

from fed_server.update_checks import shard_sizes
from integration_support import server_pair, small_config, wait_for
from shared.schemas import DeviceProfileMsg, RegisterRequest
from shared.wire import packb, unpackb

HEADERS = {"content-type": "application/msgpack", "accept": "application/msgpack"}


def test_each_refused_registration_is_logged_and_the_start_line_counts_it():
    config = small_config(algorithm="fedavg", rounds=1, **{
        "data.num_devices": 3, "data.max_samples": 300, "deadlines.min_participants": 2})
    sizes = shard_sizes(config.data)
    assert sizes is not None

    def body(device_id: str, shard: int, **changes) -> bytes:
        request = RegisterRequest(device_id=device_id, shard=shard, num_samples=sizes[shard],
                                  profile=DeviceProfileMsg(kind="high", flops=1e10, rate=1e7)).model_dump()
        return packb({**request, **changes})

    with server_pair(config, "refused-registrations") as servers, httpx.Client(headers=HEADERS, timeout=30) as client:
        url = f"{servers.fed_url}/v1/devices/register"
        fingerprint = unpackb(client.get(f"{servers.fed_url}/v1/run").content)["fingerprint"]
        older = {k: v for k, v in fingerprint.items() if k not in ("loss", "task")}   # before loss and task were in it
        answer = client.post(url, content=body("dev-old", 2, fingerprint=older))
        assert answer.status_code == 422, answer.text
        detail = answer.json()["detail"]
        assert "fingerprint is in an older format (without loss, task): update the software that computed it" in detail
        assert "Field required" not in detail, detail
        answer = client.post(url, content=body("dev-002", 2, num_samples=sizes[2] + 1))
        assert answer.status_code == 422, answer.text
        for device, shard in (("dev-000", 0), ("dev-001", 1)):
            assert client.post(url, content=body(device, shard)).status_code == 200

        def log() -> str:
            return servers.fed.log_path.read_text()
        wait_for(lambda: "starting 1 rounds" in log(), 60, "the rounds to start")
        lines = log().splitlines()   # the servers' folder goes with them
    assert any("registration of dev-old refused (422): " in line and "older format (without loss, task)" in line
               for line in lines), lines
    assert any("registration of dev-002 refused: " in line and f"shard 2 trains on {sizes[2]} samples" in line
               for line in lines), lines
    assert any("2 of 3 devices registered: 1 refused for what they claimed, 0 not registered by the deadline" in line
               for line in lines), lines
