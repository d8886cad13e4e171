"""Unit tests for main_server.group_trainer: the group's server-side step against hand autograd.

The zoo CNN (blocks conv1, conv2, fc1, head; split points 1, 2, 3) has no BatchNorm, so members
of a concatenated batch are independent and every quantity can be checked against a reference
computed member by member on a deep copy of the model.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from main_server.group_trainer import GroupMember, GroupTrainer, MemberBatch, NonFiniteStep
from shared.algorithms.registry import build_group_loss
from shared.models import build_model
from shared.wire import decode_state

LR = 0.1
ATOL = 1e-6
RTOL = 1e-4


@pytest.fixture(scope="module")
def model():
    m = build_model("cnn", seed=0)
    assert m.block_names() == ["conv1", "conv2", "fc1", "head"]
    assert m.split_points == (1, 2, 3)
    return m


def _data(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *model.input_shape, generator=gen)
    y = torch.randint(0, model.num_classes, (n,), generator=gen)
    return x, y


def _member(model, device_id: str, split: int, n: int, seed: int) -> MemberBatch:
    x, y = _data(model, n, seed)
    with torch.no_grad():
        fx = model.forward_blocks(x, 0, split)
    return MemberBatch(device_id=device_id, split_point=split, fx=fx.clone(), labels=y)


def _trainer(model, start: int, group_loss: str = "per_member", lr: float = LR,
             members: dict[str, GroupMember] | None = None) -> GroupTrainer:
    """A trainer of ``blocks[start:]`` with the group-loss plug-in registered as ``group_loss``."""
    m = copy.deepcopy(model)
    weights = {k: v.clone() for k, v in m.portion(start, len(m.blocks)).state_dict().items()}
    return GroupTrainer(m, start, weights, lr=lr, group_loss=build_group_loss(group_loss), members=members)


def _server_params(model, start: int) -> dict[str, torch.Tensor]:
    return dict(model.portion(start, len(model.blocks)).named_parameters())


def _solo_grads(model, b: MemberBatch, start: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Gradient of one member's own mean CE w.r.t. its activation and the server portion ``blocks[start:]``."""
    ref = copy.deepcopy(model)
    params = _server_params(ref, start)
    fx = b.fx.detach().clone().float().requires_grad_(True)
    loss = F.cross_entropy(ref.forward_blocks(fx, b.split_point, len(ref.blocks)), b.labels)
    grads = torch.autograd.grad(loss, [fx, *params.values()], allow_unused=True)
    pgrads = {k: (g if g is not None else torch.zeros_like(params[k])) for k, g in zip(params, grads[1:])}
    return grads[0], pgrads, float(loss.detach())


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


