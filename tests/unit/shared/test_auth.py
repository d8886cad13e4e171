"""Device tokens: bound to the device, the run and one enrolment; checks refuse everything else."""
from __future__ import annotations

import pytest

from shared.auth import (
    DIGEST_HEADER, FED_SERVER, MAIN_SERVER, NONCE_HEADER, SERVICE_REQUEST_WINDOW_S, SERVICE_SCHEME, TIMESTAMP_HEADER,
    Auth, ReplayGuard, body_sha256, check_body_digest,
)
from shared.errors import NotAllowed, Unauthenticated
from shared.http_client import service_signer

AUTH = Auth(b"service-secret", b"enrolment-secret")


def _bearer(token: str) -> dict:
    return {"authorization": f"Bearer {token}"}


def test_the_current_token_passes():
    AUTH.check_device(_bearer(AUTH.device_token("run-1", "dev-a", "n1")), "run-1", "dev-a", "n1")


@pytest.mark.parametrize("run_id, device_id, nonce", [
    ("run-2", "dev-a", "n1"),   # another run under the same secret
    ("run-1", "dev-b", "n1"),   # another device
    ("run-1", "dev-a", "n0"),   # revoked: the device enrolled again since
])
def test_a_token_of_another_run_device_or_enrolment_is_refused(run_id, device_id, nonce):
    with pytest.raises(NotAllowed):
        AUTH.check_device(_bearer(AUTH.device_token(run_id, device_id, nonce)), "run-1", "dev-a", "n1")


def test_no_current_enrolment_refuses_every_token_and_a_missing_token_is_unauthenticated():
    with pytest.raises(NotAllowed):
        AUTH.check_device(_bearer(AUTH.device_token("run-1", "dev-a", "n1")), "run-1", "dev-a", None)
    with pytest.raises(Unauthenticated):
        AUTH.check_device({}, "run-1", "dev-a", "n1")
    with pytest.raises(NotAllowed):  # the same message under another service secret
        AUTH.check_device(_bearer(Auth(b"other").device_token("run-1", "dev-a", "n1")), "run-1", "dev-a", "n1")


def test_open_servers_check_nothing():
    Auth().check_device({}, "run-1", "dev-a", None)
    assert Auth().check_service(MAIN_SERVER, "POST", "/v1/rounds", {}) is None
    assert service_signer(Auth(), MAIN_SERVER) is None


@pytest.mark.parametrize("auth, warned", [(Auth(), True), (Auth(b"service-secret"), False), (AUTH, False)])
def test_a_server_without_a_service_secret_warns_at_start(caplog, auth, warned):
    from shared.auth import warn_if_open

    with caplog.at_level("WARNING", logger="main_server"):
        assert warn_if_open(auth, "main_server", "send activations") is warned
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    if warned:
        [(name, level, message)] = lines
        assert (name, level) == ("main_server", "WARNING")
        assert "anyone who can reach this server can send activations" in message
        assert "--service-secret-file" in message and "SFL_SERVICE_SECRET" in message
    else:
        assert lines == []


# --- enrolment: per-device credentials and the shared secret ---------------------------------------

KEYED = Auth(b"service-secret", b"enrolment-secret", enrolment_key=b"enrolment-key", shared_max_devices=3)


def _enrol(auth: Auth, value: str | None):
    return auth.check_enrolment({} if value is None else {"x-enrolment-secret": value})


def test_a_credential_enrols_as_its_own_holder_with_its_scope_and_the_shared_secret_with_its_cap():
    from shared.auth import SHARED_SECRET_HOLDER, CredentialScope, issue_credential

    scope = CredentialScope.parse("dev-a,dev/0-9")
    enrolment = _enrol(KEYED, issue_credential(b"enrolment-key", scope))
    assert (enrolment.holder, enrolment.scope, enrolment.max_devices) == ("credential dev-a,dev/0-9", scope, None)
    shared = _enrol(KEYED, "enrolment-secret")
    assert (shared.holder, shared.scope, shared.max_devices) == (SHARED_SECRET_HOLDER, None, 3)
    assert _enrol(Auth(), "anything") is None   # an open server checks nothing


