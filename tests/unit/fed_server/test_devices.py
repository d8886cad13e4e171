"""The device registry: shards, slots of a local-data run, and the token nonce every registration draws afresh."""
from __future__ import annotations

import pytest

from fed_server.devices import DeviceRegistry
from shared.errors import Conflict, Invalid
from shared.schemas import DeviceProfileMsg, RegisterRequest


def _req(device_id: str, shard: int | None) -> RegisterRequest:
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


def test_local_run_gives_the_lowest_free_slot_keeps_it_and_refuses_a_full_run():
    registry = DeviceRegistry(num_shards=3, local_data=True)
    assert [registry.register(_req(d, None)).shard for d in ("dev-a", "dev-b", "dev-c")] == [0, 1, 2]
    nonce = registry.token_nonce("dev-b")
    assert registry.register(_req("dev-b", None)).shard == 1 and registry.token_nonce("dev-b") != nonce
    with pytest.raises(Conflict, match="all 3 device slots"):
        registry.register(_req("dev-d", None))
    assert registry.ids() == ["dev-a", "dev-b", "dev-c"]


def test_shard_and_slot_runs_refuse_each_others_registrations():
    with pytest.raises(Invalid, match="register without a shard"):
        DeviceRegistry(num_shards=2, local_data=True).register(_req("dev-a", 0))
    with pytest.raises(Invalid, match="register with the shard"):
        DeviceRegistry(num_shards=2).register(_req("dev-a", None))
