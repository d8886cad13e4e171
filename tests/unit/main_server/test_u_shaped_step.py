"""U-shaped group steps (``split.u_shaped``): the device keeps the front and the head with the loss,
the copy trains the middle in two halves (forward, then backward from the gradients the members
send up). Checked against the unsplit model at every pair of cuts, and against the plain step
(the Main Server computing the loss) for groups, group losses and member defences."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from main_server.group_trainer import GroupMember, GroupTrainer, MemberBatch, NonFiniteStep
from shared.algorithms.registry import build_group_loss, build_member_defences
from shared.models import build_model

LR = 0.1


def _data(model, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *model.input_shape, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _trainer(model, start: int, end: int | None, group_loss: str = "per_member", members=None,
             defences=()) -> GroupTrainer:
    keys = model.portion_keys(start, end if end is not None else len(model.blocks))
    state = model.state_dict()
    loss = build_group_loss(group_loss)
    return GroupTrainer(copy.deepcopy(model), start, {k: state[k].clone() for k in keys}, lr=LR, group_loss=loss,
                        members=members, end=end,
                        defences=build_member_defences(list(defences), {}, loss) if defences else ())


def _device_side(model, k: int, h: int, x: torch.Tensor, y: torch.Tensor, trainer: GroupTrainer, device_id: str):
    """One U-shaped step as a device makes it (alone in its group): front, the middle's output,
    its own head and loss, the gradient sent up, dfx back. Returns the gradients of its front and
    head parameters (state_dict names), scaled by the loss weight the server sent."""
    device = copy.deepcopy(model)
    front, head = device.portion(0, k), device.portion(h, len(device.blocks))
    fx = front(x)
    forward, answers = trainer.forward([MemberBatch(device_id, k, fx.detach())])
    out = answers[device_id].output.clone().requires_grad_(True)
    loss = F.cross_entropy(head(out), y)
    loss.backward()
    result = trainer.backward(forward, {device_id: out.grad})[device_id]
    assert result.loss is None   # the Main Server never computed it
    fx.backward(result.dfx)
    weight = answers[device_id].loss_weight
    grads = {n: p.grad for n, p in front.named_parameters()}
    grads.update({n: p.grad * weight for n, p in head.named_parameters()})
    return grads, loss


def _pairs(model) -> list[tuple[int, int]]:
    n = len(model.blocks)
    return [(k, h) for k, h in itertools.combinations(range(1, n), 2)]


@pytest.mark.parametrize("name", ["cnn", "resnet8"])
def test_every_pair_of_cuts_gives_the_unsplit_model_s_gradients(name):
    # One device alone: its front and head gradients, and the copy's step on the middle, are those
    # of the whole model trained on the device's mean loss, at every (front cut, head start).
    model = build_model(name, 10, (1, 28, 28), seed=0)
    x, y = _data(model, 6, seed=1)
    whole = copy.deepcopy(model)
    whole.train()
    F.cross_entropy(whole(x), y).backward()
    expected = {n: p.grad for n, p in whole.named_parameters()}
    for k, h in _pairs(model):
        trainer = _trainer(model, k, h)
        before = {n: p.detach().clone() for n, p in trainer.portion.named_parameters()}
        grads, _ = _device_side(model, k, h, x, y, trainer, "d0")
        for n, g in grads.items():
            torch.testing.assert_close(g, expected[n], rtol=1e-4, atol=1e-6, msg=f"{name} cut {k}/{h}: {n}")
        # The copy stepped on the middle's gradient: W - lr * grad.
        for n, p in trainer.portion.named_parameters():
            torch.testing.assert_close((before[n] - p.detach()) / LR, expected[n], rtol=1e-4, atol=1e-5,
                                       msg=f"{name} cut {k}/{h}: {n}")
        assert set(grads) | {n for n, _ in trainer.portion.named_parameters()} == set(expected)


def _plain_and_u(model, h: int, group_loss: str, defences=(), splits=(1, 1), sizes=(5, 3)):
    """The same group step twice: plain (the copy runs to the end and computes the loss) and
    U-shaped (the copy ends at ``h``, each member's head on the device): the copies' middles after
    the step and each member's dfx."""
    members = {f"d{i}": GroupMember(10 * (i + 1), s) for i, s in enumerate(splits)}
    data = {f"d{i}": _data(model, n, seed=i + 3) for i, n in enumerate(sizes)}
    acts = {d: model.portion(0, members[d].split_point)(x).detach() for d, (x, _) in data.items()}
    plain = _trainer(model, min(splits), None, group_loss, members, defences)
    plain_results = plain.step([MemberBatch(d, members[d].split_point, acts[d], y) for d, (_, y) in data.items()])
    u = _trainer(model, min(splits), h, group_loss, members, defences)
    forward, answers = u.forward([MemberBatch(d, members[d].split_point, acts[d]) for d in data])
    heads = {d: copy.deepcopy(model).portion(h, len(model.blocks)) for d in data}
    sent = {}
    for d, (_, y) in data.items():
        out = answers[d].output.clone().requires_grad_(True)
        F.cross_entropy(heads[d](out), y).backward()
        sent[d] = out.grad
    u_results = u.backward(forward, sent)
    middle = model.portion_keys(min(splits), h)
    plain_state, u_state = plain.state(), u.state()
    return plain_results, u_results, {k: (plain_state[k], u_state[k]) for k in middle}, answers


@pytest.mark.parametrize("group_loss", ["per_member", "per_member_sum", "union_mean", "data_weighted"])
def test_a_group_trains_its_middle_as_the_plain_step_does(group_loss):
    # Two members at different cuts, the middle with BatchNorm (resnet8): the gradients the members
    # send up, weighed as the group loss weighs their losses, give the plain step's dfx and middle.
    model = build_model("resnet8", 10, (1, 28, 28), seed=0)
    plain, u, middle, _ = _plain_and_u(model, 4, group_loss, splits=(1, 2))
    for d in plain:
        torch.testing.assert_close(u[d].dfx, plain[d].dfx, rtol=1e-4, atol=1e-6)
    for key, (a, b) in middle.items():
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("defences", [("median",), ("trimmed_mean",), ("member_updates",), ("standardise",)])
def test_member_defences_keep_working_u_shaped(defences):
    # Coordinate-wise centres, member updates and activation scaling read the middle alone, so
    # the U-shaped copy steps as the plain one does.
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    plain, u, middle, _ = _plain_and_u(model, 3, "data_weighted", defences)
    for d in plain:
        torch.testing.assert_close(u[d].dfx, plain[d].dfx, rtol=1e-4, atol=1e-6)
    for key, (a, b) in middle.items():
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=key)


