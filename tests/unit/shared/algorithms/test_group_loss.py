"""The group-loss plug-ins on their own: objectives, server-gradient divisors, dfx and block-gradient
multipliers by registered name.

(Their effect on a real group step is checked against hand autograd in
tests/unit/main_server/test_group_trainer.py.)"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from shared.algorithms.registry import GROUP_LOSSES, build_group_loss


#: the two members' shares of their group's data (a third member, done already, holds the rest)
SHARES = [0.2, 0.5]


def _members() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5, generator=gen)
    labels = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 0, 1])]
    parts = torch.split(logits, [3, 4])
    return logits, labels, [F.cross_entropy(p, y) for p, y in zip(parts, labels)]


def test_an_unknown_name_is_refused_with_the_registered_ones():
    with pytest.raises(ValueError, match=re.escape(f"unknown group_loss 'sum'; choose one of {sorted(GROUP_LOSSES)}")):
        build_group_loss("sum")


@pytest.mark.parametrize("name", ["per_member", "per_member_sum"])
def test_per_member_objectives_sum_the_member_means(name):
    logits, labels, losses = _members()
    torch.testing.assert_close(build_group_loss(name).objective(logits, labels, losses, SHARES), losses[0] + losses[1])


def test_union_mean_is_one_mean_over_the_concatenated_batch():
    logits, labels, losses = _members()
    union = build_group_loss("union_mean").objective(logits, labels, losses, SHARES)
    torch.testing.assert_close(union, (3 * losses[0] + 4 * losses[1]) / 7)


def test_data_weighted_weighs_each_member_mean_by_its_share_of_the_group():
    logits, labels, losses = _members()
    weighted = build_group_loss("data_weighted").objective(logits, labels, losses, SHARES)
    torch.testing.assert_close(weighted, 0.2 * losses[0] + 0.5 * losses[1])


@pytest.mark.parametrize("name, divisors", [("per_member", [1, 2, 5]), ("per_member_sum", [1, 1, 1]),
                                            ("union_mean", [1, 1, 1]), ("data_weighted", [1, 1, 1])])
def test_server_gradient_divisor(name, divisors):
    assert [build_group_loss(name).server_grad_divisor(n) for n in (1, 2, 5)] == divisors


@pytest.mark.parametrize("name, multipliers", [("per_member", [1.0, 1.0]), ("per_member_sum", [1.0, 1.0]),
                                               ("union_mean", [1.0, 1.0]), ("data_weighted", [5.0, 2.0])])
def test_dfx_multiplier(name, multipliers):
    """Only data_weighted rescales a member's activation gradient: back to its own mean loss's."""
    assert [build_group_loss(name).dfx_multiplier(share) for share in SHARES] == multipliers


@pytest.mark.parametrize("name, multipliers", [("per_member", [1.0, 1.0]), ("per_member_sum", [1.0, 1.0]),
                                               ("union_mean", [1.0, 1.0]), ("data_weighted", [5.0, 2.0])])
def test_block_gradient_multiplier(name, multipliers):
    """Only data_weighted renormalises a block to the members that pass it on the server."""
    assert [build_group_loss(name).block_grad_multiplier(share) for share in SHARES] == multipliers


@pytest.mark.parametrize("name", sorted(GROUP_LOSSES))
def test_each_objective_is_its_member_weights_sum_of_the_member_means(name):
    # Member defences and U-shaped steps rebuild a group's step from each member's own loss and
    # these weights (shared/algorithms/member_defence.py): they must give the objective itself.
    logits, labels, losses = _members()
    loss = build_group_loss(name)
    weights = loss.member_weights([len(y) for y in labels], SHARES)
    assert len(weights) == len(labels)
    torch.testing.assert_close(loss.objective(logits, labels, losses, SHARES),
                               sum(w * member for w, member in zip(weights, losses)))
