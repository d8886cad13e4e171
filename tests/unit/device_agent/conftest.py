"""``python -m device_agent``'s ``main`` under test: one harness for the tests that run it."""
from __future__ import annotations

from collections.abc import Callable

import pytest


class AgentCli:
    """Runs ``device_agent.__main__.main`` with the process-wide set-up stubbed out (logging and
    torch threads do nothing; the garbage collector's freeze is recorded in ``calls``, never done
    to the test process's objects), the agent's environment settings cleared and the Agent
    replaced by the test's."""

    ENV = ("SFL_METRICS_PORT", "SFL_METRICS_LINGER_S", "SFL_SHARDS", "SFL_SLICE", "SFL_PREFIX")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import device_agent.__main__ as cli

        self.monkeypatch = monkeypatch
        self.calls: list[str] = []
        monkeypatch.setattr(cli, "configure_process", lambda *a, **k: None)
        monkeypatch.setattr(cli, "freeze_startup_objects", lambda: self.calls.append("freeze"))
        for name in self.ENV:
            monkeypatch.delenv(name, raising=False)

    def run(self, argv: list[str], agent: Callable) -> None:
        """``main(argv)`` with ``agent`` (called as the Agent class would be) in the Agent's place."""
        import device_agent.__main__ as cli
        import device_agent.agent as agent_module

        self.monkeypatch.setattr(agent_module, "Agent", agent)
        cli.main(argv)

    def built_with(self, argv: list[str]) -> dict:
        """Run ``main`` up to building the Agent; the Agent's keyword arguments, and its shards."""
        captured: dict = {}

        class Stop(Exception):
            pass

        def fake_agent(*args, **kwargs):
            captured.update(kwargs, shards=args[1])
            raise Stop

        try:
            self.run(argv, fake_agent)
        except Stop:
            pass
        return captured


@pytest.fixture
def agent_cli(monkeypatch: pytest.MonkeyPatch) -> AgentCli:
    return AgentCli(monkeypatch)