def test_a_forged_tampered_or_foreign_credential_is_unauthenticated():
    from shared.auth import CredentialScope, issue_credential

    own = issue_credential(b"enrolment-key", CredentialScope.parse("dev/3"))
    mac = own.rsplit(":", 1)[1]
    for value in (None, "", "wrong", f"sfl-enrol-1:dev/0-9:{mac}",           # its MAC on a wider scope
                  issue_credential(b"another-key", CredentialScope.parse("dev/3")), own + "0", own[:-1]):
        with pytest.raises(Unauthenticated, match="enrolment credential"):
            _enrol(KEYED, value)
    with pytest.raises(Unauthenticated):   # a server without an enrolment key takes no credential
        _enrol(AUTH, own)
    with pytest.raises(Unauthenticated):   # nor the shared secret where there is none
        _enrol(Auth(b"service-secret", enrolment_key=b"enrolment-key"), "enrolment-secret")


@pytest.mark.parametrize("text", ["dev-a", "dev/3", "dev/0-9", "a.b_c-d,dev/0-2,x/7-7", "dev/3@2", "a,b@17"])
def test_a_scope_reads_back_as_written(text):
    from shared.auth import CredentialScope

    assert str(CredentialScope.parse(text)) == text.replace("x/7-7", "x/7")


@pytest.mark.parametrize("text", ["", "a,,b", "dev/9-0", "dev/x", "a b", "a:b", "a/b/3", "x" * 65, "dev/1234567890",
                                  "dev/3@1", "dev/3@0", "dev/3@", "dev/3@x", "dev/3@2@3", "@2"])
def test_a_malformed_scope_is_refused(text):
    from shared.auth import CredentialScope

    with pytest.raises(ValueError):
        CredentialScope.parse(text)


def test_a_scope_covers_its_ids_anywhere_and_its_ranges_each_on_its_own_shard():
    from shared.auth import CredentialScope

    scope = CredentialScope.parse("dev-a,dev/0-9,x/12")
    for device_id, shard in [("dev-a", 5), ("dev-a", None), ("dev-000", 0), ("dev-009", 9), ("x-012", 12)]:
        scope.check(device_id, shard)
    for device_id, shard, message in [
        ("dev-b", 0, "covers devices dev-a, dev-000..dev-009 (shards 0-9), x-012 (shard 12): it cannot register device 'dev-b'"),
        ("dev-010", 10, "cannot register device 'dev-010'"),
        ("dev-3", 3, "cannot register device 'dev-3'"),       # not the agent's naming of shard 3
        ("dev-0003", 3, "cannot register device 'dev-0003'"),
        ("x-000", 0, "cannot register device 'x-000'"),
        ("dev-003", 4, "covers device 'dev-003' on shard 3 only, not on shard 4"),
        ("dev-003", None, "covers device 'dev-003' on shard 3 only, not without a shard"),
    ]:
        with pytest.raises(NotAllowed) as refused:
            scope.check(device_id, shard)
        assert message in str(refused.value)


def test_shard_ranges_join_consecutive_shards():
    from shared.auth import shard_ranges

    assert [str(r) for r in shard_ranges("dev", [7, 0, 1, 2, 5, 8])] == ["dev/0-2", "dev/5", "dev/7-8"]


def test_a_revoked_credential_is_refused_and_its_next_serial_enrols():
    from shared.auth import CredentialScope, issue_credential

    from shared.auth import RevocationList

    revoked = Auth(b"service-secret", enrolment_key=b"enrolment-key",
                   revoked_credentials=RevocationList(ids={"dev/3", "dev/0-1"}))
    first = issue_credential(b"enrolment-key", CredentialScope.parse("dev/3"))
    with pytest.raises(Unauthenticated, match="the enrolment credential dev/3 is revoked.*--serial 2"):
        _enrol(revoked, first)
    second = issue_credential(b"enrolment-key", CredentialScope.parse("dev/3@2"))
    assert second != first and _enrol(revoked, second).holder == "credential dev/3@2"
    assert _enrol(revoked, issue_credential(b"enrolment-key", CredentialScope.parse("dev/4"))).scope is not None
    with pytest.raises(Unauthenticated, match="revoked"):
        _enrol(revoked, issue_credential(b"enrolment-key", CredentialScope.parse("dev/0-1")))


