"""The device registry: shards, and the token nonce every registration draws afresh."""
from __future__ import annotations

import pytest

from fed_server.devices import DeviceRegistry
from shared.errors import Conflict
from shared.schemas import DeviceProfileMsg, RegisterRequest


def _req(device_id: str, shard: int) -> RegisterRequest:
    return RegisterRequest(device_id=device_id, shard=shard, num_samples=10, profile=DeviceProfileMsg(flops=1e9, rate=1e6))


def test_registering_again_keeps_the_place_and_draws_a_new_token_nonce():
    registry = DeviceRegistry(num_shards=2)
    assert registry.token_nonce("dev-a") is None
    registry.register(_req("dev-a", 0))
    first = registry.token_nonce("dev-a")
    registry.register(_req("dev-a", 0))
    second = registry.token_nonce("dev-a")
    assert first and second and first != second
    assert registry.ids() == ["dev-a"] and registry.get("dev-a").shard == 0


def test_a_refused_registration_leaves_the_nonce_alone():
    registry = DeviceRegistry(num_shards=2)
    registry.register(_req("dev-a", 0))
    registry.register(_req("dev-b", 1))
    before = registry.token_nonce("dev-a")
    with pytest.raises(Conflict):
        registry.register(_req("dev-a", 1))
    assert registry.token_nonce("dev-a") == before
