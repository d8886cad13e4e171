"""The Fed Server's run logic without HTTP: quorum, retries, duplicate uploads, update checks, resume."""
from __future__ import annotations

import ast
import inspect
import json
import time

import pytest
import torch

from fed_server import coordinator as coordinator_module
from fed_server.coordinator import Coordinator
from fed_server.fed_round import OVERDUE, REENROLLED, REENROLLED_AFTER_TASK
from fed_server.run_dir import RunDirectory
from fed_server.update_checks import max_held_out, trained_samples
from shared.privacy.clipping import update_norm
from shared.data import device_shard, load_dataset
from shared.data.holdout import evaluation_holdout
from shared.errors import Conflict, Invalid, NotAllowed, NotFound, TooSoon
from shared.models import build_model, model_fingerprint
from shared.portions import portion_state
from shared.run_config import load_run_config
from shared.schemas import (
    DeviceProfileMsg, DeviceTimings, RegisterRequest, ServerPortionUpload, UpdateRequest, WeightsResponse, WithdrawRequest,
)
from shared.wire import decode_state, encode_state, unpackb

TIMINGS = DeviceTimings(compute_s=1, transfer_s=0, wait_s=0, server_s=0, total_s=1)


def _coordinator(tmp_path, **overrides) -> Coordinator:
    data = {"algorithm": "fedavg", "rounds": 2, "data": {"num_devices": 2, "max_samples": 200}, "seed": 3}
    for key, value in overrides.items():
        *section, name = key.split(".")
        (data.setdefault(section[0], {}) if section else data)[name] = value
    coordinator = Coordinator(load_run_config(data), RunDirectory(tmp_path / "run"), None)
    for i in range(2):
        coordinator.enrolment.register(RegisterRequest(device_id=f"d{i}", shard=i, num_samples=_trains_on(coordinator, i),
                                             profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    return coordinator


def _trains_on(coordinator: Coordinator, shard: int) -> int:
    """The count the device of ``shard`` registers with: its shard less its held-out part."""
    return trained_samples(coordinator.enrolment.shard_sizes[shard], coordinator.enrolment.run_info().holdout)


def _open_round(coordinator: Coordinator):
    fed_round = coordinator.begin_round()
    fed_round.ready = True
    return fed_round


def _upload(coordinator: Coordinator, device: str, round_id: int, shift: float = 0.01) -> UpdateRequest:
    state = {k: (v + shift if v.is_floating_point() else v) for k, v in portion_state(coordinator.core.model, 0, coordinator.core.num_blocks).items()}
    return UpdateRequest(device_id=device, round_id=round_id, num_samples=coordinator.core.devices.get(device).num_samples,
                         steps=1, train_loss=1.0,
                         weights=encode_state(state), timings=TIMINGS, bytes_up=0, bytes_down=0)


def _complete_round(coordinator: Coordinator) -> None:
    """Both devices upload and the round is aggregated (and checkpointed)."""
    r = _open_round(coordinator)
    for d in ("d0", "d1"):
        coordinator.uploads.accept_update(r.round_id, _upload(coordinator, d, r.round_id), 100)
    coordinator.close_round()
    coordinator.progress.record(coordinator.progress.conclude(r, coordinator.aggregate_round(r)))


def test_round_below_quorum_fails_changes_nothing_and_is_retried_with_a_new_id(tmp_path):
    c = _coordinator(tmp_path, **{"deadlines.min_participants": 2})
    before = {k: v.clone() for k, v in c.core.model.state_dict().items()}
    r1 = _open_round(c)
    c.uploads.accept_update(r1.round_id, _upload(c, "d0", r1.round_id), 100)
    c.close_round()
    record = c.progress.record(c.progress.conclude(r1, c.aggregate_round(r1)))
    assert record.status == "failed" and c.progress.rounds_done == 0
    assert all(torch.equal(before[k], v) for k, v in c.core.model.state_dict().items())
    r2 = _open_round(c)
    assert (r2.index, r2.round_id) == (1, r1.round_id + 1)
    with pytest.raises(Conflict):  # the failed attempt's id is stale now
        c.uploads.accept_update(r1.round_id, _upload(c, "d1", r1.round_id), 100)


def test_duplicate_upload_is_acknowledged_once_stored_once(tmp_path):
    c = _coordinator(tmp_path)
    r = _open_round(c)
    first = c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id, 0.01), 100)
    again = c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id, 0.5), 100)
    assert first.ok and again.ok and "already" in again.detail
    floats = sum(t.numel() for t in r.updates["d0"].state.values() if t.is_floating_point())
    # the first upload (every weight shifted by 0.01) stays; the retry's 0.5 shift is ignored
    assert update_norm(r.updates["d0"].state, c.core.model.state_dict()) == pytest.approx(0.01 * floats ** 0.5, rel=1e-3)


@pytest.mark.parametrize("action", ["reject", "clip"])
def test_update_norm_limit(tmp_path, action):
    c = _coordinator(tmp_path, **{"updates.max_norm": 1.0, "updates.action": action})
    r = _open_round(c)
    huge = _upload(c, "d0", r.round_id, shift=10.0)
    if action == "reject":
        with pytest.raises(Invalid) as refused:
            c.uploads.accept_update(r.round_id, huge, 100)
        assert "max_norm" in refused.value.detail
        assert "d0" not in r.updates
    else:
        c.uploads.accept_update(r.round_id, huge, 100)
        assert update_norm(r.updates["d0"].state, c.core.model.state_dict()) == pytest.approx(1.0, rel=1e-5)


