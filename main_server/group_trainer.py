"""One group's server-side model copy and its training step (S2FL Algorithm 2, lines 13-23).

Members may be cut at different layers. The step walks the server portion block by block and
joins each member's activations into the running batch at the block where that member was cut,
so the group trains on one concatenated batch (BatchNorm sees the union, as in the paper) even
when members hold different numbers of layers.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from shared.config import GroupLoss
from shared.models import SplitModel


def warm_up() -> None:
    """Pay PyTorch's first-optimizer cost (1-2 s of lazy imports, once per process) at start-up.

    Otherwise round 1's first group holds every join for it (round 1 looks slower than it is),
    and the first step of round 1, whose server time feeds the time table, runs cold.
    """
    param = torch.zeros(1, requires_grad=True)
    (param * 2.0).sum().backward()
    torch.optim.SGD([param], lr=0.0, momentum=0.9).step()


@dataclass
class MemberBatch:
    """One member's contribution to a step: activations at its cut and its labels."""

    device_id: str
    split_point: int
    fx: torch.Tensor
    labels: torch.Tensor


@dataclass
class MemberResult:
    dfx: torch.Tensor
    loss: float


class GroupTrainer:
    """Trains one group's copy of the server portion ``blocks[start:]``."""

    def __init__(
        self,
        model: SplitModel,
        start: int,
        weights: Mapping[str, torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        group_loss: GroupLoss = "per_member",
    ) -> None:
        self.model = model
        self.start = start
        self.portion = model.portion(start, len(model.blocks))
        self.portion.load_state_dict(dict(weights), strict=True)
        self.portion.train()
        self.group_loss = group_loss
        self.optimizer = torch.optim.SGD(self.portion.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.steps = 0

    def state(self) -> dict[str, torch.Tensor]:
        """The trained server portion, keyed by the full model's state_dict names."""
        return {k: v.detach().clone() for k, v in self.portion.state_dict().items()}

    def step(self, batches: list[MemberBatch]) -> dict[str, MemberResult]:
        """Forward the concatenated batch, one SGD step on the copy, each member's dfx and loss.

        ``per_member``: the loss is the sum of the members' mean losses, so each member's dfx is
        the gradient of its own mean loss (as if it trained alone, as in SFL); the copy's
        gradient is divided by the member count, i.e. it steps on the mean of the member losses.
        ``per_member_sum``: the same dfx, but the copy steps on the sum of the member losses
        (|G| times the per_member step; Eq. 3 leaves the server step size open,
        docs/s2fl.md#how-a-groups-loss-is-combined-eq-3).
        ``union_mean``: one mean cross-entropy over the concatenated batch (Eq. 3 read
        literally); each member's dfx is then scaled by its share of the batch.
        """
        if not batches:
            raise ValueError("a step needs at least one member batch")
        for b in batches:
            if not self.start <= b.split_point < len(self.model.blocks):
                raise ValueError(f"{b.device_id}: split {b.split_point} outside this group's portion")
        inputs = {b.device_id: b.fx.detach().float().clone().requires_grad_(True) for b in batches}
        order: list[MemberBatch] = []
        h: torch.Tensor | None = None
        names = self.model.block_names()
        for index in range(self.start, len(names)):
            joining = [b for b in batches if b.split_point == index]
            if joining:
                parts = ([h] if h is not None else []) + [inputs[b.device_id] for b in joining]
                h = torch.cat(parts, dim=0)
                order.extend(joining)
            if h is not None:
                h = self.model.blocks[names[index]](h)
        assert h is not None
        logits = torch.split(h, [b.labels.shape[0] for b in order], dim=0)
        member_losses = [F.cross_entropy(out, b.labels) for out, b in zip(logits, order)]
        if self.group_loss == "union_mean":
            total = F.cross_entropy(h, torch.cat([b.labels for b in order]))
        else:
            total = torch.stack(member_losses).sum()
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        if self.group_loss == "per_member" and len(order) > 1:
            for p in self.portion.parameters():
                if p.grad is not None:
                    p.grad.div_(len(order))
        self.optimizer.step()
        self.steps += 1
        return {
            b.device_id: MemberResult(dfx=inputs[b.device_id].grad.detach().to(b.fx.dtype), loss=float(loss.detach()))
            for b, loss in zip(order, member_losses)
        }
