"""``python -m device_agent``: what it does between building the Agent and running its devices."""
from __future__ import annotations

import pytest


def test_the_agent_is_frozen_out_of_full_collections_before_its_devices_run(agent_cli):
    calls = agent_cli.calls   # the harness records the freeze here

    class Built:
        def __init__(self, *args, **kwargs) -> None:
            calls.append("built")

        def run(self) -> int:
            calls.append("run")
            return 0

    with pytest.raises(SystemExit) as exit_:
        agent_cli.run(["--shards", "0"], Built)
    assert exit_.value.code == 0 and calls == ["built", "freeze", "run"]