def _stepped(model, start: int, update: dict[str, torch.Tensor]):
    """A copy of ``model`` whose server portion took one hand SGD step: ``p -= LR * update[k]``."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in _server_params(ref, start).items():
            p -= LR * update[k]
    return ref


def _assert_portion(trainer: GroupTrainer, expected, start: int) -> None:
    """The trainer's server portion equals ``expected``'s (a model)."""
    for k, p in _server_params(expected, start).items():
        _assert_close(_server_params(trainer.model, start)[k].detach(), p.detach())


# ------------------------------------------------------------------------------------ one member
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("group_loss", ["per_member", "per_member_sum", "union_mean"])
def test_one_member_matches_hand_autograd(model, split, group_loss):
    b = _member(model, "d0", split, 6, seed=split)
    dfx_ref, pgrads, loss_ref = _solo_grads(model, b, split)
    before = {k: v.detach().clone() for k, v in _server_params(model, split).items()}

    trainer = _trainer(model, split, group_loss)
    out = trainer.step([b])

    assert set(out) == {"d0"}
    assert out["d0"].dfx.shape == b.fx.shape and out["d0"].dfx.dtype == b.fx.dtype
    _assert_close(out["d0"].dfx, dfx_ref)
    assert out["d0"].loss == pytest.approx(loss_ref, rel=1e-5)
    after = _server_params(trainer.model, split)
    for k in before:
        _assert_close(after[k].detach(), before[k] - LR * pgrads[k])
    assert trainer.steps == 1


def test_one_member_both_modes_agree(model):
    b = _member(model, "d0", 2, 5, seed=11)
    a = _trainer(model, 2, "per_member")
    u = _trainer(model, 2, "union_mean")
    ra, ru = a.step([b]), u.step([b])
    _assert_close(ra["d0"].dfx, ru["d0"].dfx)
    for k, v in a.state().items():
        _assert_close(v, u.state()[k])


def test_server_portion_starting_before_member_split(model):
    """A group portion from block 1 serving a member cut at 2 leaves conv2 untouched."""
    b = _member(model, "d0", 2, 4, seed=5)
    dfx_ref, pgrads, _ = _solo_grads(model, b, 2)
    trainer = _trainer(model, 1)
    conv2_before = {k: v.clone() for k, v in trainer.model.blocks["conv2"].state_dict().items()}
    out = trainer.step([b])
    _assert_close(out["d0"].dfx, dfx_ref)
    for k, v in trainer.model.blocks["conv2"].state_dict().items():
        assert torch.equal(v, conv2_before[k])
    after = _server_params(trainer.model, 2)
    for k, p in _server_params(model, 2).items():
        _assert_close(after[k].detach(), p.detach() - LR * pgrads[k])


def test_state_has_server_portion_keys(model):
    trainer = _trainer(model, 2)
    assert list(trainer.state()) == model.portion_keys(2, len(model.blocks))


def test_wire_state_is_the_state_encoded_and_a_snapshot(model):
    trainer = _trainer(model, 2)
    wire = trainer.wire_state()
    state = trainer.state()
    decoded = decode_state(wire)
    assert list(decoded) == list(state)
    for k, v in state.items():
        assert torch.equal(decoded[k], v)
    with torch.no_grad():   # the trainer's later updates do not reach what was encoded
        for p in trainer.portion.parameters():
            p.add_(1.0)
    for k, v in decode_state(wire).items():
        assert torch.equal(v, state[k])


# ------------------------------------------------------------------------------------ same split
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("group_loss, server_divisor", [("per_member", 2), ("per_member_sum", 1)])
def test_two_members_same_split_per_member(model, split, group_loss, server_divisor):
    b1 = _member(model, "a", split, 4, seed=21)
    b2 = _member(model, "b", split, 7, seed=22)
    g1, p1, l1 = _solo_grads(model, b1, split)
    g2, p2, l2 = _solo_grads(model, b2, split)
    before = {k: v.detach().clone() for k, v in _server_params(model, split).items()}

    trainer = _trainer(model, split, group_loss)
    out = trainer.step([b1, b2])

    _assert_close(out["a"].dfx, g1)
    _assert_close(out["b"].dfx, g2)
    assert out["a"].loss == pytest.approx(l1, rel=1e-5)
    assert out["b"].loss == pytest.approx(l2, rel=1e-5)
    # the copy steps on the mean (per_member) or the sum (per_member_sum) of the members' gradients
    after = _server_params(trainer.model, split)
    for k in before:
        _assert_close(after[k].detach(), before[k] - LR * (p1[k] + p2[k]) / server_divisor)


def test_two_members_same_split_union_mean(model):
    split = 2
    b1 = _member(model, "a", split, 3, seed=31)
    b2 = _member(model, "b", split, 9, seed=32)
    per = _trainer(model, split, "per_member").step([b1, b2])
    union_trainer = _trainer(model, split, "union_mean")
    union = union_trainer.step([b1, b2])
    total = 3 + 9
    _assert_close(union["a"].dfx, per["a"].dfx * (3 / total))
    _assert_close(union["b"].dfx, per["b"].dfx * (9 / total))
    # member losses are still each member's own mean loss
    assert union["a"].loss == pytest.approx(per["a"].loss, rel=1e-6)
    # the union copy steps on the sample-weighted mean gradient
    _, p1, _ = _solo_grads(model, b1, split)
    _, p2, _ = _solo_grads(model, b2, split)
    after = _server_params(union_trainer.model, split)
    for k, p in _server_params(model, split).items():
        _assert_close(after[k].detach(), p.detach() - LR * (3 * p1[k] + 9 * p2[k]) / total)


# ------------------------------------------------------------------------------------ different splits
@pytest.mark.parametrize("listed", [("a", "b"), ("b", "a")])
def test_two_members_different_splits(model, listed):
    b1 = _member(model, "a", 1, 4, seed=41)
    b2 = _member(model, "b", 2, 5, seed=42)
    by_id = {"a": b1, "b": b2}
    before = {k: v.detach().clone() for k, v in _server_params(model, 1).items()}

    # hand reference: a's activation through conv2, concatenated with b's, then the rest
    ref = copy.deepcopy(model)
    params = _server_params(ref, 1)
    xa = b1.fx.clone().requires_grad_(True)
    xb = b2.fx.clone().requires_grad_(True)
    h = torch.cat([ref.blocks["conv2"](xa), xb], dim=0)
    logits = ref.forward_blocks(h, 2, 4)
    la = F.cross_entropy(logits[:4], b1.labels)
    lb = F.cross_entropy(logits[4:], b2.labels)
    grads = torch.autograd.grad(la + lb, [xa, xb, *params.values()])
    ga, gb, pg = grads[0], grads[1], dict(zip(params, grads[2:]))

    trainer = _trainer(model, 1, "per_member")
    out = trainer.step([by_id[i] for i in listed])

    assert out["a"].dfx.shape == b1.fx.shape == (4, 32, 14, 14)
    assert out["b"].dfx.shape == b2.fx.shape == (5, 64, 7, 7)
    _assert_close(out["a"].dfx, ga)
    _assert_close(out["b"].dfx, gb)
    assert out["a"].loss == pytest.approx(float(la.detach()), rel=1e-5)
    assert out["b"].loss == pytest.approx(float(lb.detach()), rel=1e-5)
    # independent members: same as each one alone
    _assert_close(out["a"].dfx, _solo_grads(model, b1, 1)[0])
    _assert_close(out["b"].dfx, _solo_grads(model, b2, 2)[0])
    after = _server_params(trainer.model, 1)
    for k in before:
        _assert_close(after[k].detach(), before[k] - LR * pg[k] / 2)
    # conv2 only got member a's gradient (halved by the member mean)
    _, pa, _ = _solo_grads(model, b1, 1)
    for k in before:
        if k.startswith("blocks.conv2."):
            _assert_close(after[k].detach(), before[k] - LR * pa[k] / 2)


def test_different_splits_union_mean(model):
    b1 = _member(model, "a", 1, 2, seed=51)
    b2 = _member(model, "b", 3, 6, seed=52)
    per = _trainer(model, 1, "per_member").step([b1, b2])
    union = _trainer(model, 1, "union_mean").step([b1, b2])
    _assert_close(union["a"].dfx, per["a"].dfx * (2 / 8))
    _assert_close(union["b"].dfx, per["b"].dfx * (6 / 8))


# ------------------------------------------------------------------------------------ per_member update over steps
def test_per_member_update_is_mean_of_separate_gradients_over_two_steps(model):
    b1 = _member(model, "a", 2, 5, seed=61)
    b2 = _member(model, "b", 2, 3, seed=62)
    b3 = _member(model, "c", 2, 4, seed=63)
    trainer = _trainer(model, 2)
    trainer.step([b1, b2, b3])
    # reference: after one hand step, a second trainer started from those weights
    _, p1, _ = _solo_grads(model, b1, 2)
    _, p2, _ = _solo_grads(model, b2, 2)
    _, p3, _ = _solo_grads(model, b3, 2)
    ref = _stepped(model, 2, {k: (p1[k] + p2[k] + p3[k]) / 3 for k in p1})
    _assert_portion(trainer, ref, 2)
    g, pg, _ = _solo_grads(ref, b1, 2)
    out = trainer.step([b1])
    _assert_close(out["a"].dfx, g)
    _assert_portion(trainer, _stepped(ref, 2, pg), 2)
    assert trainer.steps == 2


# ------------------------------------------------------------------------------------ data_weighted
def test_data_weighted_copy_moves_by_each_member_s_share_also_in_a_surplus_step(model):
    """Members of 10 and 30 samples (shares 1/4 and 3/4), both cut after conv2: the copy steps on
    the shares-weighted member gradients, also in the step only the larger member is in (where
    per_member would take the full rate); each dfx is the gradient of the member's own mean loss."""
    b1 = _member(model, "a", 2, 5, seed=81)
    b2 = _member(model, "b", 2, 6, seed=82)
    trainer = _trainer(model, 2, "data_weighted", members={"a": GroupMember(10, 2), "b": GroupMember(30, 2)})
    ga, pa, _ = _solo_grads(model, b1, 2)
    gb, pb, _ = _solo_grads(model, b2, 2)
    out = trainer.step([b1, b2])
    _assert_close(out["a"].dfx, ga)
    _assert_close(out["b"].dfx, gb)
    ref = _stepped(model, 2, {k: 0.25 * pa[k] + 0.75 * pb[k] for k in pa})
    _assert_portion(trainer, ref, 2)
    gb2, pb2, _ = _solo_grads(ref, b2, 2)
    out = trainer.step([b2])
    _assert_close(out["b"].dfx, gb2)
    _assert_portion(trainer, _stepped(ref, 2, {k: 0.75 * v for k, v in pb2.items()}), 2)