@pytest.mark.parametrize("claimed", [10**12, 1, -1], ids=["huge", "one more", "one less"])
def test_upload_claiming_other_than_its_registered_samples_is_refused_and_not_stored(tmp_path, claimed):
    c = _coordinator(tmp_path)
    r = _open_round(c)
    registered = c.core.devices.get("d1").num_samples
    claimed = claimed if claimed > 1 else registered + claimed
    with pytest.raises(Invalid) as refused:
        c.uploads.accept_update(r.round_id, _upload(c, "d1", r.round_id).model_copy(update={"num_samples": claimed}), 100)
    assert f"num_samples={claimed}" in refused.value.detail and f"{registered} samples" in refused.value.detail
    assert "d1" not in r.updates


def test_a_refused_upload_takes_its_device_out_of_the_attempt_which_then_waits_only_for_the_others(tmp_path):
    c = _coordinator(tmp_path, **{"deadlines.round_s": 120})
    r = _open_round(c)
    bad = _upload(c, "d1", r.round_id)
    bad = bad.model_copy(update={"timings": bad.timings.model_copy(update={"compute_s": 1e6})})
    c.core.changed.clear()
    with pytest.raises(Invalid) as refused:
        c.uploads.accept_update(r.round_id, bad, 100)
    assert c.core.changed.is_set()   # the driver wakes to look again
    assert r.excluded == {"d1": f"upload refused: {refused.value.detail}"}
    with pytest.raises(Conflict, match="taken out of round .*upload refused"):   # even a good one now
        c.uploads.accept_update(r.round_id, _upload(c, "d1", r.round_id), 100)
    assert "d1" not in r.updates and not r.complete()
    c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id), 100)
    assert r.complete()   # the last device that can contribute has uploaded: no wait for the deadline
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.status == "ok" and record.aggregated == ["d0"] and record.dropped == ["d1"]
    assert record.left == {"d1": r.excluded["d1"]} and "compute_s" in record.left["d1"]


def test_a_stale_round_or_a_duplicate_does_not_take_a_device_out(tmp_path):
    c = _coordinator(tmp_path)
    r = _open_round(c)
    with pytest.raises(Conflict, match="not open"):
        c.uploads.accept_update(r.round_id + 1, _upload(c, "d0", r.round_id + 1), 100)
    c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id), 100)
    assert "already stored" in c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id, shift=0.5), 100).detail
    assert r.excluded == {}


def _withdrawal(device: str, round_id: int, reason: str = "cannot build the task") -> WithdrawRequest:
    return WithdrawRequest(device_id=device, round_id=round_id, reason=reason)


def test_a_withdrawal_takes_the_device_out_at_once_and_is_idempotent(tmp_path):
    c = _coordinator(tmp_path, **{"deadlines.round_s": 120})
    r = _open_round(c)
    c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id), 100)
    assert not r.complete()
    c.core.changed.clear()
    ack = c.uploads.withdraw(r.round_id, _withdrawal("d1", r.round_id))
    assert ack.ok and "withdrew: cannot build the task" in ack.detail and c.core.changed.is_set()
    assert r.excluded == {"d1": "withdrew: cannot build the task"} and r.complete()
    assert c.uploads.withdraw(r.round_id, _withdrawal("d1", r.round_id, "again")).ok   # idempotent: the first reason stays
    assert r.excluded == {"d1": "withdrew: cannot build the task"}
    with pytest.raises(Conflict, match="taken out"):
        c.uploads.accept_update(r.round_id, _upload(c, "d1", r.round_id), 100)
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.aggregated == ["d0"] and record.left == {"d1": "withdrew: cannot build the task"}


def test_withdrawals_that_do_not_fit_are_refused_and_change_nothing(tmp_path):
    c = _coordinator(tmp_path, **{"data.num_devices": 3, "devices_per_round": 2})
    c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=c.enrolment.shard_sizes[2],
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    with pytest.raises(Conflict, match="not open"):
        c.uploads.withdraw(1, _withdrawal("d0", 1))
    r = _open_round(c)
    outsider = next(d for d in ("d0", "d1", "d2") if d not in r.assignments)
    inside = sorted(r.assignments)
    with pytest.raises(NotAllowed, match="not selected"):
        c.uploads.withdraw(r.round_id, _withdrawal(outsider, r.round_id))
    with pytest.raises(Conflict, match="not open"):
        c.uploads.withdraw(r.round_id + 1, _withdrawal(inside[0], r.round_id + 1))
    with pytest.raises(Invalid, match="does not match"):
        c.uploads.withdraw(r.round_id, _withdrawal(inside[0], r.round_id + 1))
    with pytest.raises(NotFound):
        c.uploads.withdraw(r.round_id, _withdrawal("ghost", r.round_id))
    c.uploads.accept_update(r.round_id, _upload(c, inside[0], r.round_id), 100)
    with pytest.raises(Conflict, match="already stored"):
        c.uploads.withdraw(r.round_id, _withdrawal(inside[0], r.round_id))
    assert r.excluded == {} and list(r.updates) == [inside[0]]


