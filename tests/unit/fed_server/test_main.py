"""``python -m fed_server``'s Main Server replicas: repeated flags, comma-separated env, settings."""
from __future__ import annotations

from fed_server.__main__ import main_server_urls_of


def test_main_server_urls_from_flags_env_and_settings(monkeypatch):
    monkeypatch.delenv("SFL_MAIN_SERVER_URL", raising=False)
    assert main_server_urls_of(None) == ["http://127.0.0.1:8081"]
    monkeypatch.setenv("SFL_MAIN_SERVER_URL", "http://a:8081, http://b:8081,")
    assert main_server_urls_of(None) == ["http://a:8081", "http://b:8081"]
    assert main_server_urls_of(["http://c:1", "http://d:2"]) == ["http://c:1", "http://d:2"]   # repeated flags win
    assert main_server_urls_of("http://e:1,http://f:2") == ["http://e:1", "http://f:2"]        # a settings file's string