def test_data_weighted_block_only_some_members_pass_stands_for_them_alone(model):
    """a (10 samples) cut after conv1, b (30) after conv2: the copy's conv2 is a's alone (b trains
    its own conv2, which Algorithm 1 takes for b), so it steps on a's gradient at the full rate;
    fc1 and head step on 1/4 of a's and 3/4 of b's. dfx stay each member's own."""
    b1 = _member(model, "a", 1, 5, seed=86)
    b2 = _member(model, "b", 2, 6, seed=87)
    trainer = _trainer(model, 1, "data_weighted", members={"a": GroupMember(10, 1), "b": GroupMember(30, 2)})
    ga, pa, _ = _solo_grads(model, b1, 1)
    gb, pb, _ = _solo_grads(model, b2, 1)
    before = {k: v.detach().clone() for k, v in _server_params(model, 1).items()}
    out = trainer.step([b2, b1])
    _assert_close(out["a"].dfx, ga)
    _assert_close(out["b"].dfx, gb)
    after = _server_params(trainer.model, 1)
    for k in before:
        expected = pa[k] if k.startswith("blocks.conv2.") else 0.25 * pa[k] + 0.75 * pb[k]
        _assert_close(after[k].detach(), before[k] - LR * expected)
    # a done, b's surplus step: conv2 untouched (nobody passes it), the rest at b's 3/4
    moved = {k: v.detach().clone() for k, v in after.items()}
    ref = copy.deepcopy(trainer.model)
    _, pb2, _ = _solo_grads(ref, b2, 1)
    trainer.step([b2])
    for k in moved:
        expected = 0.0 * pb2[k] if k.startswith("blocks.conv2.") else 0.75 * pb2[k]
        _assert_close(_server_params(trainer.model, 1)[k].detach(), moved[k] - LR * expected)


