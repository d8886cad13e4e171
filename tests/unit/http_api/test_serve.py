"""``http_api.serve.serve``: what a server process does between building its app and serving it."""
from __future__ import annotations

import argparse

import pytest

import http_api.serve as serve_module


def _args(**overrides) -> argparse.Namespace:
    values = dict(host="127.0.0.1", port=8081, log_level="INFO", tls_cert=None, tls_key=None,
                  head_timeout_s=10.0, min_body_rate=1024.0, body_grace_s=10.0, keep_alive_s=5.0, shutdown_grace_s=3.0)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    """What ``serve`` did, in order: the freeze, and uvicorn's run (neither done for real)."""
    done: list[str] = []
    monkeypatch.setattr(serve_module, "freeze_startup_objects", lambda: done.append("freeze"))
    monkeypatch.setattr(serve_module._StoppingServer, "run",
                        lambda self: done.append(f"run {self.config.app} on {self.config.port}"))
    return done


def test_the_app_is_frozen_out_of_full_collections_before_uvicorn_serves_it(calls):
    serve_module.serve("the app", _args())
    assert calls == ["freeze", "run the app on 8081"]


def test_a_certificate_without_its_key_stops_before_anything_is_frozen_or_served(calls):
    with pytest.raises(SystemExit, match="go together"):
        serve_module.serve("the app", _args(tls_cert="cert.pem"))
    assert calls == []


def test_the_connection_limits_reach_uvicorn(calls, monkeypatch):
    ran: dict = {}
    monkeypatch.setattr(serve_module, "head_timeout_protocol", lambda *limits: ("protocol with", limits))
    monkeypatch.setattr(serve_module._StoppingServer, "run", lambda self: ran.update(config=self.config))
    serve_module.serve("the app", _args(head_timeout_s=2.0, min_body_rate=500.0, body_grace_s=4.0, keep_alive_s=6.0))
    config = ran["config"]
    assert config.http == ("protocol with", (2.0, 500.0, 4.0))
    assert (config.timeout_keep_alive, config.timeout_graceful_shutdown) == (6.0, 3.0)
