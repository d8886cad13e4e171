"""``python -m device_agent``: what it does between building the Agent and running its devices."""
from __future__ import annotations

import pytest


def test_the_agent_is_frozen_out_of_full_collections_before_its_devices_run(monkeypatch):
    import device_agent.__main__ as cli
    import device_agent.agent as agent_module

    calls: list[str] = []

    class Built:
        def __init__(self, *args, **kwargs) -> None:
            calls.append("built")

        def run(self) -> int:
            calls.append("run")
            return 0

    monkeypatch.setattr(cli, "configure_process", lambda *a, **k: None)
    monkeypatch.setattr(cli, "freeze_startup_objects", lambda: calls.append("freeze"))
    monkeypatch.setattr(agent_module, "Agent", Built)
    for name in ("SFL_METRICS_PORT", "SFL_SHARDS", "SFL_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--shards", "0"])
    assert exit_.value.code == 0 and calls == ["built", "freeze", "run"]
