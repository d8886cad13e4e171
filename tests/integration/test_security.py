"""Authentication and TLS against running servers: enrolment, per-device tokens, service tokens, HTTPS."""
from __future__ import annotations

import functools
import json
import math
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from fed_server.reregistrations import REFUSAL_HOLD_S
from integration_support import make_tls, read_metrics, server_pair, small_config, wait_for
from shared.auth import FED_SERVER, MAIN_SERVER, Auth, CredentialScope, body_sha256, issue_credential
from shared.data import device_shard, load_dataset
from shared.models import build_model
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, JoinRequest, Participant, RegisterRequest, RegistrationBatch, RoundPlan, RunInfo, StepRequest,
    UpdateRequest, WireTensor,
)
from shared.config import TrainConfig
from shared.wire import encode_state, encode_tensor, packb, unpackb
from testbed.processes import ProcessGroup, service_env
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

SERVICE = "service-secret-for-tests"
ENROL = "enrolment-secret-for-tests"
KEY = "enrolment-key-for-tests"
ROOT = Path(__file__).resolve().parents[2]
MSGPACK = {"content-type": "application/msgpack"}


#: ``deadlines.reregistration_s`` of the servers whose tests enrol one device id several times a
#: second to check the tokens: no limit there (its own test sets one).
NO_LIMIT = 0.0



def test_full_run_over_https_with_authentication(tmp_path):
    tls = make_tls(tmp_path)
    config = small_config(rounds=2)
    with Testbed(config, tmp_path / "run", tls=tls, warm=shared_starter()) as testbed:
        assert testbed.fed_url.startswith("https://") and testbed.secrets
        status = testbed.follow(timeout=240)
    assert status["state"] == "finished"
    assert [r["status"] for r in read_metrics(tmp_path / "run")] == ["ok", "ok"]
    assert status["summary"]["final_accuracy"] > status["summary"]["initial_accuracy"]
    # Plain HTTP to an HTTPS server, and HTTPS without our CA, both fail.
    with pytest.raises(httpx.HTTPError):
        httpx.get(testbed.fed_url.replace("https", "http") + "/healthz", timeout=3)


# --- refusals against running servers (auth on, no agents) ---------------------------------------

