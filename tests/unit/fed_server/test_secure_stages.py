"""Secure aggregation's stages at the Fed Server without HTTP: each stage closes with the devices
that answered and takes the others out with the reason, and every message out of turn or
malformed (a public key another device sent among them, an unmasking share its owner did not deal
the device) is refused in one line and changes nothing;
an attempt whose secrets could not be rebuilt fails before any share is asked for; an agent's devices together
(fed_server/secure_batches.py), each taken or refused as its own request would be."""
from __future__ import annotations

import asyncio

import pytest

from fed_server.coordinator import Coordinator
from fed_server.run_dir import RunDirectory
from fed_server.secure_stages import (
    DEVICE_WIRE_BYTES, DEVICE_WIRE_ENTRIES, SHARE_WIRE_BYTES, BodyLimit, close_key_stage, close_share_stage, keys_in, open_unmasking_stage, shares_in,
)
from fed_server.update_checks import trained_samples
from shared.errors import Conflict, Invalid, NotAllowed, NotFound
from shared.portions import portion_state
from shared.run_config import load_run_config
from shared.schemas import (
    AgentDevice, DeviceProfileMsg, DeviceTimings, RegisterRequest, SecAggBatch, SecAggKeys, SecAggRoster, SecAggShares,
    SecAggUnmask, UpdateRequest,
)
from shared.secagg.protocol import DeviceSecrets
from shared.secagg.shamir import PRIME, SHARE_BYTES
from shared.wire import WireError, encode_state, packb, unpackb

DEVICES = ["d0", "d1", "d2"]