def test_a_split_device_without_its_group_portion_is_not_aggregated(tmp_path):
    c = _coordinator(tmp_path, algorithm="s2fl")
    r = _open_round(c)
    before = {k: v.clone() for k, v in c.core.model.state_dict().items()}
    for d in ("d0", "d1"):
        c.uploads.accept_update(r.round_id, _upload_split(c, d, r), 100)
    c.uploads.accept_portion(r.round_id, _portion(c, r, 0, ["d0"]), 10)
    assert not r.complete()   # d1's group is still out: the round waits for it (until its deadline)
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.aggregated == ["d0"] and record.left == {"d1": "its group portion never arrived"}
    # Only d0 (client layers shifted by 0.01, its group's server layers unchanged) moved the model.
    split = r.assignments["d0"].split_point
    client_keys = set(portion_state(c.core.model, 0, split))
    for key, value in c.core.model.state_dict().items():
        if value.is_floating_point():
            assert torch.allclose(value, before[key] + (0.01 if key in client_keys else 0.0), atol=1e-6), key


def _upload_split(c: Coordinator, device: str, fed_round) -> UpdateRequest:
    split = fed_round.assignments[device].split_point
    state = {k: v + 0.01 for k, v in portion_state(c.core.model, 0, split).items()}
    return _upload(c, device, fed_round.round_id).model_copy(update={"weights": encode_state(state)})


def _portion(c: Coordinator, fed_round, group_id: int, members: list[str]) -> ServerPortionUpload:
    start = min(fed_round.assignments[m].split_point for m in members)
    return ServerPortionUpload(run_id=c.core.run_id, round_id=fed_round.round_id, group_id=group_id, members=members,
                               dropped=[], start_block=start,
                               weights=encode_state(portion_state(c.core.model, start, c.core.num_blocks)),
                               label_distance=0.0, steps=1, train_time_s=0.1)


def test_with_member_updates_each_member_is_aggregated_with_its_own_state_checked_like_the_copy(tmp_path):
    c = _coordinator(tmp_path, algorithm="s2fl", **{"grouping.member_defences": ["member_updates"]})
    r = _open_round(c)
    for d in ("d0", "d1"):
        c.uploads.accept_update(r.round_id, _upload_split(c, d, r), 100)
    portion = _portion(c, r, 0, ["d0", "d1"])
    start = portion.start_block
    states = {d: {k: v + shift for k, v in portion_state(c.core.model, start, c.core.num_blocks).items()}
              for d, shift in (("d0", 0.5), ("d1", -0.5))}
    own = {d: encode_state(state) for d, state in states.items()}
    key = next(iter(states["d0"]))
    misshapen = encode_state({**states["d0"], key: torch.zeros(1)})
    refusals = [portion,                                                           # no member states
                portion.model_copy(update={"member_weights": {"d0": own["d0"]}}),   # one member's missing
                portion.model_copy(update={"member_weights": {**own, "d0": misshapen}})]
    for bad in refusals:
        with pytest.raises(Invalid):
            c.uploads.accept_portion(r.round_id, bad, 10)
        assert r.portions == {}
    c.uploads.accept_portion(r.round_id, portion.model_copy(update={"member_weights": own}), 10)
    stored = r.portions[0]
    assert set(stored.member_states) == {"d0", "d1"}
    assert torch.allclose(stored.server_state("d0")[key], stored.state[key] + 0.5)
    plain = _coordinator(tmp_path / "plain", algorithm="s2fl")
    with pytest.raises(Invalid, match="send no member states"):
        plain.uploads.accept_portion(_open_round(plain).round_id, portion.model_copy(update={
            "member_weights": own, "run_id": plain.core.run_id}), 10)


def test_registration_must_claim_its_shards_exact_count(tmp_path):
    c = _coordinator(tmp_path, **{"data.num_devices": 3})
    before = dict(c.core.devices.devices)
    for claimed in (10**12, c.enrolment.shard_sizes[2] + 1, c.enrolment.shard_sizes[2] - 1, 0):
        with pytest.raises(Invalid, match=f"num_samples={claimed} of 'd2': shard 2 trains on {c.enrolment.shard_sizes[2]} samples"):
            c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=claimed,
                                       profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    assert c.core.devices.devices == before
    c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=c.enrolment.shard_sizes[2],
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    # The shards are the devices' own: the same partition of the same data set.
    train, _ = load_dataset(c.config.data)
    assert c.enrolment.shard_sizes == [len(device_shard(c.config.data, train, i)) for i in range(3)]


def test_the_start_does_not_wait_for_a_shard_whose_registration_was_refused(tmp_path):
    # Its holder cannot join as it is (here: a claimed count beyond its shard), so waiting for it
    # would only hold every other device until deadlines.registration_s.
    c = _coordinator(tmp_path, **{"data.num_devices": 4})
    assert not c.enrolment.ready()
    profile = DeviceProfileMsg(flops=1e9, rate=1e6)
    with pytest.raises(Invalid):
        c.enrolment.register(RegisterRequest(device_id="d9", shard=9, num_samples=10, profile=profile))  # no such shard
    with pytest.raises(Invalid):
        c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=10**12, profile=profile))
    assert not c.enrolment.ready(), "shard 3 has neither a device nor a refusal"
    with pytest.raises(Invalid):
        c.enrolment.register(RegisterRequest(device_id="d3", shard=3, num_samples=10**12, profile=profile))
    assert c.enrolment.ready() and len(c.core.devices) == 2
    # The refused holder may still come back honest and join the run.
    c.enrolment.register(RegisterRequest(device_id="d3", shard=3, num_samples=c.enrolment.shard_sizes[3], profile=profile))
    assert len(c.core.devices) == 3


