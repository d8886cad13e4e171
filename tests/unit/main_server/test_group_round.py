"""The Main Server's round state machine, driven directly on an asyncio loop (no HTTP).

Join barrier (answered when every participant joined or at the join deadline), the per-step group
barrier (released when every member still owing the step has sent it, or at the step deadline,
which drops the late ones), the upload callback when a group finishes, and abandonment when a
newer plan replaces the round. Plans, joins and steps come from the ``kit`` fixture (conftest.py).
"""
from __future__ import annotations

import asyncio
import builtins
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from main_server.group_trainer import GroupMember
from main_server.group_round import GroupRound
from main_server.join_phase import JoinPhase
from shared.algorithms.grouping import GroupCandidate, grouping_rng
from shared.algorithms.label_balance import balanced_groups
from shared.algorithms.registry import GROUPINGS, build_grouping
from shared.errors import Conflict, Failed, Invalid, NotFound
from shared.models import build_model
from shared.schemas import JoinRequest, Participant

# ------------------------------------------------------------------------------------------- plan
def test_a_plan_naming_an_import_path_other_than_the_operators_is_refused_before_any_import(kit, tmp_path, monkeypatch):
    # The module records that it was imported: it must not be unless the operator named it.
    (tmp_path / "planted.py").write_text("import builtins\nbuiltins.PLANTED_IMPORTED = True\ndef net(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "planted", raising=False)

    async def body() -> None:
        for model_ref in (None, "my_pkg.nets:build"):
            with pytest.raises(Invalid, match="start this process with --model planted:net"):
                GroupRound(kit.make_plan(["a"], model="planted:net"), kit.Uploads(), model_ref=model_ref)
        assert not hasattr(builtins, "PLANTED_IMPORTED")
        # The operator's own --model is imported and built (and here found not to be a usable model).
        with pytest.raises(Invalid, match="model 'planted:net': returned NoneType"):
            GroupRound(kit.make_plan(["a"], model="planted:net"), kit.Uploads(), model_ref="planted:net")
        assert builtins.PLANTED_IMPORTED

    try:
        kit.run(body)
    finally:
        vars(builtins).pop("PLANTED_IMPORTED", None)
        sys.modules.pop("planted", None)


def test_bad_plans_are_invalid(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        for bad in (kit.make_plan(["a"], grouping="psychic"), kit.make_plan(["a"], group_loss="sum"),
                    kit.make_plan(["a"], model="no-such-model")):
            with pytest.raises(Invalid):
                GroupRound(bad, uploads)
        with pytest.raises(Invalid, match="split point 4"):
            GroupRound(kit.make_plan(["a"], participants=[Participant(device_id="a", split_point=4, num_samples=1)]), uploads)
    kit.run(body)


# ------------------------------------------------------------------------------------ join barrier
def test_join_waits_for_every_participant(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b"]), kit.Uploads())
        first = asyncio.create_task(state.join(kit.join_req("a", [5] + [0] * 9)))
        assert await kit.pending(first)           # the barrier holds a until b joins
        assert state.groups is None
        second = await state.join(kit.join_req("b", [0] + [5] * 9))
        answer = await first
        assert answer == second
        assert answer.members == ["a", "b"] and answer.group_id == 0
        assert answer.label_distance == pytest.approx(state.groups[0].distance)
        # Joining again once grouped answers the same group (a retried request).
        assert await state.join(kit.join_req("a")) == answer
    kit.run(body)


def test_bad_joins_change_nothing(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b"]), kit.Uploads())
        with pytest.raises(NotFound, match="stranger"):
            await state.join(kit.join_req("stranger"))
        with pytest.raises(Invalid, match="label_counts"):
            await state.join(JoinRequest(device_id="a", label_counts=[1, 2], num_steps=1))
        assert state.joins.joined == {} and state.groups is None
    kit.run(body)


def test_join_deadline_groups_who_came_and_refuses_latecomers(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b", "c"], grouping="singleton", join_s=kit.FAST), kit.Uploads())
        answers = await kit.joined(state, "a", "b")  # answered only at the deadline: c never joined
        assert [r.members for r in answers] == [["a"], ["b"]]
        assert set(state.group_by_device) == {"a", "b"}
        with pytest.raises(Conflict, match="after the join deadline"):
            await state.join(kit.join_req("c"))
        assert state.summary()["joined"] == 2
    kit.run(body)


def test_a_participant_past_its_own_join_deadline_is_absent_long_before_the_join_deadline(kit):
    async def body() -> None:
        # The plan's join deadline is never reached: only c's own deadline can form the groups.
        participants = [Participant(device_id=d, split_point=1, num_samples=10, download_s=0.01) for d in "abc"]
        plan = kit.make_plan(["a", "b", "c"], grouping="singleton", join_s=kit.SLOW, patience=2.0,
                             patience_grace_s=kit.FAST, participants=participants)
        state = GroupRound(plan, kit.Uploads())
        started = asyncio.get_running_loop().time()
        answers = await asyncio.wait_for(kit.joined(state, "a", "b"), 10)
        assert [r.members for r in answers] == [["a"], ["b"]] and set(state.group_by_device) == {"a", "b"}
        # due: 2 x the slowest join or its download (a few ms) + 0.2 s of grace, from the plan's arrival
        assert asyncio.get_running_loop().time() - started < 5
        assert state.joins.missing() == ["c"]
        with pytest.raises(Conflict, match="after the join deadline"):
            await state.join(kit.join_req("c"))
    kit.run(body)


def test_an_own_join_deadline_waits_for_the_portion_download_and_only_once_half_joined(kit):
    async def body() -> None:
        participants = [Participant(device_id=d, split_point=1, num_samples=10, download_s=s)
                        for d, s in (("a", 0.0), ("b", 0.0), ("c", 3.0), ("d", 0.0), ("e", None))]
        plan = kit.make_plan(["a", "b", "c", "d", "e"], grouping="singleton", participants=participants,
                             patience=2.0, patience_grace_s=0.5)
        state = GroupRound(plan, kit.Uploads())
        first = asyncio.create_task(state.join(kit.join_req("a")))
        assert await kit.pending(first)
        assert state.joins.due() is None                 # 1 of 5: the wait may be slow for everyone
        second = asyncio.create_task(state.join(kit.join_req("b")))
        third = asyncio.create_task(state.join(kit.join_req("d")))
        assert await kit.pending(second) and await kit.pending(third)
        assert state.joins.due() is None                 # e's download time is not known: no own deadline
        state.depart({"e": "withdrew"})
        due = state.joins.due()
        assert due is not None
        # c's download (3 s) is longer than its peers' joins (milliseconds)
        assert due - state.joins.opened == pytest.approx(2.0 * 3.0 + 0.5)
        await state.join(kit.join_req("c"))               # in time: grouped with the others
        assert sorted(state.group_by_device) == ["a", "b", "c", "d"]
        await asyncio.gather(first, second, third)
    kit.run(body)


@pytest.mark.parametrize("ignore_slowest", [0, 1])
def test_a_late_join_left_out_does_not_lengthen_another_s_join_deadline(kit, ignore_slowest):
    async def body() -> None:
        # Eight participants join at once; "late" joins 0.5 s after the plan (slow on purpose);
        # "missing" has not joined. Its deadline counts "late"'s join only when nothing is left out.
        devices = [f"h{i}" for i in range(8)] + ["late", "missing"]
        participants = [Participant(device_id=d, split_point=1, num_samples=10, download_s=0.01) for d in devices]
        plan = kit.make_plan(devices, grouping="singleton", participants=participants, patience=2.0,
                             patience_grace_s=0.1, ignore_slowest=ignore_slowest)
        phase = JoinPhase(plan, on_close=lambda: None)
        for device in devices[:8]:
            phase.join(kit.join_req(device))
        await asyncio.sleep(0.5)
        phase.join(kit.join_req("late"))
        due = phase.due()
        phase.cancel()
        assert due is not None
        if ignore_slowest:
            assert due - phase.opened < 0.3         # 2 x the honest joins (milliseconds) + 0.1 s
        else:
            assert due - phase.opened >= 2 * 0.5    # 2 x the late join
    kit.run(body)


def test_without_patience_only_the_join_deadline_releases_a_missing_participant(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b", "c"], grouping="singleton"), kit.Uploads())
        joins = asyncio.gather(state.join(kit.join_req("a")), state.join(kit.join_req("b")))
        await asyncio.sleep(0.5)
        assert state.groups is None and state.joins.due() is None
        state.depart({"c": "withdrew"})
        assert [r.members for r in await joins] == [["a"], ["b"]]
    kit.run(body)


def test_a_participant_that_left_at_the_fed_server_is_not_waited_for_at_the_join(kit):
    async def body() -> None:
        # The join deadline is long: only the departure can release a here.
        state = GroupRound(kit.make_plan(["a", "b", "c"], grouping="singleton", join_s=600), kit.Uploads())
        first = asyncio.create_task(state.join(kit.join_req("a")))
        assert await kit.pending(first)
        state.depart({"b": "withdrew: its task named an unknown algorithm"})
        assert await kit.pending(first)          # c has neither joined nor left
        joined_c = asyncio.create_task(state.join(kit.join_req("c")))
        state.depart({"c": "upload refused: bad"})   # c joined, then left before the groups formed
        answer = await asyncio.wait_for(first, 5)
        assert answer.members == ["a"] and set(state.group_by_device) == {"a"}
        with pytest.raises(Conflict, match="left round 1: upload refused: bad"):
            await joined_c
        with pytest.raises(Conflict, match="left round 1: withdrew: its task named an unknown algorithm"):
            await state.join(kit.join_req("b"))
        with pytest.raises(NotFound, match="stranger"):
            state.depart({"stranger": "x"})
        assert set(state.joins.departed) == {"b", "c"}
    kit.run(body)


def test_a_member_that_left_at_the_fed_server_releases_its_group_s_barrier(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b", "c"], group_size=3, step_s=600), uploads)
        await kit.joined(state, "a", "b", "c")
        group = state.groups[0]
        assert group.members == ["a", "b", "c"]
        waiting_b = asyncio.create_task(state.step(kit.step_req("b", 0, *kit.batch(11))))
        waiting_a = asyncio.create_task(state.step(kit.step_req("a", 0, *kit.batch(10))))
        assert await kit.pending(waiting_a)      # c owes the step
        state.depart({"b": "withdrew: lost its data", "c": "upload refused: bad"})
        out = await asyncio.wait_for(waiting_a, 5)   # a trains alone: nobody else owes the step
        assert math.isfinite(out.result.loss) and group.trainer.steps == 1
        with pytest.raises(Conflict, match="left round 1: withdrew: lost its data"):
            await waiting_b
        assert group.dropped == {"b", "c"}
        assert state.dropped == {"b": "taken out by the Fed Server: withdrew: lost its data",
                                 "c": "taken out by the Fed Server: upload refused: bad"}
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group] and group.done == {"a"}
    kit.run(body)


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
def test_groups_come_from_the_plans_plug_in(grouping, kit):
    async def body() -> None:
        devices = [f"d{i}" for i in range(6)]
        # All the Fed Server knows of each device, in the plan: its time table row (the later
        # ids the faster), kind and measured link rate.
        said = [Participant(device_id=d, split_point=1, num_samples=10, kind=("low", "high")[i % 2],
                            round_times=[(1, 10.0 - i)], link_rate=1e6 * (i + 1)) for i, d in enumerate(devices)]
        state = GroupRound(kit.make_plan(devices, grouping=grouping, group_size=3, round_id=7, participants=said),
                           kit.Uploads())
        counts = {d: [1 + i if c == i % kit.CLASSES else 0 for c in range(kit.CLASSES)] for i, d in enumerate(devices)}
        await asyncio.gather(*(state.join(kit.join_req(d, counts[d])) for d in devices))
        groups = [g.members for g in state.groups]
        # Each device as the plan and its join (label counts) give it; the round's generator from
        # the plan's seed 0 and round 7.
        candidates = {d: GroupCandidate(np.asarray(counts[d]), 1, 10, ("low", "high")[i % 2], {1: 10.0 - i},
                                        1e6 * (i + 1)) for i, d in enumerate(devices)}
        assert groups == build_grouping(grouping).form(candidates, 3, grouping_rng(0, 7))
        if grouping == "singleton":
            assert groups == [[d] for d in devices]
        elif grouping == "balanced":
            assert groups == balanced_groups({d: np.asarray(counts[d]) for d in devices}, 3)
        elif grouping == "speed":   # by the plan's times, fastest first
            assert groups == [["d5", "d4", "d3"], ["d2", "d1", "d0"]]
        assert sorted(m for g in groups for m in g) == devices
        assert [g.group_id for g in state.groups] == list(range(len(groups)))
    kit.run(body)


# ------------------------------------------------------------------------------------ step barrier
def test_step_barrier_trains_once_for_the_whole_group(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b"]), uploads)
        await kit.joined(state, "a", "b")
        group = state.groups[0]
        reference = build_model("logreg", kit.CLASSES, (1, 1, kit.FEATURES), seed=0).blocks["head"]
        (xa, ya), (xb, yb) = kit.batch(1), kit.batch(2)
        first = asyncio.create_task(state.step(kit.step_req("a", 0, xa, ya)))
        assert await kit.pending(first)           # a waits at the barrier for b
        assert group.step == 0 and set(group.pending) == {"a"}
        second = await state.step(kit.step_req("b", 0, xb, yb))
        out_a = await first
        # Each member gets the gradient of its own mean loss w.r.t. its activations (per_member).
        for x, y, out in ((xa, ya, out_a), (xb, yb, second)):
            fx = x.clone().requires_grad_(True)
            loss = F.cross_entropy(reference(fx), y)
            loss.backward()
            torch.testing.assert_close(out.result.dfx, fx.grad)
            assert out.result.loss == pytest.approx(float(loss.detach()))
        assert group.trainer.steps == 1 and group.step == 1
        assert group.done == {"a", "b"} and group.finished
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group]
    kit.run(body)


def test_a_round_holds_no_model_of_its_own_and_lets_the_plans_weights_go_once_its_groups_have_them(kit):
    # The template is structure only (the meta device), the round keeps the plan without its
    # weights, and once every group has loaded them into its copy the decoded weights (views of
    # the plan's bytes) go too: a round used to hold the template's initial weights, the plan's
    # bytes and every group's copy until the next plan replaced it.
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b"]), kit.Uploads())
        assert all(t.is_meta for t in state.template.state_dict().values())
        assert state.plan.server_weights == {} and state.server_weights
        await kit.joined(state, "a", "b")
        assert state.server_weights == {}
        copy_ = state.groups[0].trainer
        assert not any(p.is_meta for p in copy_.portion.parameters())
    kit.run(body)


def test_steps_that_are_not_a_members_next_one_are_refused_and_drop_nobody(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b", "c"], grouping="singleton", join_s=kit.FAST), kit.Uploads())
        await kit.joined(state, "a", "b")
        x, y = kit.batch(3)
        with pytest.raises(NotFound):
            await state.step(kit.step_req("stranger", 0, x, y))
        with pytest.raises(Conflict, match="has not joined"):
            await state.step(kit.step_req("c", 0, x, y))
        # Out of order, whatever its content: not read, so not held against the sender.
        with pytest.raises(Conflict, match="out of order"):
            await state.step(kit.step_req("a", 1, x, y))
        with pytest.raises(Conflict, match="out of order"):
            await state.step(kit.step_req("a", 1, x * 1e30, y[:-1]))
        assert all(g.step == 0 and not g.pending and g.trainer.steps == 0 and not g.dropped for g in state.groups)
        assert state.dropped == {}
    kit.run(body)


def _nan_bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Zeros but for one element holding a NaN bit pattern with a payload (not torch's own NaN)."""
    bits = {torch.float32: (torch.int32, 0x7FC00123), torch.float16: (torch.int16, 0x7E01)}
    int_dtype, pattern = bits[dtype]
    raw = torch.zeros(shape, dtype=int_dtype)
    raw.view(-1)[5] = pattern
    return raw.view(dtype)


def _harmful_step(kit, harm: str, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Member b's step of one kind of harm: harmful values, or a step that does not fit the group's batch."""
    if harm == "x1e30":
        return x * 1e30, y
    if harm == "labels":
        return x, torch.full_like(y, kit.CLASSES)
    if harm.startswith("nan-"):
        return _nan_bits(getattr(torch, harm.split("-")[1]), tuple(x.shape)), y
    if harm == "inf-float16":
        x = torch.zeros_like(x, dtype=torch.float16)
        x[1, 2] = -math.inf
        return x, y
    misfits = {
        "fx-float64": (x.to(torch.float64), y),
        "fx-features": (torch.zeros(x.shape[0], x.shape[1] + 1), y),
        "fx-batch-too-large": (torch.zeros(kit.BATCH + 1, x.shape[1]), torch.zeros(kit.BATCH + 1, dtype=torch.int64)),
        "labels-shape": (x, y[:-1]),
        "labels-int32": (x, y.to(torch.int32)),
    }
    return misfits[harm]


@pytest.mark.parametrize("harm, word", [
    ("x1e30", "beyond the bound 10000"), ("nan-float32", "NaN"), ("nan-float16", "NaN"), ("inf-float16", "Inf"),
    ("labels", "labels: values"),
    # Steps that do not fit the group's batch: left in the group, the member would hold every
    # other member's step until the step deadline.
    ("fx-float64", "fx: dtype float64"), ("fx-features", "fx: shape"), ("fx-batch-too-large", "fx: shape"),
    ("labels-shape", "labels: shape"), ("labels-int32", "labels: dtype int32"),
])
def test_a_member_whose_step_is_harmful_or_does_not_fit_is_dropped_and_the_others_train_without_it(kit, harm, word):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b", "c"], group_size=3), uploads)
        await asyncio.gather(*(state.join(kit.join_req(d, num_steps=2)) for d in ("a", "b", "c")))
        group = state.groups[0]
        (xa, ya), (xc, yc) = kit.batch(1), kit.batch(3)
        xb, yb = _harmful_step(kit, harm, *kit.batch(2))
        a = asyncio.create_task(state.step(kit.step_req("a", 0, xa, ya)))
        c = asyncio.create_task(state.step(kit.step_req("c", 0, xc, yc)))
        assert await kit.pending(a) and await kit.pending(c)   # both wait for b
        with pytest.raises(Invalid, match=word) as refused:
            await state.step(kit.step_req("b", 0, xb, yb))
        assert "dropped" in str(refused.value)
        # b no longer holds the barrier: a and c are answered at once, each with the gradient of
        # its own loss on the copy as it was (per_member): b's values never joined the batch.
        reference = build_model("logreg", kit.CLASSES, (1, 1, kit.FEATURES), seed=0).blocks["head"]
        for x, y, task in ((xa, ya, a), (xc, yc, c)):
            out = await task
            fx = x.clone().requires_grad_(True)
            F.cross_entropy(reference(fx), y).backward()
            torch.testing.assert_close(out.result.dfx, fx.grad)
        assert group.dropped == {"b"} and word in state.dropped["b"] and group.trainer.steps == 1
        assert all(torch.isfinite(v).all() for v in group.trainer.state().values())
        with pytest.raises(Conflict, match=f"dropped from round 1: step 0 refused: .*{word}"):
            await state.step(kit.step_req("b", 1, *kit.batch(4)))
        await asyncio.gather(state.step(kit.step_req("a", 1, *kit.batch(5))), state.step(kit.step_req("c", 1, *kit.batch(6))))
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group] and group.done == {"a", "c"}
    kit.run(body)


def test_a_harmful_last_member_releases_the_barrier_and_a_group_of_one_finishes(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a"]), uploads)
        await kit.joined(state, "a")
        x, y = kit.batch(1)
        with pytest.raises(Invalid, match="beyond the bound"):
            await state.step(kit.step_req("a", 0, x * 1e30, y))
        await asyncio.wait_for(uploads.arrived.wait(), 5)   # nobody is left: the group uploads
        group = state.groups[0]
        assert group.finished and group.dropped == {"a"} and group.trainer.steps == 0
    kit.run(body)


def test_a_member_whose_own_results_are_not_finite_is_dropped_and_the_step_trains_without_it(kit, monkeypatch):
    """The last line of defence, past the value checks (here switched off): b's NaN activations
    make its loss, its dfx and the copy's gradient NaN; the step is not applied, b is dropped
    (422), and the step trains again on a alone, whose dfx is then exactly its solo gradient."""
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b"]), kit.Uploads())
        monkeypatch.setattr(state.checks, "harmful_values", lambda batch: None)
        await kit.joined(state, "a", "b")
        group = state.groups[0]
        before = {k: v.clone() for k, v in group.trainer.state().items()}
        (xa, ya), (xb, yb) = kit.batch(1), kit.batch(2)
        xb[0, 0] = math.nan
        a = asyncio.create_task(state.step(kit.step_req("a", 0, xa, ya)))
        with pytest.raises(Invalid, match="not finite") as refused:
            await state.step(kit.step_req("b", 0, xb, yb))
        assert "dropped" in str(refused.value)
        out = await a
        reference = build_model("logreg", kit.CLASSES, (1, 1, kit.FEATURES), seed=0).blocks["head"]
        fx = xa.clone().requires_grad_(True)
        F.cross_entropy(reference(fx), ya).backward()
        torch.testing.assert_close(out.result.dfx, fx.grad)
        for name, p in reference.named_parameters():   # one step, on a's loss alone
            torch.testing.assert_close(group.trainer.state()[f"blocks.head.{name}"], before[f"blocks.head.{name}"] - kit.LR * p.grad)
        assert group.dropped == {"b"} and "not finite" in state.dropped["b"] and group.trainer.steps == 1
    kit.run(body)


def test_duplicate_step_is_a_conflict(kit):
    async def body() -> None:
        state = GroupRound(kit.make_plan(["a", "b"]), kit.Uploads())
        await kit.joined(state, "a", "b")
        x, y = kit.batch(4)
        waiting = asyncio.create_task(state.step(kit.step_req("a", 0, x, y)))
        assert await kit.pending(waiting)
        with pytest.raises(Conflict, match="already received"):
            await state.step(kit.step_req("a", 0, x, y))
        await state.step(kit.step_req("b", 0, *kit.batch(5)))
        await waiting
        with pytest.raises(Conflict, match="already sent all"):
            await state.step(kit.step_req("a", 1, x, y))
    kit.run(body)


def test_members_with_fewer_steps_leave_the_barrier(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b"]), uploads)
        await asyncio.gather(state.join(kit.join_req("a", num_steps=1)), state.join(kit.join_req("b", num_steps=3)))
        group = state.groups[0]
        await asyncio.gather(state.step(kit.step_req("a", 0, *kit.batch(6))), state.step(kit.step_req("b", 0, *kit.batch(7))))
        assert group.done == {"a"} and group.expected() == {"b"}
        # b alone now releases the barrier at once: a owes nothing more.
        for step in (1, 2):
            await state.step(kit.step_req("b", step, *kit.batch(7 + step)))
        assert group.trainer.steps == 3 and group.done == {"a", "b"} and group.finished
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group]
    kit.run(body)


def test_a_group_trainer_knows_its_members_data_sizes_and_cuts_from_the_plan(kit):
    """What the group-loss plug-in weighs members by (``data_weighted``): the plan's data sizes
    (the Fed Server's, which Algorithm 1 weighs by; not the label counts a device joins with) and
    cuts, so the surplus steps of the larger member move the copy by its share only."""
    async def body() -> None:
        participants = [Participant(device_id="a", split_point=1, num_samples=10),
                        Participant(device_id="b", split_point=1, num_samples=30)]
        plan = kit.make_plan(["a", "b"], group_loss="data_weighted", participants=participants)
        state = GroupRound(plan, kit.Uploads())
        await asyncio.gather(state.join(kit.join_req("a", num_steps=1)), state.join(kit.join_req("b", num_steps=2)))
        group = state.groups[0]
        assert group.trainer.members == {"a": GroupMember(10, 1), "b": GroupMember(30, 1)}
        await asyncio.gather(state.step(kit.step_req("a", 0, *kit.batch(1))), state.step(kit.step_req("b", 0, *kit.batch(2))))
        head = group.trainer.portion
        before = {k: v.detach().clone() for k, v in head.state_dict().items()}
        x, y = kit.batch(3)
        reference = build_model("logreg", kit.CLASSES, (1, 1, kit.FEATURES), seed=0).blocks["head"]
        reference.load_state_dict({k.removeprefix("blocks.head."): v for k, v in before.items()})
        fx = x.clone().requires_grad_(True)
        F.cross_entropy(reference(fx), y).backward()
        out = await state.step(kit.step_req("b", 1, x, y))
        torch.testing.assert_close(out.result.dfx, fx.grad)     # b's own mean loss, as always
        for name, p in reference.named_parameters():             # the copy moved by b's share, 3/4
            torch.testing.assert_close(head.state_dict()[f"blocks.head.{name}"], before[f"blocks.head.{name}"] - 0.75 * kit.LR * p.grad)
    kit.run(body)


# ---------------------------------------------------------------------------------------- deadlines
def test_step_deadline_drops_the_late_and_releases_the_rest(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b"], step_s=kit.FAST), uploads)
        await asyncio.gather(state.join(kit.join_req("a", num_steps=2)), state.join(kit.join_req("b", num_steps=2)))
        group = state.groups[0]
        out = await state.step(kit.step_req("a", 0, *kit.batch(10)))  # b never sends: answered at the deadline
        assert out.wait_s > 0 and group.dropped == {"b"} and group.trainer.steps == 1
        with pytest.raises(Conflict, match=r"dropped from round 1: missed the deadline of step 0 \(0.2 s\)"):
            await state.step(kit.step_req("b", 0, *kit.batch(11)))
        await state.step(kit.step_req("a", 1, *kit.batch(12)))
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group] and group.done == {"a"} and group.dropped == {"b"}
    kit.run(body)


def test_a_group_nobody_steps_in_finishes_with_everyone_dropped(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b"], step_s=kit.FAST), uploads)
        await kit.joined(state, "a", "b")
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        group = state.groups[0]
        assert group.finished and group.dropped == {"a", "b"} and group.trainer.steps == 0
    kit.run(body)


def test_a_failed_step_drops_its_members_and_the_group_finishes_and_uploads(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        state = GroupRound(kit.make_plan(["a", "b"]), uploads)
        await kit.joined(state, "a", "b")

        def broken(batches):
            raise RuntimeError("boom")

        state.groups[0].trainer.step = broken
        results = await asyncio.gather(state.step(kit.step_req("a", 0, *kit.batch(13))),
                                       state.step(kit.step_req("b", 0, *kit.batch(14))), return_exceptions=True)
        assert all(isinstance(r, Failed) and "boom" in str(r) for r in results)
        group = state.groups[0]
        assert not group.running
        # The group does not hang until the round deadline: both are out, and it uploads at once.
        await asyncio.wait_for(uploads.arrived.wait(), 5)
        assert uploads.groups == [group] and group.finished and group.dropped == {"a", "b"}
        assert all("training of step 0 failed: boom" in state.dropped[d] for d in ("a", "b"))
        with pytest.raises(Conflict, match="dropped from round 1: server-side training of step 0 failed"):
            await state.step(kit.step_req("a", 1, *kit.batch(15)))
    kit.run(body)


# --------------------------------------------------------------------------------------- abandonment
def test_abandon_releases_joins_and_steps_and_uploads_nothing(kit):
    async def body() -> None:
        uploads = kit.Uploads()
        waiting_join = GroupRound(kit.make_plan(["a", "b"]), uploads)
        join = asyncio.create_task(waiting_join.join(kit.join_req("a")))
        assert await kit.pending(join)
        waiting_join.abandon()
        with pytest.raises(Conflict, match="abandoned"):
            await join
        assert waiting_join.groups is None

        state = GroupRound(kit.make_plan(["a", "b"], step_s=kit.FAST), uploads)
        await kit.joined(state, "a", "b")
        step = asyncio.create_task(state.step(kit.step_req("a", 0, *kit.batch(15))))
        assert await kit.pending(step)
        state.abandon()
        with pytest.raises(Conflict, match="replaced by a newer round"):
            await step
        await asyncio.sleep(2 * kit.FAST)  # past the step deadline: a dead round's timers stay quiet
        assert state.groups[0].trainer.steps == 0 and state.groups[0].dropped == set()
        assert uploads.groups == []
    kit.run(body)


# ------------------------------------------------------------------------ planned groups (replicas)
def test_planned_groups_keep_their_ids_and_members_and_a_member_who_never_joins_is_absent(kit):
    from shared.schemas import PlannedGroup

    async def body() -> None:
        uploads = kit.Uploads()
        # Round-wide ids from the Fed Server (this replica holds groups 3 and 5), not 0..n-1, and
        # members other than balanced grouping would choose here.
        planned = [PlannedGroup(group_id=5, members=["a", "d"]), PlannedGroup(group_id=3, members=["b", "c"])]
        state = GroupRound(kit.make_plan(["a", "b", "c", "d"], join_s=kit.FAST, groups=planned), uploads)
        answers = await asyncio.gather(*(state.join(kit.join_req(d)) for d in ("a", "b", "d")))
        assert [(a.group_id, a.members) for a in answers] == [(5, ["a", "d"]), (3, ["b"]), (5, ["a", "d"])]
        assert sorted(state.participants) == ["a", "b", "c", "d"] and "c" not in state.joins.joined
        assert not state.closed.is_set()
        for d, seed in (("a", 1), ("d", 2), ("b", 3)):
            step = asyncio.create_task(state.step(kit.step_req(d, 0, *kit.batch(seed))))
            if d == "a":
                assert await kit.pending(step)   # a waits for d at group 5's barrier
        await asyncio.wait_for(state.closed.wait(), 5)   # both groups uploaded: the watch's "done"
        assert sorted(g.group_id for g in uploads.groups) == [3, 5]
    kit.run(body)


def test_a_plan_whose_groups_do_not_cover_its_participants_is_refused(kit):
    from pydantic import ValidationError

    from shared.schemas import PlannedGroup
    for groups in ([PlannedGroup(group_id=0, members=["a"])],
                   [PlannedGroup(group_id=0, members=["a", "b"]), PlannedGroup(group_id=1, members=["b"])],
                   [PlannedGroup(group_id=0, members=["a"]), PlannedGroup(group_id=0, members=["b"])]):
        with pytest.raises(ValidationError, match="planned group"):
            kit.make_plan(["a", "b"], groups=groups)


def test_the_watch_stream_beats_until_every_group_uploaded_or_the_round_is_replaced(kit):
    from main_server.server import MainServer, MainServerSettings

    async def never_sent(upload) -> int:
        raise AssertionError("no group of this round finishes")

    async def body() -> None:
        server = MainServer(MainServerSettings(fed_server_url="http://unused"), never_sent)
        server.open_round(kit.make_plan(["a"], round_id=1))
        lines: list[str] = []

        async def watch() -> None:
            async for line in server.watch(server.current(1), heartbeat_s=0.05):
                lines.append(line.state)
        watching = asyncio.create_task(watch())
        while lines.count("open") < 2:   # heartbeats keep coming while the round is open
            await asyncio.sleep(0.01)
        server.open_round(kit.make_plan(["a"], round_id=2))   # a newer plan replaces round 1
        await asyncio.wait_for(watching, 5)
        assert lines[-1] == "replaced" and set(lines[:-1]) == {"open"}
    kit.run(body)


def test_the_watch_stream_reports_a_dropped_member_at_once_and_an_undelivered_group_on_done(kit):
    """A drop wakes the stream at once (the heartbeat here is longer than the test may run), and
    a group whose portion cannot reach the Fed Server (a closed port) is named on ``done``."""
    from main_server.portion_upload import FedServerPortions
    from main_server.server import MainServer, MainServerSettings
    from shared.auth import Auth
    from testbed.processes import free_port

    async def body() -> None:
        portions = FedServerPortions(f"http://127.0.0.1:{free_port()}", Auth(), None, retries=1)
        server = MainServer(MainServerSettings(fed_server_url="http://unused"), portions.send)
        server.open_round(kit.make_plan(["a", "b"], round_id=1))
        state = server.current(1)
        lines = server.watch(state, heartbeat_s=60.0)
        first = await anext(lines)
        assert (first.state, first.dropped, first.undelivered) == ("open", {}, [])
        await kit.joined(state, "a", "b")
        x, y = kit.batch(1)
        with pytest.raises(Invalid):
            await state.step(kit.step_req("b", 0, x * 1e30, y))
        dropped = await asyncio.wait_for(anext(lines), 5)
        assert dropped.state == "open" and list(dropped.dropped) == ["b"] and "beyond the bound" in dropped.dropped["b"]
        await state.step(kit.step_req("a", 0, x, y))   # a alone: the group finishes, its upload fails
        last = await asyncio.wait_for(anext(lines), 10)
        while last.state == "open":
            last = await asyncio.wait_for(anext(lines), 10)
        assert last.state == "done" and last.undelivered == [state.groups[0].group_id] and set(last.dropped) == {"b"}
        server.trainers.shutdown()
    kit.run(body)


def test_a_stopping_server_ends_its_watch_streams_at_once_without_their_last_line(kit):
    """A stream held with a long heartbeat ends as soon as the server starts to stop, not after
    the shutdown grace; with no ``done`` line the Fed Server takes the replica as gone."""
    from main_server.portion_upload import FedServerPortions
    from main_server.server import MainServer, MainServerSettings
    from shared.auth import Auth
    from testbed.processes import free_port

    async def body() -> None:
        portions = FedServerPortions(f"http://127.0.0.1:{free_port()}", Auth(), None, retries=1)
        server = MainServer(MainServerSettings(fed_server_url="http://unused"), portions.send)
        server.open_round(kit.make_plan(["a", "b"], round_id=1))
        lines = server.watch(server.current(1), heartbeat_s=60.0)
        assert (await anext(lines)).state == "open"
        waiting = asyncio.ensure_future(anext(lines))
        await asyncio.sleep(0.05)
        assert not waiting.done()   # held until the next heartbeat, a minute away
        server.stop_watching()
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(waiting, 5)
        server.trainers.shutdown()
    kit.run(body)


def test_ready_group_steps_train_one_at_a_time_and_the_queue_counts_as_wait(kit):
    """One training worker: a group whose step becomes ready while another group's step trains
    waits for it; that wait is the members' wait_s, and server_s is its own training alone."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    async def body() -> None:
        workers = ThreadPoolExecutor(1)
        state = GroupRound(kit.make_plan(["a", "b"], grouping="singleton"), kit.Uploads(), executor=workers)
        await kit.joined(state, "a", "b")
        release = threading.Event()
        spans: dict[str, tuple[float, float, str]] = {}   # member -> (start, end, thread) of its group's step
        for group in state.groups:
            step = group.trainer.step

            def traced(batches, step=step):
                start = time.monotonic()
                if batches[0].device_id == "a":
                    release.wait(10)   # a's step holds the worker until the test lets it go
                result = step(batches)
                spans[batches[0].device_id] = (start, time.monotonic(), threading.current_thread().name)
                return result
            group.trainer.step = traced
        a = asyncio.create_task(state.step(kit.step_req("a", 0, *kit.batch(1))))
        assert await kit.pending(a)
        with pytest.raises(Conflict, match="already received"):   # a's step is training: a resend is no next step
            await state.step(kit.step_req("a", 0, *kit.batch(1)))
        b = asyncio.create_task(state.step(kit.step_req("b", 0, *kit.batch(2))))
        assert await kit.pending(b) and state.group_by_device["b"].running   # b's step is queued behind a's
        b_arrived_by = time.monotonic()
        release.set()
        out_a, out_b = await a, await b
        answered = time.monotonic()
        workers.shutdown()
        a_end = spans["a"][1]
        assert spans["a"][2] == spans["b"][2]   # the one worker trained both
        assert spans["b"][0] >= a_end           # b's step began after a's ended
        assert out_b.wait_s >= a_end - b_arrived_by > 0          # b waited for a's step to end
        assert spans["b"][1] - spans["b"][0] <= out_b.server_s <= answered - a_end   # its own training only
        assert out_a.server_s >= a_end - b_arrived_by            # a's step held the worker until released
    kit.run(body)
