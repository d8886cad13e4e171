"""How a group's step combines its members' losses: a plug-in of the Main Server's group trainer.

The paper's Eq. 3 trains a group's server copy on "the union" of its members' features without
saying how the loss is normalised (docs/s2fl.md). A round plan names one of ``GROUP_LOSSES``
(``shared/algorithms/registry.py``); adding a rule is one :class:`GroupLoss` subclass and one
registry line.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.losses import Loss, build_loss


class GroupLoss:
    """The objective of one group step and the scale of the server copy's gradient.

    ``criterion`` is the run's loss (``train.loss``, shared/losses.py; default cross-entropy): the
    trainer computes each member's mean loss with it. ``logits`` is the group's concatenated output
    and ``member_labels`` / ``member_losses`` (each member's mean loss) / ``member_shares`` are in
    the same member order, for the members
    in this step. A member's share is its part of the whole group's data, ``|D_i| / sum_G |D_j|``
    (the weight Algorithm 1 gives the copy's layers on the member's behalf); the shares of a step
    sum to less than 1 once some members have sent all their steps. Backpropagating
    :meth:`objective` gives every member's activation gradient, which the trainer multiplies by
    :meth:`dfx_multiplier` to make the member's dfx, and the copy's gradient, which it divides
    by :meth:`server_grad_divisor` and multiplies, block by block, by
    :meth:`block_grad_multiplier` before the SGD step. Stateless but for the loss: one instance
    serves every group of a round.
    """

    def __init__(self, criterion: Loss | None = None) -> None:
        self.criterion = criterion if criterion is not None else build_loss()

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor], member_shares: Sequence[float]) -> torch.Tensor:
        raise NotImplementedError

    def member_weights(self, member_sizes: Sequence[int], member_shares: Sequence[float]) -> list[float]:
        """The weight of each member's mean loss in :meth:`objective`, where the objective is their
        weighted sum, from each member's batch size in the step (``member_sizes``) and its share:
        member defences that work on each member's own gradient of the copy
        (``shared/algorithms/member_defence.py``) rebuild the step from these, and a U-shaped step
        (``split.u_shaped``: each device computes its own loss, the Main Server has no label) weighs
        the gradients its members send up with them. NotImplementedError for an objective that is
        no such sum (such a loss runs neither with those defences nor U-shaped: the configuration
        check says so)."""
        raise NotImplementedError(f"{type(self).__name__} does not weigh its members' losses one by one")

    def server_grad_divisor(self, members: int) -> int:
        """What the copy's gradient is divided by (1: as the objective gives it)."""
        return 1

    def dfx_multiplier(self, share: float) -> float:
        """What a member's activation gradient is multiplied by to make its dfx (1: as the
        objective gives it)."""
        return 1.0

    def block_grad_multiplier(self, block_share: float) -> float:
        """What the gradient of one block of the copy is multiplied by, given ``block_share``: the
        part of the group's data whose members pass that block on the server (cut at or before
        it; the others train the block on their devices, and Algorithm 1 takes theirs). 1: as
        the objective gives it."""
        return 1.0


class PerMemberSumLoss(GroupLoss):
    """``per_member_sum``: the sum of the members' mean losses. Each member's dfx is the gradient of
    its own mean loss (as if it trained alone, as in SFL); the copy steps on the sum (|G| times the
    ``per_member`` step: the spec's further choice of server step size)."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor], member_shares: Sequence[float]) -> torch.Tensor:
        return torch.stack(list(member_losses)).sum()

    def member_weights(self, member_sizes: Sequence[int], member_shares: Sequence[float]) -> list[float]:
        return [1.0] * len(member_sizes)


class PerMemberLoss(PerMemberSumLoss):
    """``per_member``: the same dfx as ``per_member_sum``; the copy's gradient is divided
    by the number of members in the step, i.e. the copy steps on the mean of their losses (once
    the smaller members have sent all their steps, on the remaining members' losses alone, at
    full weight: docs/s2fl.md, "Members with more steps than others")."""

    def server_grad_divisor(self, members: int) -> int:
        return members


class UnionMeanLoss(GroupLoss):
    """``union_mean``: one mean loss over the concatenated batch (Eq. 3 read literally);
    each member's dfx is then scaled by its share of the batch."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor], member_shares: Sequence[float]) -> torch.Tensor:
        return self.criterion.mean(logits, torch.cat(list(member_labels)))

    def member_weights(self, member_sizes: Sequence[int], member_shares: Sequence[float]) -> list[float]:
        # A mean over the union is each member's mean weighted by its part of the batch.
        return [n / sum(member_sizes) for n in member_sizes]
