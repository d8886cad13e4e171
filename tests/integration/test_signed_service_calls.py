"""Server-to-server calls cannot be replayed: requests captured on the wire between real servers.

The Fed Server reaches its Main Server, and the Main Server the Fed Server, through recording TCP
proxies, as someone on the network between them would see their plain-HTTP traffic. A short run
goes through (so every captured request was taken once); then each kind of captured request (the
round plan, the watch stream, a group's server portion) is sent again, byte for byte, to the
server it was meant for, and is refused. A request signed afresh is still taken, and a signature
does not carry over to another body.
"""
from __future__ import annotations

import re
import shutil
import socket
import tempfile
from pathlib import Path

import httpx

from integration_support import RecordingProxy, final_status, server_pair, small_config
from shared.auth import MAIN_SERVER, Auth, body_sha256
from shared.wire import packb
from testbed.processes import ProcessGroup
from testbed.warm_start import shared_starter

SERVICE = "service-secret-of-the-replay-test"
ENROL = "enrolment-secret-of-the-replay-test"
CONFIG = small_config(rounds=1, **{"data.num_devices": 2, "data.max_samples": 200, "grouping.group_size": 2})


def _captured(proxy: RecordingProxy, method: str, path: str) -> bytes:
    """The first captured request whose request line matches ``method`` and ``path`` (a regex)."""
    matches = [r for r in proxy.requests() if re.match(rf"{method} {path}(\?\S*)? HTTP/1.1\r\n".encode(), r)]
    assert matches, f"no {method} {path} went through the proxy: {[r.split(b' HTTP')[0] for r in proxy.requests()]}"
    return matches[0]


def _send_raw(url: str, request: bytes) -> str:
    """Send ``request`` as it is to the server at ``url``; its status line and the start of its answer."""
    with socket.create_connection((httpx.URL(url).host, httpx.URL(url).port), timeout=30) as s:
        s.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < 200:
            chunk = s.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.decode("latin-1")


def test_a_captured_server_to_server_request_is_refused_when_replayed():
    to_main, to_fed = RecordingProxy(), RecordingProxy()
    root = Path(tempfile.mkdtemp(prefix="sfl-replay-"))
    secrets = {"SFL_SERVICE_SECRET": SERVICE}
    try:
        with server_pair(CONFIG, "replay", fed_env={**secrets, "SFL_ENROLMENT_SECRET": ENROL}, main_env=secrets,
                         fed_reaches_main=to_main.url, main_reports_to=to_fed.url) as pair:
            to_main.target_port, to_fed.target_port = httpx.URL(pair.main_url).port, httpx.URL(pair.fed_url).port
            agents = ProcessGroup(root / "logs", shared_starter())
            try:
                agents.start("agent", "device_agent", ["--fed-server-url", pair.fed_url, "--shards", "0-1",
                                                       "--kinds", "high"], env={"SFL_ENROLMENT_SECRET": ENROL})
                status = final_status(pair.fed_url, 240)
            finally:
                agents.stop()
            # The run went through the proxies: every request captured below was taken once.
            assert status["state"] == "finished", status
            assert [r["status"] for r in status["history"]] == ["ok"], status

            plan = _captured(to_main, "POST", "/v1/rounds")
            watch = _captured(to_main, "GET", r"/v1/rounds/\d+/watch")
            portion = _captured(to_fed, "POST", r"/v1/rounds/\d+/server-portions")
            for request, url in ((plan, pair.main_url), (watch, pair.main_url), (portion, pair.fed_url)):
                answer = _send_raw(url, request)
                assert answer.startswith("HTTP/1.1 401 "), answer[:300]
                assert "replayed" in answer, answer[:300]

            # Signed afresh, the same plan is taken: what is refused above is the replay.
            head, _, body = plan.partition(b"\r\n\r\n")
            auth = Auth(SERVICE.encode())
            fresh = auth.sign_service_request(MAIN_SERVER, "POST", "/v1/rounds", body_sha256([body]))
            headers = {"content-type": "application/msgpack", **fresh}
            assert httpx.post(f"{pair.main_url}/v1/rounds", content=body, headers=headers, timeout=30).status_code == 200
            # A signature is for its body only: another body under a fresh, valid signature head is refused.
            other = packb({"not": "the signed plan"})
            fresh = auth.sign_service_request(MAIN_SERVER, "POST", "/v1/rounds", body_sha256([body]))
            refused = httpx.post(f"{pair.main_url}/v1/rounds", content=other,
                                 headers={"content-type": "application/msgpack", **fresh}, timeout=30)
            assert refused.status_code == 401 and "not the one it signed" in refused.text, refused.text
    finally:
        to_main.close()
        to_fed.close()
        shutil.rmtree(root, ignore_errors=True)