def test_the_revocation_list_reads_ids_and_whole_credentials_and_names_a_bad_line(tmp_path):
    from shared.auth import CredentialScope, issue_credential, load_revoked_credentials

    listed = tmp_path / "revoked"
    listed.write_text("# stolen on 2026-11-30\n\ndev/3\n  cam-a,cam-b@2  \nx/7-7\n"
                      + issue_credential(b"k", CredentialScope.parse("dev/9@4")) + "\n")
    assert load_revoked_credentials(str(listed)) == {"dev/3", "cam-a,cam-b@2", "x/7", "dev/9@4"}
    assert load_revoked_credentials(None) == frozenset()
    listed.write_text("dev/3\ndev 4\n")
    with pytest.raises(ValueError, match="revoked credentials file .*, line 2: bad scope entry 'dev 4'"):
        load_revoked_credentials(str(listed))
    with pytest.raises(ValueError, match="revoked credentials file .*missing"):
        load_revoked_credentials(str(tmp_path / "missing"))


def test_the_revocation_list_reloads_its_file_and_keeps_itself_when_the_file_is_bad(tmp_path):
    from shared.auth import RevocationList

    listed = tmp_path / "revoked"
    listed.write_text("dev/3\n")
    revocations = RevocationList(str(listed))
    assert "dev/3" in revocations and "dev/4" not in revocations
    listed.write_text("dev/3\ndev/4\ncam-a@2\n")
    assert revocations.reload() == {"dev/4", "cam-a@2"} and "dev/4" in revocations
    assert revocations.reload() == frozenset()
    listed.write_text("dev/4\ndev 5\n")
    with pytest.raises(ValueError, match="line 2"):
        revocations.reload()
    assert "dev/3" in revocations   # the list as it was
    listed.write_text("dev/4\n")
    assert revocations.reload() == frozenset() and "dev/3" not in revocations   # a line taken out lifts it
    assert not RevocationList() and RevocationList().path is None


# --- signed server-to-server requests ------------------------------------------------------------

class _Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _signed_pair(clock: _Clock) -> tuple[Auth, Auth]:
    """The sender's and the receiver's Auth under one secret, the receiver on ``clock``."""
    return Auth(b"s"), Auth(b"s", replay_guard=ReplayGuard(clock=clock))


def test_a_signed_request_is_taken_once_and_refused_when_replayed():
    clock = _Clock()
    sender, receiver = _signed_pair(clock)
    digest = body_sha256([b"plan"])
    headers = sender.sign_service_request(MAIN_SERVER, "POST", "/v1/rounds", digest, now=clock.now)
    assert receiver.check_service(MAIN_SERVER, "POST", "/v1/rounds", headers) == digest
    with pytest.raises(Unauthenticated, match="replayed"):
        receiver.check_service(MAIN_SERVER, "POST", "/v1/rounds", headers)
    # Signed again (a new nonce), the same request is taken.
    again = sender.sign_service_request(MAIN_SERVER, "POST", "/v1/rounds", digest, now=clock.now)
    assert receiver.check_service(MAIN_SERVER, "POST", "/v1/rounds", again) == digest


@pytest.mark.parametrize("audience,method,target", [(FED_SERVER, "POST", "/v1/rounds"),
                                                    (MAIN_SERVER, "GET", "/v1/rounds"),
                                                    (MAIN_SERVER, "POST", "/v1/rounds/1/departures"),
                                                    (MAIN_SERVER, "POST", "/v1/rounds?x=1")])