def test_with_federated_evaluation_a_device_registers_its_shard_less_its_held_out_part(tmp_path):
    c = _coordinator(tmp_path, **{"data.num_devices": 3, "evaluation.mode": "federated", "evaluation.holdout": 0.3})
    train, _ = load_dataset(c.config.data)
    shard = device_shard(c.config.data, train, 2)
    kept, held_out = evaluation_holdout(shard, 0.3, c.config.seed, "d2")   # what the device computes
    profile = DeviceProfileMsg(flops=1e9, rate=1e6)
    with pytest.raises(Invalid, match=f"trains on {len(kept)} samples"):
        c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=len(shard), profile=profile))
    c.enrolment.register(RegisterRequest(device_id="d2", shard=2, num_samples=len(kept), profile=profile))
    assert c.enrolment.held_out_limit("d2") == len(held_out)


def test_a_local_device_may_claim_at_most_max_device_samples(tmp_path):
    local = {"dataset": "local", "num_devices": 2, "num_classes": 10, "input_shape": [1, 28, 28],
             "max_device_samples": 500}
    c = Coordinator(load_run_config({"algorithm": "fedavg", "data": local}), RunDirectory(tmp_path / "run"), None)
    profile = DeviceProfileMsg(flops=1e9, rate=1e6)
    for claimed in (501, 10**12):
        with pytest.raises(Invalid, match=f"num_samples={claimed} of 'a' exceeds data.max_device_samples=500"):
            c.enrolment.register(RegisterRequest(device_id="a", num_samples=claimed, profile=profile))
    assert len(c.core.devices) == 0
    c.enrolment.register(RegisterRequest(device_id="a", num_samples=500, profile=profile))
    assert c.enrolment.held_out_limit("a") == max_held_out(500, c.config.evaluation.holdout)


@pytest.mark.parametrize("timings, word", [
    ({"compute_s": 1e308, "transfer_s": 1e308}, "compute_s"),          # each finite, the sum is not
    ({"compute_s": 70.0, "transfer_s": 70.0}, "compute_s + transfer_s"),  # each fits, the sum does not
    ({"wait_s": 121.0}, "wait_s"),
    ({"total_s": 1e300}, "total_s"),
])
def test_upload_with_timings_beyond_the_round_deadline_is_refused_and_not_stored(tmp_path, timings, word):
    c = _coordinator(tmp_path, **{"deadlines.round_s": 120})
    r = _open_round(c)
    bad = _upload(c, "d0", r.round_id)
    bad = bad.model_copy(update={"timings": bad.timings.model_copy(update=timings)})
    with pytest.raises(Invalid) as refused:
        c.uploads.accept_update(r.round_id, bad, 100)
    assert word in refused.value.detail and "deadline of 120s" in refused.value.detail
    assert "d0" not in r.updates


def test_a_time_the_table_cannot_take_drops_that_cell_not_the_round(tmp_path):
    # accept_update bounds the timings; this stores an unusable one behind its back, as a future
    # bug could, and the round must still aggregate, record and checkpoint.
    c = _coordinator(tmp_path)
    r = _open_round(c)
    for d in ("d0", "d1"):
        c.uploads.accept_update(r.round_id, _upload(c, d, r.round_id), 100)
        r.assignments[d].candidate = 0
    stored = r.updates["d0"].request
    stored.timings = stored.timings.model_copy(update={"compute_s": 1e308, "transfer_s": 1e308})  # sum: inf
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.status == "ok" and c.progress.rounds_done == 1
    assert c.table.get("d0", 0) is None and c.table.get("d1", 0) is not None
    assert c.run_dir.read_checkpoint()[0] == 1   # the round was checkpointed


def test_restart_resumes_from_the_checkpoint_without_losing_or_repeating_a_round(tmp_path):
    c = _coordinator(tmp_path)
    _complete_round(c)
    rng_at_checkpoint = c.rng.getstate()
    _open_round(c)  # round 2 starts, then the server dies before it finishes
    resumed = _coordinator(tmp_path)
    assert resumed.resumed and resumed.progress.rounds_done == 1 and resumed.core.run_id == c.core.run_id
    assert resumed.progress.attempts == 2  # the interrupted attempt (id 2) was reserved before it was handed out ...
    assert all(torch.equal(a, b) for a, b in zip(resumed.core.model.state_dict().values(), c.core.model.state_dict().values()))
    assert resumed.rng.getstate() == rng_at_checkpoint
    assert [m.round for m in resumed.progress.history] == [1]
    r2 = _open_round(resumed)
    assert r2.index == 2 and r2.round_id == 3  # ... so its id is skipped, never reused


def test_resume_drops_metrics_lines_the_checkpoint_does_not_cover_and_else_leaves_the_file(tmp_path):
    c = _coordinator(tmp_path)
    _complete_round(c)
    metrics = c.run_dir.metrics_path
    inode = metrics.stat().st_ino
    assert [m.round for m in _coordinator(tmp_path).progress.history] == [1]
    assert metrics.stat().st_ino == inode  # nothing to drop: not rewritten
    with open(metrics, "a") as fh:  # a round recorded after the last checkpoint, then a crash
        fh.write('{"round": 2, "status": "ok"}\n')
    assert [m.round for m in _coordinator(tmp_path).progress.history] == [1]
    assert [m["round"] for m in c.run_dir.read_metrics()] == [1]