def test_clip_bounds_each_member_s_own_gradient_of_the_middle():
    # Clipping compares the members' gradient norms over the copy, which in U-shaped mode is the
    # middle alone (the heads are the devices'): each member's own gradient of the middle, clipped
    # to the median norm, then their weighted mean, by hand.
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    members = {f"d{i}": GroupMember(10, 1) for i in range(3)}
    data = {d: _data(model, 4, seed=i + 7) for i, d in enumerate(members)}
    u = _trainer(model, 1, 3, "per_member", members, ("clip",))
    before = {n: p.detach().clone() for n, p in u.portion.named_parameters()}
    acts = {d: model.portion(0, 1)(x).detach() for d, (x, _) in data.items()}
    forward, answers = u.forward([MemberBatch(d, 1, a) for d, a in acts.items()])
    sent = {}
    own = []
    for d, (_, y) in data.items():
        out = answers[d].output.clone().requires_grad_(True)
        F.cross_entropy(model.portion(3, 4)(out), y).backward()
        sent[d] = out.grad
        solo = copy.deepcopy(model)
        F.cross_entropy(solo.portion(3, 4)(solo.portion(1, 3)(acts[d])), y).backward()
        own.append({n: p.grad for n, p in solo.portion(1, 3).named_parameters()})
    u.backward(forward, sent)
    norms = [sum(float(g.pow(2).sum()) for g in m.values()) ** 0.5 for m in own]
    bound = sorted(norms)[1]
    clipped = [{n: g * min(1.0, bound / norm) for n, g in m.items()} for m, norm in zip(own, norms)]
    for n, p in u.portion.named_parameters():
        expected = before[n] - LR * sum(m[n] for m in clipped) / 3
        torch.testing.assert_close(p.detach(), expected, rtol=1e-4, atol=1e-6, msg=n)
    assert max(norms) > bound   # the clip bit


