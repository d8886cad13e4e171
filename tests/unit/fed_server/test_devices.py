"""The device registry: shards, slots of a local-data run, the token nonce every registration draws
afresh, and who holds each device (the enrolment that registered it)."""
from __future__ import annotations

import pytest

from fed_server.devices import DeviceRegistry
from shared.auth import SHARED_SECRET_HOLDER, CredentialScope, Enrolment
from shared.errors import Conflict, Invalid, NotAllowed
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


# --- who holds a device: enrolment credentials and the shared secret -------------------------------

def _enrolment(scope: str | None, max_devices: int | None = None) -> Enrolment:
    """A credential's enrolment for ``scope``, or the shared secret's (``None``) with its cap."""
    if scope is None:
        return Enrolment(SHARED_SECRET_HOLDER, max_devices=max_devices)
    return Enrolment(f"credential {scope}", CredentialScope.parse(scope))


def _enrol(registry: DeviceRegistry, req: RegisterRequest, enrolment: Enrolment | None):
    return registry.enrol(req, enrolment, lambda: registry.register(req))


def test_a_credential_registers_only_its_devices_and_records_itself_as_their_holder():
    registry = DeviceRegistry(num_shards=4)
    mine = _enrolment("dev/1")
    assert _enrol(registry, _req("dev-001", 1), mine).holder == mine.holder
    for device_id, shard in [("dev-002", 2), ("dev-001", 3), ("dev-000", 0)]:
        with pytest.raises(NotAllowed):
            _enrol(registry, _req(device_id, shard), mine)
    assert registry.ids() == ["dev-001"] and registry.get("dev-001").shard == 1


def test_only_the_holder_enrols_a_device_again_and_a_refusal_revokes_nothing():
    registry = DeviceRegistry(num_shards=4)
    honest, overlapping, shared = _enrolment("dev/0-1"), _enrolment("dev/1"), _enrolment(None)
    _enrol(registry, _req("dev-001", 1), honest)
    nonce = registry.token_nonce("dev-001")
    for other in (overlapping, shared):
        with pytest.raises(Conflict, match="'dev-001' is held under another enrolment credential"):
            _enrol(registry, _req("dev-001", 1), other)
    assert registry.token_nonce("dev-001") == nonce and registry.get("dev-001").holder == honest.holder
    _enrol(registry, _req("dev-001", 1), honest)   # its agent restarted: a new token, the old one revoked
    assert registry.token_nonce("dev-001") != nonce
    # and the other way round: a device of the shared secret is not the credential's to take
    _enrol(registry, _req("dev-a", 2), shared)
    with pytest.raises(Conflict):
        _enrol(registry, _req("dev-a", 2), _enrolment("dev-a"))


def test_the_shared_secret_registers_at_most_its_cap_of_devices_and_enrols_them_again():
    registry = DeviceRegistry(num_shards=4)
    _enrol(registry, _req("dev-x", 3), _enrolment("dev-x"))   # a credential's device takes none of the cap
    shared = _enrolment(None, max_devices=2)
    _enrol(registry, _req("dev-a", 0), shared)
    _enrol(registry, _req("dev-b", 1), shared)
    with pytest.raises(NotAllowed, match="the shared enrolment secret may register at most 2 devices and holds 2"):
        _enrol(registry, _req("dev-c", 2), shared)
    _enrol(registry, _req("dev-b", 1), shared)
    assert registry.ids() == ["dev-a", "dev-b", "dev-x"]


def test_a_registration_the_run_refuses_records_no_holder_and_an_open_server_records_none():
    registry = DeviceRegistry(num_shards=2)

    def refuse():
        raise Conflict("the device's model differs from the run's")
    with pytest.raises(Conflict):
        registry.enrol(_req("dev-a", 0), _enrolment("dev-a"), refuse)
    assert registry.ids() == []
    _enrol(registry, _req("dev-a", 0), _enrolment(None))
    _enrol(registry, _req("dev-a", 0), None)   # open: who registers is not known, and not checked
    assert registry.get("dev-a").holder is None


def test_a_removed_device_frees_its_shard_and_its_holders_count():
    registry = DeviceRegistry(num_shards=3)
    shared = _enrolment(None, max_devices=2)
    for device, shard in (("dev-a", 0), ("dev-b", 1)):
        _enrol(registry, _req(device, shard), shared)
    assert registry.held_by([SHARED_SECRET_HOLDER, "someone else"]) == {"dev-a": SHARED_SECRET_HOLDER,
                                                                         "dev-b": SHARED_SECRET_HOLDER}
    registry.remove("dev-a")
    assert registry.ids() == ["dev-b"] and not registry.holds(0) and registry.token_nonce("dev-a") is None
    assert registry.weight("dev-a") == 1 and registry.label_counts("dev-a") == []
    # the holder counts one device less, and the id and shard are free for another holder
    _enrol(registry, _req("dev-c", 2), shared)
    credential = _enrolment("dev-a")
    _enrol(registry, _req("dev-a", 0), credential)
    assert registry.get("dev-a").holder == credential.holder
    assert registry.held_by([credential.holder]) == {"dev-a": credential.holder}