@pytest.fixture(scope="module")
def servers():
    # The Fed Server must not start rounds while these tests post their own plan (round 99) to
    # its Main Server: each of its attempts would replace that plan there. Four shards with two
    # ever registered, and a registration deadline past the module, keep it waiting.
    config = small_config(**{"data.num_devices": 4, "data.max_samples": 200, "rounds": 1,
                             "deadlines.registration_s": 3600, "deadlines.reregistration_s": NO_LIMIT})
    with server_pair(config, "auth", fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        yield pair.fed_url, pair.main_url


def _samples(fed_url: str, shard: int) -> int:
    """The count an honest device of ``shard`` registers with: its shard of the run's data spec, less
    the part it holds out for federated evaluation."""
    return _run_samples(unpackb(httpx.get(f"{fed_url}/v1/run").content)["run_id"], fed_url, shard)


@functools.lru_cache
def _run_samples(run_id: str, fed_url: str, shard: int) -> int:
    run = RunInfo.model_validate(unpackb(httpx.get(f"{fed_url}/v1/run").content))
    n = len(device_shard(run.data, load_dataset(run.data)[0], shard))
    return n - math.floor(n * run.holdout) if run.holdout else n


def _post(url: str, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url, content=packb(body.model_dump() if hasattr(body, "model_dump") else body),
                      headers={**MSGPACK, **(headers or {})}, timeout=30)


def _register(fed_url: str, device: str, shard: int, headers: dict | None) -> httpx.Response:
    """Register ``device`` on ``shard`` with the count an honest device of that shard sends."""
    req = RegisterRequest(device_id=device, shard=shard, num_samples=_samples(fed_url, shard),
                          profile=DeviceProfileMsg(flops=1e9, rate=1e6))
    return _post(f"{fed_url}/v1/devices/register", req, headers)


def _signed(auth: Auth, audience: str, method: str, url: str, body=None) -> dict:
    """The signature headers a server puts on a call to ``audience`` (``body``: what :func:`_post` sends)."""
    packed = packb(body.model_dump() if hasattr(body, "model_dump") else body) if body is not None else b""
    target = httpx.URL(url).raw_path.decode()
    return auth.sign_service_request(audience, method, target, body_sha256([packed]))


def _bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def _token(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return unpackb(response.content)["token"]


def _task(fed_url: str, device: str, token: str | None) -> int:
    return httpx.get(f"{fed_url}/v1/devices/{device}/task", headers=_bearer(token) if token else None).status_code


def test_enrolment_needs_the_secret_and_each_enrolment_revokes_the_previous_token(servers):
    fed_url, _ = servers
    assert _register(fed_url, "dev-a", 0, None).status_code == 401
    assert _register(fed_url, "dev-a", 0, {"x-enrolment-secret": "wrong"}).status_code == 401
    assert httpx.get(f"{fed_url}/v1/status").json()["registered"] == 0
    first = _token(_register(fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL}))
    assert _task(fed_url, "dev-a", first) == 200
    # A restarted agent has lost its token: the enrolment secret alone enrols it again, under the
    # same id and shard, with a new token; the token of the dead process is revoked.
    second = _token(_register(fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL}))
    assert second != first
    assert _task(fed_url, "dev-a", first) == 403
    assert _task(fed_url, "dev-a", second) == 200
    # Weights are fetched under the same check, before the lookup: a revoked token learns nothing.
    weights = f"{fed_url}/v1/devices/dev-a/weights/{'0' * 32}"
    assert httpx.get(weights).status_code == 401 and httpx.get(weights, headers=_bearer(first)).status_code == 403
    assert httpx.get(weights, headers=_bearer(second)).status_code == 404   # none served before a round
    assert httpx.get(f"{fed_url}/v1/status").json()["registered"] == 1
    # Re-enrolling cannot take another device's shard, and a refused enrolment revokes nothing.
    other = _token(_register(fed_url, "dev-b", 1, {"x-enrolment-secret": ENROL}))
    assert _register(fed_url, "dev-a", 1, {"x-enrolment-secret": ENROL}).status_code == 409
    assert _task(fed_url, "dev-a", second) == 200 and _task(fed_url, "dev-b", other) == 200


def test_a_device_registering_again_too_soon_is_answered_429_with_retry_after_and_keeps_its_token(tmp_path):
    config = small_config(**{"data.num_devices": 4, "data.max_samples": 200, "rounds": 1,
                             "deadlines.registration_s": 3600, "deadlines.reregistration_s": 30})
    with server_pair(config, "limited", fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        secret = {"x-enrolment-secret": ENROL}
        token = _token(_register(pair.fed_url, "dev-a", 0, secret))
        asked = time.monotonic()
        again = _register(pair.fed_url, "dev-a", 0, secret)
        # The refusal is held a second before it is sent, and its Retry-After counts from the answer.
        assert time.monotonic() - asked >= REFUSAL_HOLD_S
        assert again.status_code == 429 and 20 <= int(again.headers["retry-after"]) <= 29, again.text
        assert "deadlines.reregistration_s" in again.json()["detail"]
        assert _task(pair.fed_url, "dev-a", token) == 200          # nothing changed: its token still works
        batch = RegistrationBatch(devices=[
            RegisterRequest(device_id="dev-a", shard=0, num_samples=_samples(pair.fed_url, 0),
                            profile=DeviceProfileMsg(flops=1e9, rate=1e6)),
            RegisterRequest(device_id="dev-b", shard=1, num_samples=_samples(pair.fed_url, 1),
                            profile=DeviceProfileMsg(flops=1e9, rate=1e6))])
        answer = unpackb(_post(f"{pair.fed_url}/v1/devices/registrations", batch, secret).content)
        assert [r["device_id"] for r in answer["registered"]] == ["dev-b"]
        assert answer["refused"]["dev-a"]["status"] == 429 and 20 <= answer["refused"]["dev-a"]["retry_after_s"] <= 30
        # A client asking again at once on one connection, as a registration loop does, is answered
        # at most once a second: a loop costs the Fed Server a request a second, not thousands.
        again_body = packb(batch.devices[0].model_dump())
        answers = 0
        with httpx.Client(timeout=30) as client:
            started = time.monotonic()
            while time.monotonic() - started < 3.0:
                refused = client.post(f"{pair.fed_url}/v1/devices/register", content=again_body,
                                      headers={**MSGPACK, **secret})
                assert refused.status_code == 429, refused.text
                answers += 1
        assert answers <= 3


def test_device_calls_need_their_own_current_token(servers):
    fed_url, _ = servers
    token_a = _token(_register(fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL}))
    token_b = _token(_register(fed_url, "dev-b", 1, {"x-enrolment-secret": ENROL}))
    assert _task(fed_url, "dev-a", None) == 401
    assert _task(fed_url, "dev-a", "0" * 64) == 403
    assert _task(fed_url, "dev-a", token_b) == 403
    assert _task(fed_url, "dev-a", token_a) == 200
    assert _task(fed_url, "dev-z", token_a) == 404   # unknown device: the agent registers again
    update = UpdateRequest(device_id="dev-a", round_id=1, num_samples=1, steps=0, train_loss=0.0, weights={},
                           timings=DeviceTimings(compute_s=0, transfer_s=0, wait_s=0, server_s=0, total_s=0),
                           bytes_up=0, bytes_down=0)
    assert _post(f"{fed_url}/v1/rounds/1/updates", update).status_code == 401
    assert _post(f"{fed_url}/v1/rounds/1/updates", update, _bearer(token_b)).status_code == 403
    assert _post(f"{fed_url}/v1/rounds/1/updates", update, _bearer("0" * 64)).status_code == 404