def test_without_members_a_step_s_members_weigh_equally(model):
    b1 = _member(model, "a", 2, 5, seed=83)
    b2 = _member(model, "b", 2, 6, seed=84)
    per = _trainer(model, 2, "per_member")
    weighted = _trainer(model, 2, "data_weighted")
    per_out, weighted_out = per.step([b1, b2]), weighted.step([b1, b2])
    for k, p in _server_params(per.model, 2).items():
        _assert_close(_server_params(weighted.model, 2)[k].detach(), p.detach())
    _assert_close(weighted_out["a"].dfx, per_out["a"].dfx)


def test_members_must_have_data_and_match_the_step(model):
    with pytest.raises(ValueError, match="positive"):
        _trainer(model, 2, members={"a": GroupMember(0, 2)})
    trainer = _trainer(model, 2, "data_weighted", members={"a": GroupMember(3, 2)})
    before = {k: v.detach().clone() for k, v in trainer.portion.state_dict().items()}
    with pytest.raises(ValueError, match="'b': not a member"):
        trainer.step([_member(model, "b", 2, 4, seed=85)])
    with pytest.raises(ValueError, match="'a': split 3, where the group has it cut at 2"):
        trainer.step([_member(model, "a", 3, 4, seed=85)])
    assert trainer.steps == 0
    assert all(torch.equal(v, before[k]) for k, v in trainer.portion.state_dict().items())


# ------------------------------------------------------------------------------------ dtypes and errors
def test_half_precision_fx_gets_half_dfx(model):
    b = _member(model, "d0", 2, 4, seed=71)
    half = MemberBatch("d0", 2, b.fx.half(), b.labels)
    ref_b = MemberBatch("d0", 2, b.fx.half().float(), b.labels)
    dfx_ref, _, _ = _solo_grads(model, ref_b, 2)
    out = _trainer(model, 2).step([half])
    assert out["d0"].dfx.dtype == torch.float16
    torch.testing.assert_close(out["d0"].dfx, dfx_ref.half())