def test_the_loss_weight_is_the_member_weight_times_its_dfx_multiplier():
    # union_mean weighs each member's mean loss by its part of the batch, and keeps that in dfx:
    # the device's head then trains on the same weight as its front.
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    _, _, _, answers = _plain_and_u(model, 3, "union_mean", sizes=(6, 2))
    assert answers["d0"].loss_weight == pytest.approx(6 / 8) and answers["d1"].loss_weight == pytest.approx(2 / 8)
    _, _, _, answers = _plain_and_u(model, 3, "data_weighted", sizes=(6, 2))
    assert [a.loss_weight for a in answers.values()] == pytest.approx([1.0, 1.0])


def test_a_member_without_a_gradient_leaves_the_objective_and_gets_no_answer():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    trainer = _trainer(model, 1, 3)
    x0, x1 = (_data(model, 4, seed=s)[0] for s in (1, 2))
    acts = {d: model.portion(0, 1)(x).detach() for d, x in (("d0", x0), ("d1", x1))}
    forward, answers = trainer.forward([MemberBatch(d, 1, a) for d, a in acts.items()])
    alone = _trainer(model, 1, 3)
    alone_forward, _ = alone.forward([MemberBatch(d, 1, a) for d, a in acts.items()])
    g = torch.randn_like(answers["d0"].output)
    results = trainer.backward(forward, {"d0": g})
    assert set(results) == {"d0"}
    # As if d1 had sent a zero gradient: its rows stay in the batch, its loss counts for nothing.
    expected = alone.backward(alone_forward, {"d0": g, "d1": torch.zeros_like(answers["d1"].output)})
    torch.testing.assert_close(results["d0"].dfx, expected["d0"].dfx)


def test_the_halves_belong_to_u_shaped_copies_and_the_plain_step_to_the_others():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    x, y = _data(model, 4, seed=1)
    fx = model.portion(0, 1)(x).detach()
    with pytest.raises(ValueError, match="two halves"):
        _trainer(model, 1, 3).step([MemberBatch("d0", 1, fx, y)])
    with pytest.raises(ValueError, match="U-shaped"):
        _trainer(model, 1, None).forward([MemberBatch("d0", 1, fx)])
    with pytest.raises(ValueError, match="outside"):
        _trainer(model, 1, 3).forward([MemberBatch("d0", 3, model.portion(0, 3)(x).detach())])


def test_a_gradient_that_is_not_finite_names_its_member_and_leaves_the_copy():
    model = build_model("cnn", 10, (1, 28, 28), seed=0)
    trainer = _trainer(model, 1, 3)
    before = {k: v.clone() for k, v in trainer.state().items()}
    acts = {d: model.portion(0, 1)(_data(model, 3, seed=s)[0]).detach() for d, s in (("d0", 1), ("d1", 2))}
    forward, answers = trainer.forward([MemberBatch(d, 1, a) for d, a in acts.items()])
    bad = torch.full_like(answers["d1"].output, float("inf"))
    with pytest.raises(NonFiniteStep) as caught:
        trainer.backward(forward, {"d0": torch.ones_like(answers["d0"].output), "d1": bad})
    assert set(caught.value.culprits) == {"d1"} and caught.value.attributed
    assert all(torch.equal(before[k], v) for k, v in trainer.state().items())
    # The graph was kept: the step goes on without the member it named.
    results = trainer.backward(forward, {"d0": torch.ones_like(answers["d0"].output)})
    assert set(results) == {"d0"} and trainer.steps == 1
