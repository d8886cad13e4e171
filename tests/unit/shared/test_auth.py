"""Device tokens: bound to the device, the run and one enrolment; checks refuse everything else."""
from __future__ import annotations

import pytest

from shared.auth import Auth
from shared.errors import NotAllowed, Unauthenticated

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
