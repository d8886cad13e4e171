"""``data_weighted``: a group's server copy steps on its members' losses weighted by their data.

Members of a group hold different amounts of data, so they send different numbers of steps, and
the group's later steps carry only the members that still owe one. With ``per_member`` those
steps move the copy at full rate on the remaining members' losses, yet Algorithm 1 weighs the
copy by the whole group's data: a large member's surplus steps (down to a last batch of one
sample) count for every member. Here each member's loss enters every step with its share of
the group's data, ``|D_i| / sum_G |D_j|``, whichever members are in the step, so over a round the
copy moves by the data-weighted sum of what each member's own copy would have moved (to first
order): the FedAvg of its members, the same weights Algorithm 1 then uses. With members of equal
data and equal step counts it is ``per_member``. The paper does not say how a group steps once
some members are done (docs/s2fl.md, "Members with more steps than others").

Each member's dfx stays the gradient of its own mean loss, as with ``per_member``.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.algorithms.group_loss import GroupLoss


class DataWeightedLoss(GroupLoss):
    """The shares-weighted sum of the members' mean losses; dfx rescaled to each member's own."""

    def objective(self, logits: torch.Tensor, member_labels: Sequence[torch.Tensor],
                  member_losses: Sequence[torch.Tensor], member_shares: Sequence[float]) -> torch.Tensor:
        return torch.stack([loss * share for loss, share in zip(member_losses, member_shares)]).sum()

    def dfx_multiplier(self, share: float) -> float:
        # The objective scaled this member's activation gradient by its share; undo it so the
        # device trains on the gradient of its own mean loss.
        return 1.0 / share