def test_a_signature_holds_for_its_service_method_and_target_only(audience, method, target):
    clock = _Clock()
    sender, receiver = _signed_pair(clock)
    headers = sender.sign_service_request(MAIN_SERVER, "POST", "/v1/rounds", now=clock.now)
    with pytest.raises(Unauthenticated, match="wrong signature"):
        receiver.check_service(audience, method, target, headers)


def test_a_changed_header_another_secret_or_no_signature_is_refused():
    clock = _Clock()
    sender, receiver = _signed_pair(clock)
    headers = sender.sign_service_request(MAIN_SERVER, "GET", "/w", now=clock.now)
    for name, value in ((TIMESTAMP_HEADER, f"{clock.now + 1:.3f}"), (NONCE_HEADER, "0" * 32),
                        (DIGEST_HEADER, body_sha256([b"other"]))):
        with pytest.raises(Unauthenticated, match="wrong signature"):
            receiver.check_service(MAIN_SERVER, "GET", "/w", {**headers, name: value})
    with pytest.raises(Unauthenticated, match="wrong signature"):
        receiver.check_service(MAIN_SERVER, "GET", "/w", Auth(b"t").sign_service_request(MAIN_SERVER, "GET", "/w",
                                                                                         now=clock.now))
    for bare in ({}, {"authorization": "Bearer x"}, {k: v for k, v in headers.items() if k != NONCE_HEADER}):
        with pytest.raises(Unauthenticated, match="without a signature"):
            receiver.check_service(MAIN_SERVER, "GET", "/w", bare)
    with pytest.raises(Unauthenticated, match="bad"):
        bad = sender.sign_service_request(MAIN_SERVER, "GET", "/w", now=clock.now)
        bad[TIMESTAMP_HEADER] = "soon"
        bad["authorization"] = f"{SERVICE_SCHEME} " + _mac_of(bad, "GET", "/w")
        receiver.check_service(MAIN_SERVER, "GET", "/w", bad)


def _mac_of(headers: dict, method: str, target: str) -> str:
    """The signature the sender would give these (possibly altered) headers, with the secret b"s"."""
    from shared.auth import _service_mac
    return _service_mac(b"s", MAIN_SERVER, method, target, headers[TIMESTAMP_HEADER], headers[NONCE_HEADER],
                        headers[DIGEST_HEADER])


def test_a_request_outside_the_window_is_refused_and_old_nonces_are_forgotten():
    clock = _Clock()
    sender, receiver = _signed_pair(clock)
    late = sender.sign_service_request(MAIN_SERVER, "GET", "/w", now=clock.now - SERVICE_REQUEST_WINDOW_S - 1)
    early = sender.sign_service_request(MAIN_SERVER, "GET", "/w", now=clock.now + SERVICE_REQUEST_WINDOW_S + 1)
    for headers in (late, early):
        with pytest.raises(Unauthenticated, match="clocks disagree"):
            receiver.check_service(MAIN_SERVER, "GET", "/w", headers)
    taken = sender.sign_service_request(MAIN_SERVER, "GET", "/w", now=clock.now)
    receiver.check_service(MAIN_SERVER, "GET", "/w", taken)
    assert len(receiver.replay_guard) == 1
    # Once its timestamp has left the window the nonce is forgotten, and the request is refused by its age.
    clock.now += SERVICE_REQUEST_WINDOW_S + 1
    receiver.check_service(MAIN_SERVER, "GET", "/w", sender.sign_service_request(MAIN_SERVER, "GET", "/w",
                                                                                  now=clock.now))
    assert len(receiver.replay_guard) == 1
    with pytest.raises(Unauthenticated, match="clocks disagree"):
        receiver.check_service(MAIN_SERVER, "GET", "/w", taken)


def test_the_body_must_be_the_signed_one():
    digest = body_sha256([b"pla", memoryview(b"n")])
    assert digest == body_sha256([b"plan"])
    check_body_digest(digest, bytearray(b"plan"))
    check_body_digest(None, b"anything")   # an open server
    with pytest.raises(Unauthenticated, match="not the one it signed"):
        check_body_digest(digest, b"plan!")
