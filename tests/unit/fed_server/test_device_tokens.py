"""The Fed Server's issued device tokens, by token (fed_server/device_tokens.py)."""
from __future__ import annotations

from fed_server.device_tokens import DeviceTokens


def test_a_token_names_its_device_and_a_later_enrolment_revokes_it():
    tokens = DeviceTokens()
    tokens.issued("a", "t1")
    tokens.issued("b", "u1")
    assert tokens.holder("t1") == ("a", True) and tokens.holder("u1") == ("b", True)
    tokens.issued("a", "t2")
    assert tokens.holder("t1") == ("a", False) and tokens.holder("t2") == ("a", True)
    assert tokens.holder("nope") is None


def test_only_the_current_and_the_replaced_token_are_kept():
    tokens = DeviceTokens()
    for i in range(5):
        tokens.issued("a", f"t{i}")
    assert [tokens.holder(f"t{i}") for i in range(5)] == [None, None, None, ("a", False), ("a", True)]


def test_a_forgotten_device_has_no_known_token():
    tokens = DeviceTokens()
    tokens.issued("a", "t1")
    tokens.issued("a", "t2")
    tokens.issued("b", "u1")
    tokens.forget("a")
    assert tokens.holder("t1") is None and tokens.holder("t2") is None and tokens.holder("u1") == ("b", True)
    tokens.forget("a")   # idempotent