def test_input_fx_is_not_modified(model):
    b = _member(model, "d0", 3, 4, seed=81)
    saved = b.fx.clone()
    _trainer(model, 3).step([b])
    assert torch.equal(b.fx, saved)
    assert not b.fx.requires_grad


@pytest.mark.parametrize("start,split", [(2, 1), (3, 2), (1, 4), (1, 0), (2, 5)])
def test_split_outside_portion_raises(model, start, split):
    trainer = _trainer(model, start)
    before = trainer.state()
    fx = torch.zeros(2, 1, 28, 28)
    ok = _member(model, "ok", 3, 2, seed=1)
    with pytest.raises(ValueError, match="outside this group's portion"):
        trainer.step([ok, MemberBatch("bad", split, fx, torch.zeros(2, dtype=torch.long))])
    # nothing was trained
    for k, v in trainer.state().items():
        assert torch.equal(v, before[k])
    assert trainer.steps == 0


def test_empty_step_raises(model):
    with pytest.raises(ValueError, match="at least one member"):
        _trainer(model, 1).step([])


def test_weights_must_match_portion(model):
    m = copy.deepcopy(model)
    weights = {k: v.clone() for k, v in m.portion(2, 4).state_dict().items()}
    with pytest.raises(RuntimeError):
        GroupTrainer(m, 1, weights, lr=LR)


@pytest.mark.parametrize("warm", [True, False])
def test_warm_up_leaves_no_lazy_imports_for_the_first_group_step(warm):
    # PyTorch imports ~800 modules (torch._dynamo, sympy, ...) when a process builds its first
    # optimizer: 1-2 s that warm_up() moves from round 1 to start-up. Checked in a
    # fresh process, by the modules a first group-style step still imports (none once warm).
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from main_server.group_trainer import warm_up\n"
            f"{'warm_up()' if warm else ''}\n"
            "before = set(sys.modules)\n"
            "m = torch.nn.Linear(3, 2)\n"
            "o = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)\n"
            "m(torch.randn(2, 3)).sum().backward()\n"
            "o.step()\n"
            "print(len(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    new_modules = int(out.stdout.strip())
    assert (new_modules == 0) if warm else (new_modules > 100), new_modules


def test_explicit_cpu_device_is_bit_identical_to_the_default(model):
    """``--torch-device cpu``: a group on ``device=torch.device("cpu")`` gives exactly today's dfx
    (on the CPU, in each member's dtype), losses and weights, and its state is a copy."""
    def run(device):
        m = copy.deepcopy(model)
        weights = {k: v.clone() for k, v in m.portion(1, len(m.blocks)).state_dict().items()}
        trainer = GroupTrainer(m, 1, weights, lr=LR, momentum=0.9, device=device)
        outputs = []
        for step in range(3):
            half = _member(model, "b", 2, 3, seed=20 + step)
            half.fx = half.fx.half()
            outputs.append(trainer.step([_member(model, "a", 1, 4, seed=10 + step), half]))
        return trainer, outputs

    default, default_out = run(None)
    explicit, explicit_out = run(torch.device("cpu"))
    for got, want in zip(explicit_out, default_out):
        for member in ("a", "b"):
            assert got[member].dfx.device.type == "cpu" and torch.equal(got[member].dfx, want[member].dfx)
            assert got[member].loss == want[member].loss
        assert got["b"].dfx.dtype == torch.float16
    state = explicit.state()
    for key, value in default.state().items():
        assert torch.equal(state[key], value), key
    live = explicit.portion.state_dict()
    assert all(state[k].data_ptr() != live[k].data_ptr() for k in state)


