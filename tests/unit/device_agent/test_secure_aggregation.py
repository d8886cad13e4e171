"""A device's secure session (device_agent/secure_aggregation.py) without HTTP: a change with a
NaN or infinite entry is not masked (the fixed point would make it an extreme value the sum could
not show), and the device withdraws as a plain upload of it would be refused."""
from __future__ import annotations

import time

import pytest
import torch

from device_agent.reports import TASK_FAILURES
from device_agent.secure_aggregation import SecureSession
from shared.errors import Invalid
from shared.schemas import SecAggInbox, SecureTerms
from shared.secagg.masks import BlockLayout
from shared.secagg.protocol import DeviceSecrets

LAYOUT = BlockLayout(((("w", (2, 2)),), (("b", (2,)),)))


class _Inbox:
    """The share stage's answer: the shares ``peers`` sealed for the device."""

    def __init__(self, sealed: dict[str, bytes]) -> None:
        self.sealed = sealed

    def secagg_send(self, round_id: int, stage: str, req) -> None:
        raise AssertionError("a broken update sends nothing")

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float, model):
        assert stage == "inbox"
        return SecAggInbox(ready=True, shares=self.sealed)


def _session() -> SecureSession:
    secrets = {d: DeviceSecrets(d, "run", 1) for d in ("a", "b", "c")}
    roster = {d: s.public_keys() for d, s in secrets.items()}
    sealed = {d: s.seal_shares(roster, 2) for d, s in secrets.items()}
    return SecureSession(_Inbox({o: sealed[o]["a"] for o in ("b", "c")}), secrets["a"],
                         SecureTerms(fraction_bits=40, value_range=1.0, run_id="run"), roster, time.monotonic() + 30, 2,
                         {d: 2 for d in roster})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_change_with_a_non_finite_entry_is_not_masked_and_the_device_withdraws(bad: float):
    start = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    state = {"w": torch.tensor([[0.1, bad], [0.0, 0.2]]), "b": torch.ones(2)}
    with pytest.raises(Invalid, match=r"the update of a has NaN or infinite entries in \['w'\]: not masked") as raised:
        _session().masked_weights(state, start, 10.0, LAYOUT)
    assert isinstance(raised.value, TASK_FAILURES)      # one warning and a withdrawal, not a crash
    assert _session().masked_weights({"w": torch.full((2, 2), 0.1), "b": torch.ones(2)}, start, 10.0, LAYOUT)