def _answer_to_the_head(base_url: str, path: str, auth_line: str, length: int) -> str:
    """The status line answered to a POST whose head announces ``length`` bytes and whose body
    stops after ten: a server that authenticates from the head answers at once."""
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(base_url).hostname, urlsplit(base_url).port
    with socket.create_connection((host, port), timeout=5) as conn:
        conn.sendall((f"POST {path} HTTP/1.1\r\nhost: {host}\r\n{auth_line}content-type: application/msgpack\r\n"
                      f"content-length: {length}\r\n\r\n").encode() + b"x" * 10)
        return conn.recv(4096).decode(errors="replace").split("\r\n")[0]


def test_an_upload_without_a_token_this_server_issued_is_refused_before_its_body_is_read(servers):
    fed_url, _ = servers
    _register(fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL})
    path = "/v1/rounds/1/updates"
    assert _answer_to_the_head(fed_url, path, "", 400_000_000).startswith("HTTP/1.1 401 ")
    assert _answer_to_the_head(fed_url, path, f"authorization: Bearer {'0' * 64}\r\n", 400_000_000).startswith("HTTP/1.1 404 ")


def test_a_token_from_another_run_is_refused(servers):
    """Two runs under the same service secret: a device's token of one run is worthless in the other."""
    fed_url, _ = servers
    # The Fed Server must not start rounds while these tests post their own plan (round 99) to
    # its Main Server: each of its attempts would replace that plan there. Four shards with two
    # ever registered, and a registration deadline past the module, keep it waiting.
    config = small_config(**{"data.num_devices": 4, "data.max_samples": 200, "rounds": 1,
                             "deadlines.registration_s": 3600, "deadlines.reregistration_s": NO_LIMIT})
    with server_pair(config, "auth2", fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as other_run:
        foreign = _token(_register(other_run.fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL}))
        assert _task(other_run.fed_url, "dev-a", foreign) == 200
    _token(_register(fed_url, "dev-a", 0, {"x-enrolment-secret": ENROL}))
    assert _task(fed_url, "dev-a", foreign) == 403


NONCES = {"dev-a": "nonce-a", "dev-b": "nonce-b"}


def _plan() -> RoundPlan:
    """Round 99 of run "r" for dev-a and dev-b, singleton groups formed at a 2 s join deadline."""
    model = build_model("cnn")
    return RoundPlan(run_id="r", round_id=99, round_index=1, model="cnn", num_classes=10, input_shape=[1, 28, 28], seed=0,
                     participants=[Participant(device_id=d, split_point=1, num_samples=10, token_nonce=NONCES[d])
                                   for d in ("dev-a", "dev-b")],
                     server_weights=encode_state(model.portion(1, 4).state_dict()), train=TrainConfig(batch_size=4),
                     grouping="singleton", group_size=1, group_loss="per_member", join_deadline_s=2, step_deadline_s=30)