# ------------------------------------------------------------------------------------ non-finite steps
def test_a_member_whose_own_loss_is_not_finite_is_named_and_the_copy_is_left_as_it_was(model):
    trainer = _trainer(model, 2)
    trainer.optimizer.param_groups[0]["momentum"] = 0.9   # a momentum buffer that must not move either
    trainer.step([_member(model, "warm", 2, 4, seed=90)])
    before = {k: v.clone() for k, v in trainer.state().items()}
    momentum = {id(p): trainer.optimizer.state[p]["momentum_buffer"].clone() for p in trainer.portion.parameters()}
    good, bad = _member(model, "good", 2, 4, seed=91), _member(model, "bad", 2, 4, seed=92)
    bad.fx[1, 0, 0, 0] = float("nan")
    with pytest.raises(NonFiniteStep) as refused:
        trainer.step([good, bad])
    assert refused.value.attributed and list(refused.value.culprits) == ["bad"]
    assert all(torch.equal(v, before[k]) for k, v in trainer.state().items()) and trainer.steps == 1
    assert all(torch.equal(trainer.optimizer.state[p]["momentum_buffer"], momentum[id(p)])
               for p in trainer.portion.parameters())
    out = trainer.step([good])   # the step without it trains as usual, on finite values
    assert torch.isfinite(out["good"].dfx).all() and trainer.steps == 2


def test_a_step_that_cannot_tell_whose_activations_broke_it_names_everyone_and_restores_batchnorm():
    """BatchNorm normalises the union batch: one member's overflowing activations make every
    member's loss NaN. Nobody can be singled out, and the running statistics, which the forward
    pass had already updated, are put back."""
    resnet = build_model("resnet8", seed=0)
    trainer = GroupTrainer(copy.deepcopy(resnet), 1, resnet.portion(1, len(resnet.blocks)).state_dict(), lr=LR)
    before = {k: v.clone() for k, v in trainer.state().items()}
    assert any("running_var" in k for k in before)
    gen = torch.Generator().manual_seed(93)
    members = [MemberBatch(d, 1, torch.rand(2, 16, 32, 32, generator=gen), torch.tensor([0, 1])) for d in ("a", "b")]
    members[1].fx[0] = 3e38
    with pytest.raises(NonFiniteStep) as refused:
        trainer.step(members)
    assert not refused.value.attributed and set(refused.value.culprits) == {"a", "b"}
    assert all(torch.equal(v, before[k]) for k, v in trainer.state().items()) and trainer.steps == 0


# ------------------------------------------------------------------------------------ member defences
def _defended(model, start: int, group_loss: str, defences: list[str] | GroupTrainer, params: dict | None = None,
              members: dict[str, GroupMember] | None = None) -> GroupTrainer:
    """A trainer with the named ``defences``, or with another trainer's (one round's groups share them)."""
    from shared.algorithms.registry import build_member_defences

    m = copy.deepcopy(model)
    weights = {k: v.clone() for k, v in m.portion(start, len(m.blocks)).state_dict().items()}
    loss = build_group_loss(group_loss)
    built = (defences.defences if isinstance(defences, GroupTrainer)
             else build_member_defences(defences, params or {}, loss))
    return GroupTrainer(m, start, weights, lr=LR, group_loss=loss, members=members, defences=built)


@pytest.mark.parametrize("group_loss", ["per_member", "per_member_sum", "union_mean", "data_weighted"])
def test_a_step_from_each_member_s_own_gradient_is_the_plain_step_when_no_defence_acts(model, group_loss):
    # `clip` with a bound no member reaches takes the per-member path and changes nothing: the
    # group loss's member weights rebuild exactly the plain objective's step and dfx.
    members = {"a": GroupMember(40, 1), "b": GroupMember(10, 2), "c": GroupMember(25, 2)}
    batches = [_member(model, "a", 1, 4, seed=61), _member(model, "b", 2, 7, seed=62), _member(model, "c", 2, 3, seed=63)]
    plain = _trainer(model, 1, group_loss, members=members)
    defended = _defended(model, 1, group_loss, ["clip"], {"clip": {"multiple": 1e9}}, members=members)
    out_plain, out_defended = plain.step(batches), defended.step(batches)
    for device in members:
        _assert_close(out_defended[device].dfx, out_plain[device].dfx)
        assert out_defended[device].loss == pytest.approx(out_plain[device].loss, rel=1e-6)
    for k, v in plain.state().items():
        _assert_close(defended.state()[k], v)


