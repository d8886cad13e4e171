"""``data_weighted``: a group's server copy steps on its members' losses weighted by their data.

Members of a group hold different amounts of data, so they send different numbers of steps, and
the group's later steps carry only the members that still owe one. With ``per_member`` those
steps move the copy at full rate on the remaining members' losses, yet Algorithm 1 weighs the
copy by the whole group's data: a large member's surplus steps (down to a last batch of one
sample) count for every member. Here each member's loss enters every step with its share of
the data the copy's block stands for, whichever members are in the step: for a block, the
members cut at or before it (the others train it on their devices, and Algorithm 1 takes
theirs), ``|D_i| / sum_{j cut at or before the block} |D_j|``. Over a round each block of the copy
then moves by the data-weighted sum of what those members' own copies would have moved (to
first order): the FedAvg of the members it stands for, with the weights Algorithm 1 then uses.
With members of equal data, equal step counts and one split point it is ``per_member``. The
paper does not say how a group steps once some members are done, nor how a block that only
some members pass is scaled (docs/s2fl.md, "Members with more steps than others").

Each member's dfx stays the gradient of its own mean loss, as with ``per_member``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.algorithms.group_loss import GroupLoss


class DataWeightedLoss(GroupLoss):
    """The shares-weighted sum of the members' mean losses, each block's gradient renormalised to
    the members that pass it; dfx rescaled to each member's own."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor], member_shares: Sequence[float]) -> torch.Tensor:
        return torch.stack([loss * share for loss, share in zip(member_losses, member_shares)]).sum()

    def member_weights(self, member_sizes: Sequence[int], member_shares: Sequence[float]) -> list[float]:
        return list(member_shares)

    def dfx_multiplier(self, share: float) -> float:
        # The objective scaled this member's activation gradient by its share; undo it so the
        # device trains on the gradient of its own mean loss.
        return 1.0 / share

    def block_grad_multiplier(self, block_share: float) -> float:
        # The objective weighed each member by its share of the whole group; a block that only
        # part of the group passes stands for that part alone, so its shares are renormalised.
        return 1.0 / block_share