def test_server_to_server_calls_need_the_service_signature(servers):
    fed_url, main_url = servers
    auth = Auth(SERVICE.encode())
    plan = _plan()
    before = httpx.get(f"{main_url}/v1/status").json()["round"]  # none: the Fed Server starts no round here
    assert _post(f"{main_url}/v1/rounds", plan).status_code == 401
    assert _post(f"{main_url}/v1/rounds", plan, _bearer(auth.device_token("r", "dev-a", NONCES["dev-a"]))).status_code == 401
    assert httpx.get(f"{main_url}/v1/status").json()["round"] == before
    # Signed for the Fed Server, or with another secret: refused too.
    assert _post(f"{main_url}/v1/rounds", plan, _signed(auth, FED_SERVER, "POST", f"{main_url}/v1/rounds", plan)
                 ).status_code == 401
    assert _post(f"{main_url}/v1/rounds", plan, _signed(Auth(b"another secret"), MAIN_SERVER, "POST",
                                                          f"{main_url}/v1/rounds", plan)).status_code == 401
    assert httpx.get(f"{main_url}/v1/status").json()["round"] == before
    assert _post(f"{main_url}/v1/rounds", plan, _signed(auth, MAIN_SERVER, "POST", f"{main_url}/v1/rounds", plan)
                 ).status_code == 200
    assert httpx.get(f"{main_url}/v1/status").json()["round"]["round_id"] == 99
    watch = f"{main_url}/v1/rounds/99/watch"
    assert httpx.get(watch).status_code == 401
    assert httpx.get(watch, headers=_bearer(auth.device_token("r", "dev-a", NONCES["dev-a"]))).status_code == 401
    with httpx.stream("GET", watch, headers=_signed(auth, MAIN_SERVER, "GET", watch), timeout=10) as response:
        assert response.status_code == 200
        first = json.loads(next(response.iter_lines()))
        assert (first["round_id"], first["state"]) == (99, "open")
    portion = {"run_id": "r", "round_id": 1, "group_id": 0, "members": [], "dropped": [], "start_block": 1,
               "weights": {}, "label_distance": 0.0, "steps": 0, "train_time_s": 0.0}
    assert _post(f"{fed_url}/v1/rounds/1/server-portions", portion).status_code == 401


def test_main_server_refuses_a_device_acting_as_another_or_with_a_revoked_token(servers):
    _, main_url = servers
    auth = Auth(SERVICE.encode())
    plan = _plan()
    assert _post(f"{main_url}/v1/rounds", plan, _signed(auth, MAIN_SERVER, "POST", f"{main_url}/v1/rounds", plan)
                 ).status_code == 200
    own = auth.device_token("r", "dev-a", NONCES["dev-a"])
    join = JoinRequest(device_id="dev-a", label_counts=[1] * 10, num_steps=1)
    assert _post(f"{main_url}/v1/rounds/99/join", join).status_code == 401
    for wrong in (auth.device_token("r", "dev-b", NONCES["dev-b"]),   # another device's
                  auth.device_token("r", "dev-a", "revoked-nonce"),   # dev-a's before it enrolled again
                  auth.device_token("other-run", "dev-a", NONCES["dev-a"])):  # another run's
        assert _post(f"{main_url}/v1/rounds/99/join", join, _bearer(wrong)).status_code == 403
    step = StepRequest(device_id="dev-a", step=0, fx=WireTensor(**encode_tensor(torch.zeros(4, 32, 14, 14))),
                       labels=WireTensor(**encode_tensor(torch.zeros(4, dtype=torch.int64))))
    assert _post(f"{main_url}/v1/rounds/99/step", step, _bearer(auth.device_token("r", "dev-b", NONCES["dev-b"]))).status_code == 403
    # Refused from the head, before a 60 MB step body is read.
    path = "/v1/rounds/99/step"
    assert _answer_to_the_head(main_url, path, "", 60_000_000).startswith("HTTP/1.1 401 ")
    foreign = auth.device_token("r", "dev-z", "n")
    assert _answer_to_the_head(main_url, path, f"authorization: Bearer {foreign}\r\n", 60_000_000).startswith("HTTP/1.1 403 ")
    # dev-a's own token gets through authentication: it joins (groups form at the 2 s join deadline).
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", _post(f"{main_url}/v1/rounds/99/join", join,
                                                                            _bearer(own))))
    thread.start()
    thread.join(60)
    assert result["r"].status_code == 200, result["r"].text