def test_the_median_of_the_members_steps_as_the_honest_majority_whatever_the_third_sends(model):
    # Two members send the same batch; the third sends it with its labels moved to the next class.
    # The median of the three gradients is the honest one, coordinate by coordinate.
    honest = _member(model, "a", 2, 8, seed=71)
    twin = MemberBatch("b", 2, honest.fx.clone(), honest.labels.clone())
    flipped = MemberBatch("c", 2, honest.fx.clone(), (honest.labels + 1) % model.num_classes)
    _, grads, _ = _solo_grads(model, honest, 2)
    trainer = _defended(model, 2, "per_member_sum", ["median"])
    trainer.step([honest, twin, flipped])
    # per_member_sum weighs each member 1: the centre times the weights' sum (3)
    _assert_portion(trainer, _stepped(model, 2, {k: 3 * g for k, g in grads.items()}), 2)
    mean = _trainer(model, 2, "per_member_sum")
    mean.step([honest, twin, flipped])
    assert any(not torch.allclose(mean.state()[k], v) for k, v in trainer.state().items())


def test_the_trimmed_mean_and_median_of_the_members_per_coordinate():
    from shared.algorithms.member_defence import MedianOfMembers, TrimmedMeanOfMembers

    grads = [[torch.tensor([1.0, 10.0])], [torch.tensor([2.0, -5.0])], [torch.tensor([3.0, 0.0])],
             [torch.tensor([100.0, 1.0])]]
    even = MedianOfMembers().center(grads, [0.25] * 4)[0]
    torch.testing.assert_close(even, torch.tensor([2.5, 0.5]))
    odd = MedianOfMembers().center(grads[:3], [1 / 3] * 3)[0]
    torch.testing.assert_close(odd, torch.tensor([2.0, 0.0]))
    trimmed = TrimmedMeanOfMembers({"trim": 0.25}).center(grads, [0.25] * 4)[0]
    torch.testing.assert_close(trimmed, torch.tensor([2.5, 0.5]))
    two = TrimmedMeanOfMembers().center(grads[:2], [0.5, 0.5])[0]   # nothing to trim of two
    torch.testing.assert_close(two, torch.tensor([1.5, 2.5]))


def test_clipping_bounds_each_member_by_the_median_norm():
    from shared.algorithms.member_defence import ClipMembers, gradient_norm

    grads = [[torch.tensor([3.0, 4.0])], [torch.tensor([0.0, 1.0])], [torch.tensor([300.0, 400.0])]]
    clipped = ClipMembers({"multiple": 2.0}).adjust(grads)
    assert [gradient_norm(g) for g in clipped] == pytest.approx([5.0, 1.0, 10.0])
    torch.testing.assert_close(clipped[2][0], torch.tensor([6.0, 8.0]))


def test_standardising_scales_a_member_far_above_the_median_down_to_the_bound(model):
    trainer = _defended(model, 2, "per_member", ["standardise"], {"standardise": {"ratio": 2.0}})
    rows = [3, 4, 5]
    h = torch.cat([torch.full((3, 2), 1.0), torch.full((4, 2), 1.5), torch.full((5, 2), 30.0)])
    out = trainer._standardised(h, rows, 2)
    parts = torch.split(out, rows)
    assert torch.equal(parts[0], h[:3]) and torch.equal(parts[1], h[3:7])
    torch.testing.assert_close(parts[2], torch.full((5, 2), 3.0))   # 2 x the median member's RMS, 1.5
    fresh = _defended(model, 2, "per_member", ["standardise"], {"standardise": {"ratio": 2.0}})
    two = torch.cat([torch.full((3, 2), 1.0), torch.full((4, 2), 30.0)])   # fewer values than min_members (3)
    assert fresh._standardised(two, rows[:2], 2) is two


def test_standardising_compares_with_the_rounds_members_at_the_block_not_the_groups_alone(model):
    # Two members scaled x10 in a group of four move the group's own median to 5.5 (a cap of 11:
    # nothing scaled); the median of every member the round met at that block stays honest.
    group_a = _defended(model, 2, "per_member", ["standardise"], {"standardise": {"ratio": 2.0}})
    trainer = _defended(model, 2, "per_member", group_a)   # another group of the same round
    rows = [2, 2, 2, 2]
    honest = torch.cat([torch.full((2, 2), v) for v in (0.9, 1.0, 1.0, 1.1)])
    assert group_a._standardised(honest, rows, 2) is honest
    attacked = torch.cat([torch.full((2, 2), v) for v in (1.0, 1.0, 10.0, 10.0)])
    parts = torch.split(trainer._standardised(attacked, rows, 2), rows)
    assert torch.equal(parts[0], attacked[:2]) and torch.equal(parts[1], attacked[2:4])
    torch.testing.assert_close(torch.cat(parts[2:]), torch.full((4, 2), 2.0))   # 2 x the round's median, 1.0
    other_block = _defended(model, 2, "per_member", ["standardise"], {"standardise": {"ratio": 2.0}})
    other_block._standardised(honest, rows, 1)   # values met at another block do not count at this one
    assert other_block._standardised(attacked, rows, 2) is attacked