def _open_round(tmp_path, devices: list[str] = DEVICES, **secure):
    config = load_run_config({"algorithm": "fedavg", "rounds": 1, "aggregation": {"rule": "mean"},
                              "secure_aggregation": {"enabled": True, **secure},
                              "data": {"num_devices": len(devices), "max_samples": 100 * len(devices)}})
    coordinator = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    holdout = coordinator.enrolment.run_info().holdout
    for i, device in enumerate(devices):
        coordinator.enrolment.register(RegisterRequest(
            device_id=device, shard=i, num_samples=trained_samples(coordinator.enrolment.shard_sizes[i], holdout),
            profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    fed_round = coordinator.begin_round()
    fed_round.ready = True
    return coordinator, fed_round


def _keys(device: str, round_id: int, secrets: DeviceSecrets | None = None) -> SecAggKeys:
    mask_key, share_key = (secrets or DeviceSecrets(device, "run", round_id)).public_keys()
    return SecAggKeys(device_id=device, round_id=round_id, mask_key=mask_key, share_key=share_key)


def _dealt(secrets: DeviceSecrets, roster: dict[str, tuple[bytes, bytes]], threshold: int = 2) -> SecAggShares:
    """What ``secrets``' device sends into the share stage for ``roster``: its dealt shares and its
    commitments."""
    shares = secrets.seal_shares(roster, threshold)
    return SecAggShares(device_id=secrets.device_id, round_id=secrets.round_id, shares=shares,
                        seed_commitment=secrets.seed_commitment(), own_commitments=secrets.own_commitments)


def _shared(coordinator: Coordinator, fed_round, devices: list[str]) -> dict[str, DeviceSecrets]:
    """Every one of ``devices`` sends its keys and its shares over the complete graph, and both
    stages close; their secrets."""
    round_id, stages = fed_round.round_id, coordinator.secure
    secrets = {d: DeviceSecrets(d, coordinator.core.run_id, round_id) for d in devices}
    for device in devices:
        stages.accept_keys(round_id, _keys(device, round_id, secrets[device]))
    close_key_stage(coordinator.core, fed_round)
    roster = {d: secrets[d].public_keys() for d in devices}
    for device in devices:
        stages.accept_shares(round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    return secrets


def test_the_key_stage_closes_with_the_devices_that_sent_keys_and_takes_the_others_out(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    secure = fed_round.secure
    assert secure is not None and secure.terms.fraction_bits > 40
    for device in DEVICES[:2]:
        coordinator.secure.accept_keys(fed_round.round_id, _keys(device, fed_round.round_id))
    assert not keys_in(fed_round)
    close_key_stage(coordinator.core, fed_round)
    assert secure.roster is not None and sorted(secure.roster) == DEVICES[:2] and secure.threshold == 2
    assert fed_round.excluded == {"d2": "secure aggregation: sent no keys in time"}
    with pytest.raises(Conflict, match="taken out"):
        coordinator.secure.accept_keys(fed_round.round_id, _keys("d2", fed_round.round_id))
    with pytest.raises(Conflict, match="key stage .* is closed"):
        coordinator.secure.accept_keys(fed_round.round_id, _keys("d0", fed_round.round_id))


def test_messages_out_of_turn_or_malformed_are_refused_and_change_nothing(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    with pytest.raises(Invalid, match="agrees on nothing"):
        stages.accept_keys(round_id, SecAggKeys(device_id="d0", round_id=round_id, mask_key=bytes(32),
                                                share_key=bytes(32)))
    with pytest.raises(Conflict, match="share stage .* is not open"):
        stages.accept_shares(round_id, SecAggShares(device_id="d0", round_id=round_id, shares={},
                                                    seed_commitment=bytes(16), own_commitments=bytes(32)))
    with pytest.raises(Invalid, match="body round_id 9 does not match the path's round"):
        stages.accept_keys(round_id, _keys("d0", 9))
    assert secure.keys == {} and secure.shares == {}
    secrets = {d: DeviceSecrets(d, "run", round_id) for d in DEVICES}
    for device in DEVICES:
        stages.accept_keys(round_id, _keys(device, round_id, secrets[device]))
    close_key_stage(coordinator.core, fed_round)
    roster = {d: secrets[d].public_keys() for d in DEVICES}
    dealt = _dealt(secrets["d0"], roster)
    with pytest.raises(Invalid, match=r"exactly its \d+ neighbours"):
        stages.accept_shares(round_id, dealt.model_copy(update={"shares": {"d1": dealt.shares["d1"]}}))
    # A dealt share is 192 bytes (sealed, 160, then its commitments): another could not open.
    for size in (0, 1, 160, 191, 193, 10_000):
        with pytest.raises(Invalid, match=r"shares of 'd0' for d1: not 192 bytes"):
            stages.accept_shares(round_id, dealt.model_copy(update={"shares": {**dealt.shares, "d1": bytes(size)}}))
    with pytest.raises(Invalid, match="body round_id"):
        stages.accept_shares(round_id, dealt.model_copy(update={"round_id": round_id + 1}))
    assert secure.shares == {} and secure.seed_commitments == {}
    # A masked upload before the device shared: refused, and the device stays in.
    state = portion_state(coordinator.core.model, 0, coordinator.core.num_blocks)
    upload = UpdateRequest(device_id="d0", round_id=round_id, num_samples=coordinator.core.devices.get("d0").num_samples,
                           steps=1, train_loss=1.0, weights=encode_state(state), bytes_up=0, bytes_down=0,
                           timings=DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1))
    with pytest.raises(Conflict, match="only after sharing"):
        coordinator.uploads.accept_update(round_id, upload, 100)
    for device in DEVICES:
        stages.accept_shares(round_id, _dealt(secrets[device], roster))
    assert shares_in(fed_round)
    close_share_stage(coordinator.core, fed_round)
    assert secure.sharers == DEVICES and fed_round.excluded == {}
    # Float weights where masked words are due: refused, and only that device is taken out.
    with pytest.raises(Invalid, match="dtype"):
        coordinator.uploads.accept_update(round_id, upload, 100)
    assert fed_round.updates == {} and list(fed_round.excluded) == ["d0"]
    with pytest.raises(Conflict, match="no unmasking shares"):
        stages.accept_unmask(round_id, SecAggUnmask(device_id="d1", round_id=round_id))
    open_unmasking_stage(coordinator.core, fed_round, coordinator.aggregator.usable(fed_round))
    assert secure.plan is not None and secure.plan.survivors == [] and secure.plan.dropped == DEVICES



def test_a_public_key_another_device_sent_is_refused_and_changes_nothing(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    first = _keys("d0", round_id)
    stages.accept_keys(round_id, first)
    mine = _keys("d1", round_id)
    for copied in (mine.model_copy(update={"share_key": first.mask_key}),
                   mine.model_copy(update={"mask_key": first.share_key})):
        with pytest.raises(Invalid, match="keys of 'd1': a public key sent already by d0; each must be fresh"):
            stages.accept_keys(round_id, copied)
    with pytest.raises(Invalid, match="sent already by itself as its other key"):
        stages.accept_keys(round_id, mine.model_copy(update={"share_key": mine.mask_key}))
    assert list(secure.keys) == ["d0"] and set(secure.key_owners.values()) == {"d0"}
    stages.accept_keys(round_id, first)                    # sent again: the same device's keys
    stages.accept_keys(round_id, mine)
    fresh = _keys("d0", round_id)                          # d0's new keys free its old ones
    stages.accept_keys(round_id, fresh)
    stages.accept_keys(round_id, _keys("d2", round_id).model_copy(update={"mask_key": first.mask_key}))
    assert secure.keys == {"d0": fresh, "d1": mine, "d2": secure.keys["d2"]} and len(secure.key_owners) == 6


def _sparse_keys_in(tmp_path, devices: list[str]):
    """An attempt over ``devices`` on SecAgg+'s graph of 2 neighbours (threshold 2) whose key stage
    closed with every device's keys; the devices' secrets."""
    coordinator, fed_round = _open_round(tmp_path, devices, neighbours=2, threshold=2)
    secrets = {d: DeviceSecrets(d, coordinator.core.run_id, fed_round.round_id) for d in devices}
    for device in devices:
        coordinator.secure.accept_keys(fed_round.round_id, _keys(device, fed_round.round_id, secrets[device]))
    close_key_stage(coordinator.core, fed_round)
    return coordinator, fed_round, secrets


def test_on_a_sparse_graph_a_device_gets_its_neighbourhood_and_one_too_few_of_whose_neighbours_shared_is_taken_out(
        tmp_path):
    devices = [f"d{i}" for i in range(5)]
    coordinator, fed_round, secrets = _sparse_keys_in(tmp_path, devices)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    hoods = secure.neighbourhoods
    assert secure.threshold == 2 and all(len(hoods[d]) == 3 and d in hoods[d] for d in devices)
    rosters = {d: asyncio.run(stages.roster(round_id, d, 0)).keys for d in devices}
    assert all(sorted(rosters[d]) == hoods[d] for d in devices)
    # d0's two neighbours never share: d0 cannot be unmasked (one share of its secrets would come
    # back), so it is taken out, and its neighbours with it for sending nothing.
    lonely, silent = "d0", [d for d in hoods["d0"] if d != "d0"]
    with pytest.raises(Invalid, match=r"exactly its \d+ neighbours"):
        stages.accept_shares(round_id, SecAggShares(device_id=lonely, round_id=round_id, shares={
            d: b"x" for d in devices if d != lonely}, seed_commitment=bytes(16), own_commitments=bytes(32)))
    for device in devices:
        if device not in silent:
            roster = {d: (k.mask_key, k.share_key) for d, k in rosters[device].items()}
            stages.accept_shares(round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    rest = sorted(set(devices) - {lonely, *silent})
    assert secure.sharers == rest
    assert fed_round.excluded[lonely] == "secure aggregation: fewer than 2 of its neighbourhood shared their secrets"
    inbox = asyncio.run(stages.inbox(round_id, rest[0], 0))
    assert list(inbox.shares) == [rest[1]]


def test_on_a_sparse_graph_each_device_is_asked_only_about_its_neighbourhood(tmp_path):
    devices = [f"d{i}" for i in range(7)]
    coordinator, fed_round, secrets = _sparse_keys_in(tmp_path, devices)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    hoods = secure.neighbourhoods
    for device in devices:
        roster = {d: secrets[d].public_keys() for d in hoods[device]}
        stages.accept_shares(round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    gone = "d3"
    open_unmasking_stage(coordinator.core, fed_round, [d for d in devices if d != gone])
    assert secure.plan is not None and secure.plan.dropped == [gone] and len(secure.plan.survivors) == 6
    for device in devices:
        if device == gone:
            continue
        plan = asyncio.run(stages.unmask_plan(round_id, device, 0))
        assert plan.ready and plan.survivors == [d for d in hoods[device] if d != gone]
        assert plan.dropped == ([gone] if gone in hoods[device] else [])
    asker = next(d for d in devices if d != gone and gone not in hoods[d])
    stranger = next(d for d in devices if d not in hoods[asker] and d != gone)
    secrets[asker].open_inbox({d: secrets[d].public_keys() for d in hoods[asker]},
                              asyncio.run(stages.inbox(round_id, asker, 0)).shares)
    seeds, keys = secrets[asker].unmask(secure.plan.survivors, secure.plan.dropped)
    with pytest.raises(Invalid, match="the seeds of exactly .* were asked for, not of"):
        stages.accept_unmask(round_id, SecAggUnmask(device_id=asker, round_id=round_id,
                                                    seed_shares={**seeds, stranger: bytes(66)}, key_shares=keys))
    # An empty or partial answer would count as answered, and rebuild nothing.
    for partial in ({}, dict(list(seeds.items())[:1])):
        with pytest.raises(Invalid, match="were asked for"):
            stages.accept_unmask(round_id, SecAggUnmask(device_id=asker, round_id=round_id, seed_shares=partial,
                                                        key_shares=keys))
    # A share that is no field element would fail the rebuild, and the attempt for every device.
    with pytest.raises(Invalid, match=r"for .*: not a field element of 66 bytes"):
        stages.accept_unmask(round_id, SecAggUnmask(device_id=asker, round_id=round_id,
                                                    seed_shares={o: b"\xff" * 66 for o in seeds}, key_shares=keys))
    with pytest.raises(Invalid, match="body round_id .* does not match the path's round"):
        stages.accept_unmask(round_id, SecAggUnmask(device_id=asker, round_id=round_id + 7, seed_shares=seeds,
                                                    key_shares=keys))
    assert secure.answers == {}
    stages.accept_unmask(round_id, SecAggUnmask(device_id=asker, round_id=round_id, seed_shares=seeds, key_shares=keys))
    assert sorted(secure.answers[asker][0]) == [d for d in hoods[asker] if d != gone]


def test_an_unmasking_share_other_than_the_one_its_owner_dealt_is_refused_naming_the_device(tmp_path, caplog):
    coordinator, fed_round = _open_round(tmp_path)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    secrets = _shared(coordinator, fed_round, DEVICES)
    roster = {d: secrets[d].public_keys() for d in DEVICES}
    secrets["d0"].open_inbox(roster, asyncio.run(stages.inbox(round_id, "d0", 0)).shares)
    open_unmasking_stage(coordinator.core, fed_round, ["d0", "d1"])
    assert secure.plan is not None and secure.plan.dropped == ["d2"]
    seeds, keys = secrets["d0"].unmask(secure.plan.survivors, secure.plan.dropped)
    moved = {o: ((int.from_bytes(v, "big") + 1) % PRIME).to_bytes(SHARE_BYTES, "big") for o, v in seeds.items()}
    # A field element one away from d1's seed share (which would rebuild d1's seed plus a known
    # amount, a secret of the right size), another device's share of its own seed, d2's key share.
    for false, what in (({**seeds, "d1": moved["d1"]}, "seeds of d1"), ({**seeds, "d0": seeds["d1"]}, "seeds of d0")):
        with pytest.raises(Invalid, match=f"'d0': the shares of the {what} are not the ones their owners dealt it"):
            stages.accept_unmask(round_id, SecAggUnmask(device_id="d0", round_id=round_id, seed_shares=false,
                                                        key_shares=keys))
    with pytest.raises(Invalid, match="the shares of the keys of d2 are not"):
        stages.accept_unmask(round_id, SecAggUnmask(device_id="d0", round_id=round_id, seed_shares=seeds,
                                                    key_shares={"d2": seeds["d0"]}))
    assert secure.answers == {} and secure.held_up() == {"d0", "d1"}
    assert "d0 answered the unmasking with shares of the seeds of d1 that their owners did not deal it" in caplog.text
    stages.accept_unmask(round_id, SecAggUnmask(device_id="d0", round_id=round_id, seed_shares=seeds, key_shares=keys))
    assert secure.answers["d0"] == (seeds, keys) and secure.held_up() == {"d1"}


def test_a_survivor_that_holds_the_unmasking_up_sits_out_longer_each_time_in_a_row(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    secrets = _shared(coordinator, fed_round, DEVICES)
    open_unmasking_stage(coordinator.core, fed_round, DEVICES)
    for device in ("d0", "d2"):   # d1 never answers
        secrets[device].open_inbox({d: secrets[d].public_keys() for d in DEVICES},
                                   asyncio.run(stages.inbox(round_id, device, 0)).shares)
        seeds, keys = secrets[device].unmask(DEVICES, [])
        stages.accept_unmask(round_id, SecAggUnmask(device_id=device, round_id=round_id, seed_shares=seeds,
                                                    key_shares=keys))
    fed_round.updates.update({d: None for d in DEVICES})   # every one uploaded (only the ids count here)
    assert secure.held_up() == {"d1"}
    missed = coordinator.core.missed
    coordinator.progress.note_deadlines(fed_round, DEVICES)
    assert missed.state_dict() == {"d1": [1, round_id + 2]}   # one miss: it sits out one attempt
    # The same again two attempts later: its upload does not wash the first miss out.
    fed_round.round_id = round_id + 2
    coordinator.progress.note_deadlines(fed_round, DEVICES)
    assert missed.state_dict() == {"d1": [2, round_id + 5]}   # two in a row: two attempts


def _fits(message, limit: BodyLimit) -> bool:
    """Whether ``message`` on the wire is within ``limit``, in bytes and in entries."""
    body = packb(message.model_dump())
    if len(body) > limit.bytes:
        return False
    try:
        unpackb(body, max_entries=limit.entries)
    except WireError:
        return False
    return True


def test_a_stage_message_may_take_what_the_attempts_largest_honest_messages_take_and_no_more(tmp_path):
    coordinator, fed_round = _open_round(tmp_path, [f"d{i}" for i in range(7)], neighbours=2, threshold=2)
    stages, round_id, big = coordinator.secure, fed_round.round_id, 512 << 20
    per_device = BodyLimit(DEVICE_WIRE_BYTES, DEVICE_WIRE_ENTRIES)
    # Not the open attempt: a device's overhead each. Before the roster a device sends only keys.
    assert stages.message_limit(round_id + 1, 1000, big) == (1000 * per_device.bytes, 1000 * per_device.entries)
    assert stages.message_limit(round_id, 1000, big) == (7 * per_device.bytes, 7 * per_device.entries)
    assert stages.message_limit(round_id, 1000, 10_000).bytes == 10_000
    secrets = {d: DeviceSecrets(d, coordinator.core.run_id, round_id) for d in fed_round.assignments}
    long_id = "d" * 64
    keys = [_keys(d, round_id, own).model_copy(update={"device_id": f"{long_id[:-1]}{d[-1]}"})
            for d, own in secrets.items()]
    tokens = [AgentDevice(device_id=k.device_id, token="t" * 256) for k in keys]
    assert _fits(SecAggBatch(devices=tokens, keys=keys), stages.message_limit(round_id, 1000, big))
    for device, own in secrets.items():
        stages.accept_keys(round_id, _keys(device, round_id, own))
    close_key_stage(coordinator.core, fed_round)
    # After it, a neighbourhood of 3: three shares each.
    assert stages.message_limit(round_id, 1, big) == (3 * SHARE_WIRE_BYTES + per_device.bytes,
                                                      3 + per_device.entries)
    # The largest honest messages fit, with ids and a token of the longest allowed.
    dealt = _dealt(secrets["d0"], {d: secrets[d].public_keys() for d in fed_round.secure.neighbourhoods["d0"]})
    widest = dealt.model_copy(update={"device_id": long_id, "shares": {f"{long_id[:-1]}{i}": v
                                                                       for i, v in enumerate(dealt.shares.values())}})
    one, every = stages.message_limit(round_id, 1, big), stages.message_limit(round_id, 1000, big)
    assert _fits(widest, one)
    assert _fits(SecAggBatch(devices=[AgentDevice(device_id=long_id, token="t" * 256)], shares=[widest]), one)
    answer = SecAggUnmask(device_id=long_id, round_id=2 ** 62, seed_shares={f"{long_id[:-1]}{i}": bytes(66)
                                                                           for i in range(3)})
    assert _fits(answer, one)
    many = [answer.model_copy(update={"device_id": f"{long_id[:-1]}{i}"}) for i in range(7)]
    assert _fits(SecAggBatch(devices=[AgentDevice(device_id=a.device_id, token="t" * 256) for a in many],
                             unmask=many), every)
    # Tiny entries in their millions: refused by their count where their bytes would pass.
    tiny = widest.model_copy(update={"shares": {format(i, "x"): b"" for i in range(every.entries)}})
    assert len(packb(tiny.model_dump())) <= every.bytes and not _fits(tiny, every)


def test_a_block_that_fewer_than_threshold_survivors_uploaded_fails_the_attempt_before_any_share_is_asked(tmp_path):
    coordinator, fed_round = _open_round(tmp_path, threshold=2)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    for device, split in zip(DEVICES, (1, 2, 2)):   # as a sliding split cuts them
        fed_round.assignments[device].split_point = split
    secrets = {d: DeviceSecrets(d, "run", round_id) for d in DEVICES}
    for device in DEVICES:
        stages.accept_keys(round_id, _keys(device, round_id, secrets[device]))
    close_key_stage(coordinator.core, fed_round)
    assert secure.splits == {"d0": 1, "d1": 2, "d2": 2}
    assert asyncio.run(stages.roster(round_id, "d0", 0)).splits == secure.splits
    roster = {d: secrets[d].public_keys() for d in DEVICES}
    for device in DEVICES:
        stages.accept_shares(round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    # d2 never uploads: block 1 would be d1's alone in the sum.
    open_unmasking_stage(coordinator.core, fed_round, ["d0", "d1"])
    assert secure.plan is not None and secure.plan.survivors == [] and secure.plan.dropped == DEVICES
    assert fed_round.excluded["d1"] == ("secure aggregation: block 1 of d1 was uploaded by fewer than 2 surviving "
                                        "devices of its neighbourhood")



def test_a_neighbourhood_with_fewer_survivors_than_the_threshold_fails_the_attempt_before_any_share_is_asked(
        tmp_path):
    devices = [f"d{i}" for i in range(6)]
    coordinator, fed_round, secrets = _sparse_keys_in(tmp_path, devices)
    secure = fed_round.secure
    assert secure is not None
    for device in devices:
        roster = {d: secrets[d].public_keys() for d in secure.neighbourhoods[device]}
        coordinator.secure.accept_shares(fed_round.round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    # d0 and both its neighbours drop: the three others survive, each beside two survivors, but d0's
    # neighbours' mask keys (left in their surviving neighbours' uploads) cannot be rebuilt.
    gone = secure.neighbourhoods["d0"]
    survivors = [d for d in devices if d not in gone]
    open_unmasking_stage(coordinator.core, fed_round, survivors)
    assert secure.plan is not None and secure.plan.survivors == [] and all(not p.survivors for p in secure.plans.values())
    assert fed_round.excluded[survivors[0]] == (f"secure aggregation: fewer than 2 devices survived in the neighbourhood "
                                                f"of {', '.join(gone)}, whose secrets cannot be rebuilt")



def test_fewer_survivors_than_the_quorum_fail_the_attempt_before_any_share_is_asked(tmp_path):
    # Its sum would be useless (the attempt fails the quorum) and harmful: the retry trains the same
    # updates, and two unmasked sums of them that differ by one device give that device's update.
    coordinator, fed_round = _open_round(tmp_path, [f"d{i}" for i in range(4)], threshold=2)
    coordinator.core.config.deadlines.min_participants = 4
    secure = fed_round.secure
    assert secure is not None
    devices = sorted(fed_round.assignments)
    _shared(coordinator, fed_round, devices)
    open_unmasking_stage(coordinator.core, fed_round, devices[:3])
    assert secure.plan is not None and secure.plan.survivors == [] and secure.plans[devices[0]].survivors == []
    assert fed_round.excluded[devices[0]] == ("secure aggregation: 3 devices survived, below the quorum of 4 "
                                              "(deadlines.min_participants): the sum is not unmasked")



def test_on_a_sparse_graph_a_device_masks_the_blocks_its_neighbourhood_masks_and_is_taken_out_when_they_do_not_share(
        tmp_path, monkeypatch):
    devices = [f"d{i}" for i in range(6)]
    coordinator, fed_round = _open_round(tmp_path, devices, neighbours=2, threshold=2)
    secure, round_id, stages = fed_round.secure, fed_round.round_id, coordinator.secure
    assert secure is not None
    secrets = {d: DeviceSecrets(d, "run", round_id) for d in devices}
    for device in devices:
        fed_round.assignments[device].split_point = 2 if device in ("d0", "d1", "d3") else 1
        stages.accept_keys(round_id, _keys(device, round_id, secrets[device]))
    # The ring d0-d1-...-d5-d0 (drawn at random in a run): d0 and d1 hold block 1 side by side; d3
    # does too, but neither of its neighbours does, so it masks block 0 only.
    fixed = {d: sorted({devices[i - 1], d, devices[(i + 1) % 6]}) for i, d in enumerate(devices)}
    monkeypatch.setattr("fed_server.secure_stages.neighbourhoods", lambda roster, k, rng: fixed)
    close_key_stage(coordinator.core, fed_round)
    assert secure.splits == {"d0": 2, "d1": 2, "d2": 1, "d3": 1, "d4": 1, "d5": 1}
    assert asyncio.run(stages.roster(round_id, "d0", 0)).splits == {"d5": 1, "d0": 2, "d1": 2}
    # d1 never shares: d0's block 1 would be masked by d0 alone of its neighbourhood.
    for device in devices:
        if device != "d1":
            roster = {d: secrets[d].public_keys() for d in fixed[device]}
            stages.accept_shares(round_id, _dealt(secrets[device], roster))
    close_share_stage(coordinator.core, fed_round)
    assert fed_round.excluded["d1"] == "secure aggregation: sent no shares in time"
    assert fed_round.excluded["d0"] == ("secure aggregation: fewer than 2 of its neighbourhood that shared mask its "
                                        "deepest masked block")
    assert secure.sharers == ["d2", "d3", "d4", "d5"]


def test_a_device_masks_only_the_blocks_enough_devices_of_the_roster_hold(tmp_path):
    coordinator, fed_round = _open_round(tmp_path, threshold=2)
    secure, round_id = fed_round.secure, fed_round.round_id
    assert secure is not None
    for device, split in zip(DEVICES, (1, 2, 3)):
        fed_round.assignments[device].split_point = split
    for device in DEVICES:
        coordinator.secure.accept_keys(round_id, _keys(device, round_id))
    close_key_stage(coordinator.core, fed_round)
    # Block 2 is d2's alone: d2 masks and uploads blocks 0 and 1 only, its group copy stands in.
    assert secure.splits == {"d0": 1, "d1": 2, "d2": 2}


def _with_tokens(coordinator: Coordinator) -> dict[str, str]:
    """Each device's current token, as an authenticating server issues them."""
    for device in DEVICES:
        coordinator.enrolment.tokens.issued(device, f"token-{device}")
    return {device: f"token-{device}" for device in DEVICES}


def test_each_message_of_a_batch_is_taken_or_refused_on_its_own(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    tokens = _with_tokens(coordinator)
    round_id = fed_round.round_id
    batch = SecAggBatch(devices=[AgentDevice(device_id="d0", token=tokens["d0"]),
                                 AgentDevice(device_id="d1", token=tokens["d2"]),     # another device's token
                                 AgentDevice(device_id="ghost", token=tokens["d0"])],  # never registered
                        keys=[_keys(d, round_id) for d in ("d0", "d1", "ghost")])
    refused = coordinator.secure_batches.accept(round_id, batch, auth_enabled=True)
    assert {d: type(e) for d, e in refused.items()} == {"d1": NotAllowed, "ghost": NotFound}
    assert sorted(fed_round.secure.keys) == ["d0"]
    # Without authentication every registered device's message counts.
    assert coordinator.secure_batches.accept(round_id, batch.model_copy(update={"devices": batch.devices[:2],
                                                                                "keys": batch.keys[:2]}),
                                             auth_enabled=False) == {}
    assert sorted(fed_round.secure.keys) == ["d0", "d1"]


def test_one_held_question_answers_every_device_when_the_stage_closes(tmp_path):
    coordinator, fed_round = _open_round(tmp_path)
    tokens = _with_tokens(coordinator)
    round_id = fed_round.round_id
    devices = [AgentDevice(device_id=d, token=tokens[d]) for d in ("d0", "d1", "d2")]
    coordinator.secure_batches.accept(round_id, SecAggBatch(devices=devices[:2], keys=[_keys(d, round_id)
                                                                                     for d in ("d0", "d1")]), True)

    async def ask_then_close() -> dict:
        asking = asyncio.ensure_future(coordinator.secure_batches.ask(round_id, "roster", devices, 10.0, True))
        await asyncio.sleep(0.05)
        assert not asking.done()   # held while the key stage is open
        close_key_stage(coordinator.core, fed_round)
        return await asyncio.wait_for(asking, 5.0)

    outcomes = asyncio.run(ask_then_close())
    assert all(isinstance(outcomes[d], SecAggRoster) and outcomes[d].ready for d in ("d0", "d1"))
    assert sorted(outcomes["d0"].keys) == ["d0", "d1"] and outcomes["d1"].threshold == 2
    assert isinstance(outcomes["d2"], Conflict) and "taken out" in str(outcomes["d2"])   # it sent no keys