# --- a whole run under the testbed's authentication ------------------------------------------------


def test_sigkilled_agent_rejoins_under_authentication_and_no_child_holds_a_secret_in_its_environment(tmp_path):
    # Devices 0-1 in one agent, 2-3 in another. The second agent is SIGKILLed as soon as round 1 is
    # concluded and started again: its devices enrol again (the dead process's tokens die with it).
    # An attempt open when they enrol again is left (the Main Server's plan carries their old
    # tokens), and a missed deadline makes them sit one attempt out. Judged by what the run
    # recorded, not by how fast a loaded machine restarts a process: some round after the restart
    # aggregates all four devices. They may enrol again only deadlines.reregistration_s (10 s) after
    # their first registration, and while they are away a round takes 1 to 2 s on a quiet machine
    # (the time table cuts them short after about 1.7 s, and every other attempt they sit out). With
    # 8 rounds the run could end before they were back (one run in three); with 20, the 19 rounds
    # after the restart took 25 to 29 s on a quiet machine and the devices were back by 12 s.
    config = small_config(rounds=20, **{"deadlines.round_s": 60, "deadlines.join_s": 5, "deadlines.step_s": 5,
                                        "deadlines.max_skip_rounds": 1})
    run_dir = tmp_path / "run"
    # Started with exec, not forked from the warm starter: /proc/<pid>/environ and cmdline of a
    # forked child show the warm process's, so only exec'd children make this check mean something.
    with Testbed(config, run_dir, agents=2) as testbed:
        for service in testbed.processes.services:  # what `ps eww` shows: command line and environment
            seen = Path(f"/proc/{service.process.pid}/environ").read_bytes() + \
                Path(f"/proc/{service.process.pid}/cmdline").read_bytes()
            for secret in testbed.secrets.values():
                assert secret.encode() not in seen, f"{service.name} exposes a secret"
        victim = testbed.agent_services[1]
        # Not rounds_done: round 1's record waits for its evaluation, beside attempt 2.
        wait_for(lambda: (testbed.status()["open_round"] or 0) >= 2, 180, "attempt 2 to begin")
        testbed.processes.restart(victim)
        status = testbed.follow(timeout=240)
    assert status["state"] == "finished"
    ok = [m for m in read_metrics(run_dir) if m["status"] == "ok"]
    assert [m["round"] for m in ok] == list(range(1, 21))
    assert any(m["aggregated"] == ["dev-000", "dev-001", "dev-002", "dev-003"] for m in ok[2:]), \
        [m["aggregated"] for m in ok]
    fed_log = (run_dir / "logs" / "fed_server.log").read_text()
    assert "device dev-002 enrolled again: its previous token is revoked" in fed_log
    assert not testbed.secret_files.folder.exists()  # the secret files go with the testbed