def test_a_member_that_left_no_longer_counts_in_the_group_s_shares(model):
    # After `leave`, a step weighs the others exactly as a group formed without the member would.
    members = {"a": GroupMember(30, 2), "b": GroupMember(10, 2), "gone": GroupMember(60, 2)}
    batches = [_member(model, "a", 2, 4, seed=81), _member(model, "b", 2, 5, seed=82)]
    left = _trainer(model, 2, "data_weighted", members=members)
    left.leave("gone")
    without = _trainer(model, 2, "data_weighted", members={d: m for d, m in members.items() if d != "gone"})
    with_it = _trainer(model, 2, "data_weighted", members=members)
    left.step(batches), without.step(batches), with_it.step(batches)
    for k, v in without.state().items():
        _assert_close(left.state()[k], v)
    assert any(not torch.allclose(with_it.state()[k], v, atol=ATOL, rtol=RTOL) for k, v in without.state().items())


def test_members_own_states_average_back_to_the_group_copy_and_tell_the_members_apart(model):
    # member_updates: the copy trains exactly as without it, and the members' own states, weighted
    # by their shares of the data of the members passing each block, give the copy back.
    members = {"a": GroupMember(30, 1), "b": GroupMember(10, 2), "c": GroupMember(20, 2)}
    trainer = _defended(model, 1, "data_weighted", ["member_updates"], members=members)
    plain = _trainer(model, 1, "data_weighted", members=members)
    for step in range(3):
        batches = [_member(model, "a", 1, 4, seed=90 + step), _member(model, "b", 2, 4, seed=95 + step),
                   _member(model, "c", 2, 4, seed=99 + step)]
        trainer.step(batches)
        plain.step(batches)
    copy_state = trainer.state()
    for k, v in plain.state().items():
        _assert_close(copy_state[k], v)
    states = trainer.member_states(["a", "b", "c"])
    shares = {1: {"a": 1.0}, 2: {"a": 0.5, "b": 10 / 60, "c": 20 / 60}, 3: {"a": 0.5, "b": 10 / 60, "c": 20 / 60}}
    names = model.block_names()
    for key, value in copy_state.items():
        block = names.index(key.split(".")[1])
        mean = sum(share * states[d][key] for d, share in shares[block].items())
        _assert_close(mean, value)
    head = "blocks.head.weight"
    assert not torch.allclose(states["b"][head], states["c"][head])   # each its own part
    assert trainer.member_states([]) == {} and plain.member_states(["a"]) == {}


def test_a_copy_of_a_structure_only_template_allocates_its_portion_alone_and_keeps_no_gradients(model):
    # The Main Server's template is built on the meta device: each group allocates the blocks it
    # trains, nothing else. The gradients, as big as the copy, are freed once a step is applied
    # (a group waiting for its members held one copy's worth), and release() frees the copy.
    with torch.device("meta"):
        template = build_model("cnn", seed=0)
    weights = {k: v.clone() for k, v in model.portion(2, len(model.blocks)).state_dict().items()}
    trainer = GroupTrainer(copy.deepcopy(template), 2, weights, lr=LR)
    assert all(p.is_meta for name in ("conv1", "conv2") for p in trainer.model.blocks[name].parameters())
    assert not any(p.is_meta for p in trainer.portion.parameters())
    assert all(torch.equal(v, weights[k]) for k, v in trainer.state().items())
    reference = _trainer(model, 2)
    b = _member(model, "d0", 2, 4, seed=3)
    _assert_close(trainer.step([b])["d0"].dfx, reference.step([b])["d0"].dfx)
    assert all(p.grad is None for p in trainer.portion.parameters())
    trainer.release()
    assert all(t.is_meta for t in (*trainer.portion.parameters(), *trainer.portion.buffers()))
    assert trainer.optimizer.param_groups == [] and not trainer.optimizer.state