def test_waiting_devices_are_told_how_soon_to_poll_again(tmp_path):
    from fed_server.task_dispatch import IDLE_RETRY_S, SOON_RETRY_S

    c = _coordinator(tmp_path)
    c.config.devices_per_round = 1
    assert c.dispatch.task_for("d0").retry_after_s == IDLE_RETRY_S          # no round has started yet
    fed_round = c.begin_round()
    assert c.dispatch.task_for("d0").retry_after_s == SOON_RETRY_S          # a round is being planned
    fed_round.ready = True
    chosen = next(iter(fed_round.assignments))
    idle = "d1" if chosen == "d0" else "d0"
    assert c.dispatch.task_for(idle).retry_after_s == IDLE_RETRY_S          # not in the running round
    assert c.dispatch.task_for(chosen).status == "train"
    assert c.dispatch.task_for(chosen).retry_after_s == SOON_RETRY_S        # a participant may get a follow-up
    assert IDLE_RETRY_S > SOON_RETRY_S


def test_a_device_enrolled_again_during_a_split_attempt_sits_it_out_and_takes_part_in_the_next(tmp_path):
    # The Main Server checks tokens against the nonces in the attempt's plan: a restarted agent's
    # device, enrolled again after the attempt began, would be refused there, so it leaves this
    # attempt at once (not charged: it had not taken its task), and its plan entry keeps the
    # nonce the Main Server was given.
    c = _coordinator(tmp_path, algorithm="s2fl")
    fed_round = _open_round(c)
    before = fed_round.assignments["d1"].token_nonce
    assert before == c.core.devices.token_nonce("d1")
    c.enrolment.register(RegisterRequest(device_id="d1", shard=1, num_samples=c.enrolment.shard_sizes[1],
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    assert c.core.devices.token_nonce("d1") != before
    assert fed_round.excluded == {"d1": REENROLLED}
    assert c.dispatch.task_for("d1").status == "wait"
    assert c.dispatch.task_for("d0").status == "train"
    plan = c.replicas.round_plan(fed_round, ["d0", "d1"])
    assert {p.device_id: p.token_nonce for p in plan.participants}["d1"] == before
    assert "d1" not in fed_round.missed_deadline([])
    c.core.round = None
    assert _open_round(c).assignments["d1"].token_nonce == c.core.devices.token_nonce("d1")


def test_registering_again_after_taking_a_task_counts_as_a_miss_which_registering_again_does_not_wash_out(tmp_path):
    # A silent device that takes its task and registers again (to wash out its penalty, or an
    # agent that restarted) leaves the attempt at once, so nobody waits for it, and is charged a
    # missed deadline; its record survives every later registration.
    c = _coordinator(tmp_path)
    fed_round = _open_round(c)
    assert c.dispatch.task_for("d1").status == "train"
    c.enrolment.register(RegisterRequest(device_id="d1", shard=1, num_samples=_trains_on(c, 1),
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    assert fed_round.excluded == {"d1": REENROLLED_AFTER_TASK}
    c.uploads.accept_update(fed_round.round_id, _upload(c, "d0", fed_round.round_id), 100)
    assert fed_round.complete()    # the attempt does not wait for d1
    c.close_round()
    c.progress.record(c.progress.conclude(fed_round, c.aggregate_round(fed_round)))
    c.enrolment.register(RegisterRequest(device_id="d1", shard=1, num_samples=_trains_on(c, 1),
                               profile=DeviceProfileMsg(flops=1e9, rate=1e6)))
    assert "d1" in c.core.missed.skipped(fed_round.round_id + 1)
    assert list(_open_round(c).assignments) == ["d0"]


def test_a_device_registering_again_too_soon_is_refused_with_its_retry_time_and_nothing_changes(tmp_path):
    c = _coordinator(tmp_path, **{"deadlines.reregistration_s": 30.0})
    from shared.auth import Auth

    req = RegisterRequest(device_id="d1", shard=1, num_samples=_trains_on(c, 1), profile=DeviceProfileMsg(flops=1e9, rate=1e6))
    c.enrolment.enrol(req, None, Auth())
    nonce = c.core.devices.token_nonce("d1")
    with pytest.raises(TooSoon, match="reregistration_s") as refused:
        c.enrolment.enrol(req, None, Auth())
    assert 29.0 < refused.value.retry_after_s <= 30.0
    assert c.core.devices.token_nonce("d1") == nonce
    unlimited = _coordinator(tmp_path / "b", **{"deadlines.reregistration_s": 0.0})
    unlimited.enrolment.enrol(req, None, Auth())
    unlimited.enrolment.enrol(req, None, Auth())


def test_finished_run_names_the_final_model_to_every_device_and_serves_it(tmp_path):
    c = _coordinator(tmp_path)
    c.core.finished = True
    done = c.dispatch.task_for("d0")
    assert done.status == "done" and done.num_blocks == c.core.num_blocks and done.weights_id is not None
    assert c.dispatch.task_for("d1") is done  # one answer for every device, one body for every fetch
    final = WeightsResponse.model_validate(unpackb(b"".join(c.core.weights.body(done.weights_id))))
    state = decode_state(final.weights)
    assert list(state) == c.core.model.portion_keys(0, c.core.num_blocks)
    assert all(torch.equal(state[k], v) for k, v in c.core.model.state_dict().items())


def test_resume_refuses_a_checkpoint_of_a_different_configuration(tmp_path):
    c = _coordinator(tmp_path)
    _complete_round(c)
    with pytest.raises(ValueError, match=r"train\.lr differ"):
        _coordinator(tmp_path, **{"train.lr": 0.2})
    # More rounds and other deadlines are fine: that is how an interrupted run is extended.
    resumed = _coordinator(tmp_path, **{"deadlines.round_s": 99.0})
    assert resumed.resumed and resumed.progress.rounds_done == 1


def test_attempt_ids_are_never_reused_across_restarts_that_never_checkpoint(tmp_path):
    c = _coordinator(tmp_path)
    _complete_round(c)                      # checkpoint: 1 attempt
    ids = [_open_round(c).round_id]         # attempt 2, then the server dies
    for _ in range(3):                      # incarnations that each open one attempt and die
        ids.append(_open_round(_coordinator(tmp_path)).round_id)
    assert ids == [2, 3, 4, 5]


def test_a_restart_before_the_first_checkpoint_reuses_no_attempt_id_and_keeps_no_uncovered_line(tmp_path):
    c = _coordinator(tmp_path)
    assert _open_round(c).round_id == 1     # attempt 1 handed out, then the server dies
    again = _coordinator(tmp_path)
    assert not again.resumed and _open_round(again).round_id == 2
    with open(again.run_dir.metrics_path, "a") as fh:   # a record written, the checkpoint never
        fh.write('{"round": 1, "status": "ok"}\n')
    third = _coordinator(tmp_path)
    assert third.progress.history == [] and third.run_dir.read_metrics() == []
    assert _open_round(third).round_id == 3


def test_a_finished_run_killed_before_its_summary_gets_it_on_resume(tmp_path):
    c = _coordinator(tmp_path)              # 2 rounds
    _complete_round(c)
    _complete_round(c)
    summary = c.run_dir.path / "summary.json"
    assert c.core.finished and summary.exists()
    summary.unlink()                        # the kill landed between the checkpoint and the summary
    resumed = _coordinator(tmp_path)
    assert resumed.core.finished and json.loads(summary.read_text())["rounds"] == 2


def test_non_finite_numbers_are_written_as_null_and_read_back(tmp_path):
    c = _coordinator(tmp_path)
    r = _open_round(c)
    for d in ("d0", "d1"):
        c.uploads.accept_update(r.round_id, _upload(c, d, r.round_id), 100)
        # accept_update refuses such a loss; the recorder must still write standard JSON should
        # a record ever hold one, so the stored figure is changed behind the check.
        r.updates[d].request.train_loss = 1e308
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.train_loss is None        # 1e308 * samples overflows to inf
    line = c.run_dir.metrics_path.read_text().splitlines()[0]
    assert "Infinity" not in line and json.loads(line)["train_loss"] is None
    assert _coordinator(tmp_path).progress.history == [record]


def test_a_local_run_evaluates_on_its_test_file_loads_no_data_set_and_gives_slots(tmp_path, monkeypatch):
    import numpy as np

    import shared.evaluation as evaluation_module

    def no_global_data(spec):
        raise AssertionError("a local run must not load a global data set")

    monkeypatch.setattr(evaluation_module, "load_dataset", no_global_data)
    test_file = tmp_path / "test.npz"
    np.savez(test_file, x=np.random.default_rng(0).integers(0, 256, (30, 28, 28)).astype(np.uint8),
             y=np.arange(30) % 10)
    local = {"dataset": "local", "num_devices": 2, "num_classes": 10, "input_shape": [1, 28, 28],
             "input_transform": {"scale": 1 / 255}}
    config = load_run_config({"algorithm": "fedavg", "model": "cnn", "data": {**local, "test_file": str(test_file)}})
    coordinator = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    assert len(coordinator.progress.test_set) == 30 and float(coordinator.progress.test_set.x.max()) <= 1.0
    profile = DeviceProfileMsg(flops=1e9, rate=1e6)
    answers = [coordinator.enrolment.register(RegisterRequest(device_id=d, num_samples=5, profile=profile)) for d in ("b", "a")]
    assert [a.shard for a in answers] == [0, 1] and coordinator.enrolment.ready()
    with pytest.raises(Conflict, match="slots"):
        coordinator.enrolment.register(RegisterRequest(device_id="c", num_samples=5, profile=profile))
    # Without a test file the devices evaluate (federated evaluation): still no global data set.
    federated = Coordinator(load_run_config({"algorithm": "fedavg", "data": local}), RunDirectory(tmp_path / "run2"), None)
    assert federated.progress.test_set is None and federated.core.evaluation_mode == "federated"


def test_registration_with_a_different_model_fingerprint_is_refused_and_changes_nothing(tmp_path):
    c = _coordinator(tmp_path, **{"data.num_devices": 4})
    assert c.enrolment.run_info().fingerprint == c.enrolment.fingerprint
    other = model_fingerprint(build_model("cnn", 10, (1, 28, 28), params={}), c.config.data.model_copy(
        update={"transform": "rgb32"}))
    before = dict(c.core.devices.devices)
    req = RegisterRequest(device_id="d2", shard=2, num_samples=c.enrolment.shard_sizes[2], profile=DeviceProfileMsg(flops=1e9, rate=1e6),
                          fingerprint=other)
    with pytest.raises(Conflict) as err:
        c.enrolment.register(req)
    assert "transform: 'rgb32' on the device, 'none' in the run" in str(err.value)
    assert c.core.devices.devices == before
    # The run's own fingerprint, or none at all (a device that does not send one), registers.
    c.enrolment.register(req.model_copy(update={"fingerprint": c.enrolment.fingerprint}))
    c.enrolment.register(req.model_copy(update={"device_id": "d3", "shard": 3, "num_samples": c.enrolment.shard_sizes[3], "fingerprint": None}))
    assert {"d2", "d3"} <= set(c.core.devices.devices)


def test_an_aggregated_device_s_usual_time_is_bounded_by_patience_times_its_peers(tmp_path):
    # d1 uploaded 30 s after its task, d0 after 2 s: d1's usual time counts 2 x 2 s (the run's
    # patience), so uploading late on purpose does not lengthen its own deadline in later attempts.
    c = _coordinator(tmp_path)
    r = _open_round(c)
    for device, seconds in (("d0", 2.0), ("d1", 30.0)):
        c.uploads.accept_update(r.round_id, _upload(c, device, r.round_id), 100)
        r.updates[device].arrived_at = r.wait_began(device) + seconds
    c.close_round()
    c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    split = r.assignments["d0"].split_point
    assert c.config.deadlines.patience == 2.0
    assert c.core.pace.usual("d0", split) == pytest.approx(2.0) and c.core.pace.usual("d1", split) == pytest.approx(4.0)


def test_a_split_round_plan_carries_each_device_s_download_time_and_the_run_s_patience(tmp_path):
    # What the Main Server needs for each participant's own join deadline (main_server/join_phase.py).
    c = _coordinator(tmp_path, algorithm="s2fl")
    fed_round = _open_round(c)
    plan = c.replicas.round_plan(fed_round, ["d0", "d1"])
    assert (plan.patience, plan.patience_grace_s) == (c.config.deadlines.patience, c.config.deadlines.patience_grace_s)
    for p in plan.participants:
        a = fed_round.assignments[p.device_id]
        wc = c.planner.profile.cost(c.planner.split_points[a.candidate]).client_param_bytes
        assert p.download_s == pytest.approx(wc / c.core.devices.devices[p.device_id].profile.rate)


def test_the_fed_server_keeps_no_training_set_after_start_up(tmp_path):
    # Shard sizes and the fingerprint's shard vectors are computed at start-up; then only the test
    # set is held (a population's training set grows with it).
    from shared.data import load_dataset

    c = _coordinator(tmp_path, **{"data.dataset": "synthetic", "data.num_devices": 2, "data.max_samples": None,
                                  "model": "logreg"})
    held = load_dataset(c.config.data)[0]
    assert load_dataset(c.config.data)[0].x is held.x
    _coordinator(tmp_path / "again", **{"data.dataset": "synthetic", "data.num_devices": 2,
                                        "data.max_samples": None, "model": "logreg"})
    assert load_dataset(c.config.data)[0].x is not held.x


def test_a_revoked_credential_takes_its_devices_out_of_the_attempt_and_frees_their_ids(tmp_path):
    """What SIGHUP applies (DeviceEnrolment.revoke): the device is out of the open attempt, its
    stored update with it, its token unknown, its registration gone; the round aggregates the
    others, and a new credential enrols the same device on the same shard."""
    from shared.auth import Auth, CredentialScope, Enrolment, credential_holder

    config = load_run_config({"algorithm": "fedavg", "rounds": 2, "data": {"num_devices": 2, "max_samples": 200},
                              "seed": 3})
    c = Coordinator(config, RunDirectory(tmp_path / "run"), None)
    auth = Auth(b"service-secret", enrolment_key=b"enrolment-key")

    def enrol(device: str, shard: int, credential: str) -> str:
        req = RegisterRequest(device_id=device, shard=shard, num_samples=_trains_on(c, shard),
                              profile=DeviceProfileMsg(flops=1e9, rate=1e6))
        answer = c.enrolment.enrol(req, Enrolment(credential_holder(credential), CredentialScope.parse(credential)), auth)
        assert answer.token is not None
        return answer.token

    enrol("d0", 0, "d0")
    token = enrol("d1", 1, "d1")
    r = _open_round(c)
    c.uploads.accept_update(r.round_id, _upload(c, "d1", r.round_id), 100)
    assert c.enrolment.revoke({"nobody"}) == {} and c.core.devices.ids() == ["d0", "d1"]
    assert c.enrolment.revoke({"d1"}) == {"d1": "d1"}
    assert r.excluded == {"d1": "its enrolment credential d1 was revoked"}
    assert c.core.devices.ids() == ["d0"] and c.enrolment.tokens.holder(token) is None
    with pytest.raises(NotFound):
        c.uploads.accept_update(r.round_id, _upload_as(c, "d0", "d1", r.round_id), 100)
    c.uploads.accept_update(r.round_id, _upload(c, "d0", r.round_id), 100)
    assert r.complete()
    c.close_round()
    record = c.progress.record(c.progress.conclude(r, c.aggregate_round(r)))
    assert record.status == "ok" and record.aggregated == ["d0"]
    assert enrol("d1", 1, "d1@2") != token and c.core.devices.get("d1").shard == 1


def _upload_as(coordinator: Coordinator, registered: str, device: str, round_id: int) -> UpdateRequest:
    """``registered``'s upload sent under ``device``'s id (a device no longer registered)."""
    return _upload(coordinator, registered, round_id).model_copy(update={"device_id": device})


def test_the_coordinator_passes_no_call_on():
    # The routes, the driver and the metrics call each part by its name; a method or property
    # whose whole body hands the call to one part would make the coordinator half a facade again.
    cls = next(node for node in ast.parse(inspect.getsource(coordinator_module)).body
               if isinstance(node, ast.ClassDef) and node.name == "Coordinator")
    passed_on = []
    for method in (node for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
        body = [statement for statement in method.body
                if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]
        value = body[0].value if len(body) == 1 and isinstance(body[0], (ast.Return, ast.Expr)) else None
        if isinstance(value, ast.Await):
            value = value.value
        call = value.func if isinstance(value, ast.Call) else value
        if isinstance(call, ast.Attribute) and isinstance(call.value, ast.Attribute) \
                and isinstance(call.value.value, ast.Name) and call.value.value.id == "self":
            passed_on.append(method.name)
        if any(isinstance(d, ast.Name) and d.id == "property" or isinstance(d, ast.Attribute) and d.attr == "setter"
               for d in method.decorator_list):
            passed_on.append(method.name)
    assert passed_on == []


def test_split_candidates_limit_the_cuts_the_planner_chooses_among_and_the_warm_up(tmp_path):
    # split.candidates: [1, 3] of the cnn's 1, 2, 3: the paper's warm-up takes two rounds (cut 1,
    # then 3) and no device is ever cut at 2.
    coordinator = _coordinator(tmp_path, algorithm="s2fl", **{"split.candidates": [1, 3], "split.warm_up": "every_split"})
    assert coordinator.planner.split_points == [1, 3] and coordinator.table.num_candidates == 2
    devices = ["d0", "d1"]
    assert [sorted({k for _, k in coordinator.planner.choose(r, devices).values()}) for r in (1, 2)] == [[1], [3]]
    for r in range(3, 8):
        assert {k for _, k in coordinator.planner.choose(r, devices).values()} <= {1, 3}
    # A number picks that many, the cheapest cut to send of each stretch of the model: the cnn's
    # smallest activation is after block 3.
    one = _coordinator(tmp_path / "one", algorithm="s2fl", **{"split.candidates": 1})
    assert one.planner.split_points == [3]


@pytest.mark.parametrize("cut", ["own deadline", "never joined"])
def test_a_device_cut_short_is_a_censored_entry_of_the_time_table(tmp_path, cut):
    # d1 took its task 7 s ago and is cut: at its own deadline by the Fed Server, or left out of
    # every group by the Main Server (its join came after the join deadline). Either way its round
    # at its split takes at least the 7 s it was waited for; d0, aggregated, is measured.
    c = _coordinator(tmp_path, algorithm="s2fl")
    r = _open_round(c)
    r.assignments["d1"].dispatched_at = time.monotonic() - 7.0
    c.uploads.accept_update(r.round_id, _upload_split(c, "d0", r), 100)
    portion = _portion(c, r, 0, ["d0"])
    if cut == "own deadline":
        c.core.exclude(r, ["d1"], OVERDUE)
    else:
        portion = portion.model_copy(update={"absent": ["d1"]})
    c.uploads.accept_portion(r.round_id, portion, 10)
    c.close_round()
    assert c.aggregate_round(r).used == ["d0"]
    j = r.assignments["d1"].candidate
    assert c.table.censored("d1") == {j: pytest.approx(7.0, abs=1.0)}
    assert c.table.censored("d0") == {} and c.table.get("d0", r.assignments["d0"].candidate) is not None


def test_a_device_left_out_for_the_servers_sake_is_no_censored_entry(tmp_path):
    # Its group's portion never arrived (a Main Server's failure, not the device's pace).
    c = _coordinator(tmp_path, algorithm="s2fl")
    r = _open_round(c)
    r.assignments["d1"].dispatched_at = time.monotonic() - 7.0
    for d in ("d0", "d1"):
        c.uploads.accept_update(r.round_id, _upload_split(c, d, r), 100)
    c.uploads.accept_portion(r.round_id, _portion(c, r, 0, ["d0"]), 10)
    c.close_round()
    assert c.aggregate_round(r).used == ["d0"]
    assert c.table.censored("d1") == {}


def test_adaptive_clipping_counts_the_devices_that_were_inside_the_bound_before_they_clipped(tmp_path):
    # Both devices moved far past the bound and clipped: their uploads are at the bound, give or take
    # float32 rounding, so their norm cannot tell; what each device says can. (The count's noise is
    # drawn from the operating system: the count is read before it is added.)
    c = _coordinator(tmp_path, **{"aggregation.rule": "mean", "privacy.clipping": "adaptive", "privacy.clip_norm": 0.1,
                                  "privacy.noise": "central", "privacy.noise_multiplier": 1.0, "privacy.delta": 1e-3})
    start = portion_state(c.core.model, 0, c.core.num_blocks)
    moved = {k: (v + 0.5 if v.is_floating_point() else v) for k, v in start.items()}
    scale = 0.1 / update_norm(moved, start)
    clipped = {k: (start[k] + (v - start[k]) * scale).to(v.dtype) if v.is_floating_point() else v
               for k, v in moved.items()}
    assert abs(update_norm(clipped, start) - 0.1) < 1e-5
    r = _open_round(c)
    for d, said in (("d0", True), ("d1", False)):
        c.uploads.accept_update(r.round_id, _upload(c, d, r.round_id).model_copy(
            update={"weights": encode_state(clipped), "inside_clip": said}), 100)
    c.close_round()
    assert c.aggregator._summed(r, ["d0", "d1"], start, 0.1)[2] == 1.0
    r.updates["d0"].request.inside_clip = None          # a device that does not say: judged by its norm
    assert c.aggregator._summed(r, ["d0", "d1"], start, 0.1)[2] == float(update_norm(clipped, start) <= 0.1)