# --- per-device enrolment credentials ---------------------------------------------------------------


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """The operator's command, run as the operator runs it: one credential file per device of shards
    0-3, issued with the enrolment key. Returns the key file's folder; the files are in ``out/``."""
    folder = tmp_path_factory.mktemp("credentials")
    (folder / "enrolment.key").write_text(KEY + "\n")
    done = subprocess.run([sys.executable, "-m", "fed_server", "credentials", "issue", "--key-file",
                           str(folder / "enrolment.key"), "--shards", "0-3", "--out", str(folder / "out")],
                          cwd=ROOT, env=service_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{folder / 'out' / 'dev-002.credential'}: devices dev-002 (shard 2)" in done.stdout
    return folder


def _credential(credentials: Path, device: str) -> dict:
    return {"x-enrolment-secret": (credentials / "out" / f"{device}.credential").read_text().strip()}


def test_the_command_writes_one_owner_only_credential_file_per_device(credentials):
    files = sorted((credentials / "out").iterdir())
    assert [f.name for f in files] == [f"dev-00{i}.credential" for i in range(4)]
    assert stat.S_IMODE((credentials / "out").stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert KEY not in "".join(f.read_text() for f in files)


@pytest.fixture(scope="module")
def keyed():
    """A Fed Server that takes enrolment credentials and the shared secret, capped at two devices.
    Eight shards and a registration deadline past the module keep it from starting rounds."""
    config = small_config(**{"data.num_devices": 8, "data.max_samples": 400, "rounds": 1,
                             "deadlines.registration_s": 3600, "deadlines.reregistration_s": NO_LIMIT})
    with server_pair(config, "keyed", fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL,
                                               "SFL_ENROLMENT_KEY": KEY, "SFL_ENROLMENT_SECRET_MAX_DEVICES": "2"},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        yield pair.fed_url


def _registered(fed_url: str) -> int:
    return httpx.get(f"{fed_url}/v1/status").json()["registered"]


def test_a_credential_registers_only_the_device_and_shard_it_was_issued_for(keyed, credentials):
    own = _credential(credentials, "dev-000")
    before = _registered(keyed)
    another_id = _register(keyed, "dev-001", 1, own)
    assert another_id.status_code == 403
    assert "covers devices dev-000 (shard 0): it cannot register device 'dev-001'" in another_id.text
    another_shard = _register(keyed, "dev-000", 2, own)
    assert another_shard.status_code == 403 and "on shard 0 only, not on shard 2" in another_shard.text
    forged = {"x-enrolment-secret": own["x-enrolment-secret"].replace("dev/0", "dev/0-7")}
    assert _register(keyed, "dev-001", 1, forged).status_code == 401
    assert _registered(keyed) == before
    token = _token(_register(keyed, "dev-000", 0, own))
    assert _task(keyed, "dev-000", token) == 200 and _registered(keyed) == before + 1


def test_a_device_held_under_one_credential_cannot_be_taken_over_with_another(keyed, credentials):
    own = _credential(credentials, "dev-001")
    token = _token(_register(keyed, "dev-001", 1, own))
    overlapping = {"x-enrolment-secret": issue_credential(KEY.encode(), CredentialScope.parse("dev/0-7"))}
    for other in (overlapping, {"x-enrolment-secret": ENROL}):
        refused = _register(keyed, "dev-001", 1, other)
        assert refused.status_code == 409, refused.text
        assert "'dev-001' is held under another enrolment credential" in refused.text
    assert _task(keyed, "dev-001", token) == 200   # the refused enrolments revoked nothing
    again = _token(_register(keyed, "dev-001", 1, own))   # its own agent, restarted, enrols again
    assert _task(keyed, "dev-001", token) == 403 and _task(keyed, "dev-001", again) == 200


def test_the_shared_secret_registers_no_more_devices_than_its_cap(keyed):
    shared = {"x-enrolment-secret": ENROL}
    tokens = [_token(_register(keyed, device, shard, shared)) for device, shard in (("dev-s4", 4), ("dev-s5", 5))]
    before = _registered(keyed)
    third = _register(keyed, "dev-s6", 6, shared)
    assert third.status_code == 403
    assert "the shared enrolment secret may register at most 2 devices and holds 2" in third.text
    assert _registered(keyed) == before
    assert _task(keyed, "dev-s5", _token(_register(keyed, "dev-s5", 5, shared))) == 200   # enrolling again is no new device
    assert _task(keyed, "dev-s4", tokens[0]) == 200


def test_a_revoked_credential_is_refused_and_its_device_enrols_with_the_next_serial(tmp_path, credentials):
    """The operator's commands: revoke dev-002's credential into a list, issue dev-002 a second
    credential; a Fed Server started with the list refuses the first and takes the second. Then,
    without a restart, dev-003's credential is revoked and the server sent SIGHUP: dev-003's token
    is no longer known, its enrolment is refused, and dev-002 is untouched."""
    listed = tmp_path / "revoked.txt"

    def command(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "fed_server", "credentials", *args], cwd=ROOT, env=service_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    revoked = command("revoke", "--list", str(listed), str(credentials / "out" / "dev-002.credential"))
    assert "revoked: dev/2 (devices dev-002 (shard 2))" in revoked and listed.read_text() == "dev/2\n"
    assert "send it SIGHUP" in revoked
    assert "already revoked: dev/2" in command("revoke", "--list", str(listed), "dev/2")
    assert listed.read_text() == "dev/2\n"
    command("issue", "--key-file", str(credentials / "enrolment.key"), "--shards", "2", "--serial", "2",
            "--out", str(tmp_path / "reissued"))
    config = small_config(**{"data.num_devices": 4, "data.max_samples": 400, "rounds": 1,
                             "deadlines.registration_s": 3600})
    with server_pair(config, "revoked", fed_args=["--enrolment-key-file", str(credentials / "enrolment.key"),
                                                  "--revoked-credentials-file", str(listed)],
                     fed_env={"SFL_SERVICE_SECRET": SERVICE}, main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        refused = _register(pair.fed_url, "dev-002", 2, _credential(credentials, "dev-002"))
        assert refused.status_code == 401 and "the enrolment credential dev/2 is revoked" in refused.text
        assert _registered(pair.fed_url) == 0
        second = {"x-enrolment-secret": (tmp_path / "reissued" / "dev-002.credential").read_text().strip()}
        reissued = _token(_register(pair.fed_url, "dev-002", 2, second))
        assert _task(pair.fed_url, "dev-002", reissued) == 200
        token = _token(_register(pair.fed_url, "dev-003", 3, _credential(credentials, "dev-003")))
        assert _task(pair.fed_url, "dev-003", token) == 200 and _registered(pair.fed_url) == 2

        command("revoke", "--list", str(listed), "dev/3")
        pair.fed.process.send_signal(signal.SIGHUP)
        wait_for(lambda: _registered(pair.fed_url) == 1, 30, "the Fed Server to apply the revocation")
        assert pair.fed.alive()
        assert _task(pair.fed_url, "dev-003", token) == 404   # its agent enrols again, and is refused:
        again = _register(pair.fed_url, "dev-003", 3, _credential(credentials, "dev-003"))
        assert again.status_code == 401 and "the enrolment credential dev/3 is revoked" in again.text
        assert _task(pair.fed_url, "dev-002", reissued) == 200
        log = pair.fed.log_tail(100)
        assert "enrolment credential dev/3 revoked: 1 device(s) taken out of the run: dev-003" in log
        assert "1 newly revoked credential(s) (dev/3); 1 device(s) taken out of the run" in log


def test_honest_devices_keep_training_while_their_ids_are_claimed_under_other_credentials(tmp_path, credentials):
    """One agent per device, each with its own credential file; once they have registered, the shared
    secret and a credential covering both ids try to enrol them again (which would revoke their
    tokens and stop them): both refused, and every round aggregates both devices."""
    config = small_config(rounds=2, **{"data.num_devices": 2, "data.max_samples": 400})
    with server_pair(config, "held", fed_args=["--enrolment-key-file", str(credentials / "enrolment.key")],
                     fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        agents = ProcessGroup(tmp_path / "logs", shared_starter())
        try:
            for shard in (0, 1):
                agents.start(f"agent-{shard}", "device_agent", [
                    "--fed-server-url", pair.fed_url, "--shards", str(shard),
                    "--enrolment-secret-file", str(credentials / "out" / f"dev-00{shard}.credential")])
            wait_for(lambda: _registered(pair.fed_url) == 2, 120, "both devices to register")
            both = {"x-enrolment-secret": issue_credential(KEY.encode(), CredentialScope.parse("dev/0-1"))}
            for claim in ({"x-enrolment-secret": ENROL}, both):
                assert _register(pair.fed_url, "dev-000", 0, claim).status_code == 409
            wait_for(lambda: httpx.get(f"{pair.fed_url}/v1/status").json()["state"] == "finished", 240,
                     "the run to finish")
            status = httpx.get(f"{pair.fed_url}/v1/status").json()
        finally:
            agents.stop()
    assert [(r["status"], r["aggregated"]) for r in status["history"]] == [("ok", ["dev-000", "dev-001"])] * 2
