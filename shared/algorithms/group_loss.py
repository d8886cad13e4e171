"""How a group's step combines its members' losses: a plug-in of the Main Server's group trainer.

The paper's Eq. 3 trains a group's server copy on "the union" of its members' features without
saying how the loss is normalised (docs/s2fl.md). A round plan names one of ``GROUP_LOSSES``
(``shared/algorithms/registry.py``); adding a rule is one :class:`GroupLoss` subclass and one
registry line.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class GroupLoss:
    """The objective of one group step and the scale of the server copy's gradient.

    ``logits`` is the group's concatenated output and ``member_labels`` / ``member_losses`` (each
    member's mean cross-entropy) are in the same member order. Backpropagating :meth:`objective`
    gives every member's dfx and the copy's gradient; the trainer divides the latter by
    :meth:`server_grad_divisor` before the SGD step. Stateless: one instance serves every group
    of a round.
    """

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def server_grad_divisor(self, members: int) -> int:
        """What the copy's gradient is divided by (1: as the objective gives it)."""
        return 1


class PerMemberSumLoss(GroupLoss):
    """``per_member_sum``: the sum of the members' mean losses. Each member's dfx is the gradient of
    its own mean loss (as if it trained alone, as in SFL); the copy steps on the sum (|G| times the
    ``per_member`` step: the spec's further choice of server step size)."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(member_losses)).sum()


class PerMemberLoss(PerMemberSumLoss):
    """``per_member`` (the default): the same dfx as ``per_member_sum``; the copy's gradient is divided
    by the member count, i.e. the copy steps on the mean of the member losses."""

    def server_grad_divisor(self, members: int) -> int:
        return members


class UnionMeanLoss(GroupLoss):
    """``union_mean``: one mean cross-entropy over the concatenated batch (Eq. 3 read literally);
    each member's dfx is then scaled by its share of the batch."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(logits, torch.cat(list(member_labels)))
