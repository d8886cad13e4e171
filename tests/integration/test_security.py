"""Authentication and TLS against running servers: enrolment, per-device tokens, service tokens, HTTPS."""
from __future__ import annotations

import datetime
import ipaddress
import json
import threading
from pathlib import Path

import httpx
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from integration_support import read_metrics, server_pair, small_config, wait_for
from shared.auth import Auth
from shared.models import build_model
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, JoinRequest, Participant, RegisterRequest, RoundPlan, StepRequest, UpdateRequest,
    WireTensor,
)
from shared.config import TrainConfig
from shared.wire import encode_state, encode_tensor, packb, unpackb
from testbed.runner import Testbed, TlsFiles
from testbed.warm_start import shared_starter

SERVICE = "service-secret-for-tests"
ENROL = "enrolment-secret-for-tests"
MSGPACK = {"content-type": "application/msgpack"}


def make_tls(folder: Path) -> TlsFiles:
    """A throwaway CA and a certificate for 127.0.0.1/localhost signed by it."""
    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("s2fl test CA")).issuer_name(name("s2fl test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name("127.0.0.1")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    return TlsFiles(cert=str(folder / "cert.pem"), key=str(folder / "key.pem"), ca=str(folder / "ca.pem"))


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
                             "deadlines.registration_s": 3600})
    with server_pair(config, "auth", fed_env={"SFL_SERVICE_SECRET": SERVICE, "SFL_ENROLMENT_SECRET": ENROL},
                     main_env={"SFL_SERVICE_SECRET": SERVICE}) as pair:
        yield pair.fed_url, pair.main_url


def _post(url: str, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url, content=packb(body.model_dump() if hasattr(body, "model_dump") else body),
                      headers={**MSGPACK, **(headers or {})}, timeout=30)


def _register(fed_url: str, device: str, shard: int, headers: dict | None) -> httpx.Response:
    req = RegisterRequest(device_id=device, shard=shard, num_samples=100, profile=DeviceProfileMsg(flops=1e9, rate=1e6))
    return _post(f"{fed_url}/v1/devices/register", req, headers)


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


def test_a_token_from_another_run_is_refused(servers):
    """Two runs under the same service secret: a device's token of one run is worthless in the other."""
    fed_url, _ = servers
    # The Fed Server must not start rounds while these tests post their own plan (round 99) to
    # its Main Server: each of its attempts would replace that plan there. Four shards with two
    # ever registered, and a registration deadline past the module, keep it waiting.
    config = small_config(**{"data.num_devices": 4, "data.max_samples": 200, "rounds": 1,
                             "deadlines.registration_s": 3600})
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
    return RoundPlan(run_id="r", round_id=99, model="cnn", num_classes=10, input_shape=[1, 28, 28], seed=0,
                     participants=[Participant(device_id=d, split_point=1, num_samples=10, token_nonce=NONCES[d])
                                   for d in ("dev-a", "dev-b")],
                     server_weights=encode_state(model.portion(1, 4).state_dict()), train=TrainConfig(batch_size=4),
                     grouping="singleton", group_size=1, group_loss="per_member", join_deadline_s=2, step_deadline_s=30)


def test_server_to_server_calls_need_the_service_token(servers):
    fed_url, main_url = servers
    auth = Auth(SERVICE.encode())
    plan = _plan()
    before = httpx.get(f"{main_url}/v1/status").json()["round"]  # none: the Fed Server starts no round here
    assert _post(f"{main_url}/v1/rounds", plan).status_code == 401
    assert _post(f"{main_url}/v1/rounds", plan, _bearer(auth.device_token("r", "dev-a", NONCES["dev-a"]))).status_code == 401
    assert httpx.get(f"{main_url}/v1/status").json()["round"] == before
    assert _post(f"{main_url}/v1/rounds", plan, auth.service_headers()).status_code == 200
    assert httpx.get(f"{main_url}/v1/status").json()["round"]["round_id"] == 99
    watch = f"{main_url}/v1/rounds/99/watch"
    assert httpx.get(watch).status_code == 401
    assert httpx.get(watch, headers=_bearer(auth.device_token("r", "dev-a", NONCES["dev-a"]))).status_code == 401
    with httpx.stream("GET", watch, headers=auth.service_headers(), timeout=10) as response:
        assert response.status_code == 200
        assert json.loads(next(response.iter_lines())) == {"round_id": 99, "state": "open"}
    portion = {"run_id": "r", "round_id": 1, "group_id": 0, "members": [], "dropped": [], "start_block": 1,
               "weights": {}, "label_distance": 0.0, "steps": 0, "train_time_s": 0.0}
    assert _post(f"{fed_url}/v1/rounds/1/server-portions", portion).status_code == 401


def test_main_server_refuses_a_device_acting_as_another_or_with_a_revoked_token(servers):
    _, main_url = servers
    auth = Auth(SERVICE.encode())
    assert _post(f"{main_url}/v1/rounds", _plan(), auth.service_headers()).status_code == 200
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
    # An attempt open when they enrol again is sat out (the Main Server's plan carries their old
    # tokens). Three more rounds follow, each at least one 5 s deadline long while the devices are
    # away (a restart takes about 5 s here), so the last round aggregates their updates.
    config = small_config(rounds=5, **{"deadlines.round_s": 60, "deadlines.join_s": 5, "deadlines.step_s": 5})
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
    assert [m["round"] for m in ok] == [1, 2, 3, 4, 5]
    assert ok[-1]["aggregated"] == ["dev-000", "dev-001", "dev-002", "dev-003"]
    fed_log = (run_dir / "logs" / "fed_server.log").read_text()
    assert "device dev-002 enrolled again: its previous token is revoked" in fed_log
    assert not testbed.secret_files.folder.exists()  # the secret files go with the testbed
