"""One group's server-side model copy and its training step (S2FL Algorithm 2, lines 13-23).

Members may be cut at different layers. The step walks the server portion block by block and
joins each member's activations into the running batch at the block where that member was cut,
so the group trains on one concatenated batch (BatchNorm sees the union, as in the paper) even
when members hold different numbers of layers.

In U-shaped mode (``split.u_shaped``) the copy is the middle ``blocks[start:end]`` and each device
keeps the head and its loss: a step is then two halves, :meth:`GroupTrainer.forward` (the
middle's output for each member) and :meth:`GroupTrainer.backward` (from the gradients the
members send up at their head's input, each member's dfx and the copy's SGD step), and the Main
Server never holds a label.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shared.algorithms.group_loss import GroupLoss, PerMemberLoss
from shared.algorithms.member_defence import Gradient, MemberDefence
from shared.models import SplitModel
from shared.portions import load_portion
from shared.wire import encode_state


def warm_up(device: torch.device | None = None) -> None:
    """Pay PyTorch's first-optimizer cost (its lazy imports, once per process) at start-up,
    and on a GPU the context's creation (seconds), on ``device``.

    Otherwise round 1's first group holds every join for it (round 1 looks slower than it is),
    and the first step of round 1, whose server time feeds the time table, runs cold.
    """
    param = torch.zeros(1, requires_grad=True, device=device)
    (param * 2.0).sum().backward()
    torch.optim.SGD([param], lr=0.0, momentum=0.9).step()


@dataclass
class MemberBatch:
    """One member's contribution to a step: activations at its cut and its labels (None in
    U-shaped mode: they stay on the device)."""

    device_id: str
    split_point: int
    fx: torch.Tensor
    labels: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        """The member's samples in the step."""
        return self.fx.shape[0]


@dataclass(frozen=True)
class GroupMember:
    """What the group-loss plug-in may weigh a member by: its data size ``|D_i|`` and its cut."""

    samples: int
    split_point: int


@dataclass
class MemberResult:
    """A member's answer to a step: its dfx, and its loss where the Main Server computed it (None
    in U-shaped mode)."""

    dfx: torch.Tensor
    loss: float | None


@dataclass
class MiddleResult:
    """A member's answer to a U-shaped step's first half: the middle's output for its rows, and
    the weight the group's objective gives its mean loss, times its dfx multiplier, which the
    device scales its head's gradient by (so its head trains as its front does)."""

    output: torch.Tensor
    loss_weight: float


@dataclass
class ForwardPass:
    """A U-shaped group step between its halves: its members in batch order, their activations
    (leaves of the graph), the middle's output of the concatenated batch with its graph, each
    member's share and weight, and each block's share (:meth:`GroupTrainer.forward`)."""

    order: list[MemberBatch]
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor
    shares: list[float]
    weights: list[float]
    block_share: dict[int, float]


class NonFiniteStep(Exception):
    """A step whose losses, member gradients (dfx), copy gradients or BatchNorm statistics were not
    all finite: the copy was left as it was. ``culprits``: each member to leave out, with why;
    ``attributed``: whether their own results showed it (False: the step cannot tell whose
    activations caused it, and ``culprits`` names every member of the step)."""

    def __init__(self, culprits: dict[str, str], attributed: bool) -> None:
        super().__init__("; ".join(f"{d}: {why}" for d, why in culprits.items()))
        self.culprits = culprits
        self.attributed = attributed


class GroupTrainer:
    """Trains one group's copy of the server portion ``blocks[start:end]`` on ``device``
    (``--torch-device``; default the CPU); ``end`` None: the model's end, where the copy computes
    the loss (:meth:`step`), else the device's head start (U-shaped mode: :meth:`forward` and
    :meth:`backward`). ``members`` are the group's members (data size and
    cut), from which each step's group-loss plug-in gets the members' shares of the group's data
    and each block's share (the members cut at or before it); without them a step's members
    count as the whole group, in equal parts. A member taken out of the group (:meth:`leave`) no
    longer counts: the group then trains as if it had been formed without it. ``defences``: the
    member defences each step applies, in order (``shared/algorithms/member_defence.py``).

    ``model`` arrives on the meta device (the plan's template: structure only) or the CPU, and
    ``weights`` on the CPU (decoded from the wire); the portion is allocated on the device (or
    moved there) and loaded, each step's activations and labels follow it there, and dfx and
    :meth:`state` come back to the CPU for the wire. The blocks before ``start`` stay unused where
    they are (on the meta device, holding no memory).

    Memory: the copy's weights, its optimizer's state (SGD momentum, if any), and the gradients
    during a step only (they are freed once it is applied); :meth:`release` frees the copy once
    its portion has been encoded for the Fed Server.
    """

    def __init__(
        self,
        model: SplitModel,
        start: int,
        weights: Mapping[str, torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        group_loss: GroupLoss | None = None,
        device: torch.device | None = None,
        members: Mapping[str, GroupMember] | None = None,
        defences: Sequence[MemberDefence] = (),
        end: int | None = None,
    ) -> None:
        self.model = model
        self.start = start
        self.device = device or torch.device("cpu")
        self.end = len(model.blocks) if end is None else end
        self.u_shaped = self.end < len(model.blocks)
        self.portion = model.portion(start, self.end)
        load_portion(self.portion, weights, self.device)
        self.portion.to(self.device)
        self.portion.train()
        self.group_loss = group_loss if group_loss is not None else PerMemberLoss()
        self.members = dict(members) if members is not None else None
        if self.members is not None and not all(m.samples > 0 for m in self.members.values()):
            raise ValueError("every member's data size must be positive")
        # The group's shares change only when a member leaves: computed then, not every step. The
        # members that left, and the shares of the others, are replaced together (one assignment:
        # a step reading them from a worker thread sees either the old pair or the new).
        self._left: frozenset[str] = frozenset()
        self._group_shares = (self._left, None if self.members is None else
                              _data_shares(self.members, start, self.end))
        self.defences = list(defences)
        self._per_member = any(d.per_member_gradients for d in self.defences)
        self._center = next((d for d in self.defences if d.centers), MemberDefence())
        # member_updates: each member's own part of the copy's updates, parameter by parameter
        # (the trainable parameters in the portion's order, with the block each belongs to).
        self._params = [(name, p) for name, p in self.portion.named_parameters() if p.requires_grad]
        self._param_block = [names_index for name, _ in self._params
                             for names_index in [model.block_names().index(name.split(".")[1])]]
        self._own_updates: dict[str, list[torch.Tensor]] | None = (
            {} if any(d.uploads_members for d in self.defences) else None)
        self.lr = lr
        # None for a U-shaped middle without parameters (pooling alone): its steps train nothing,
        # and torch's optimizers refuse an empty parameter list.
        params = list(self.portion.parameters())
        self.optimizer = torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay) if params else None
        self.steps = 0
        # The buffers a forward pass updates in place (BatchNorm's running statistics and batch
        # count) and a copy of them, allocated once: a refused step puts them back as they were.
        self._buffers = list(self.portion.buffers())
        self._saved_buffers = [b.detach().clone() for b in self._buffers]
        self._float_buffers = [b for b in self._buffers if b.is_floating_point()]

    def release(self) -> None:
        """Free the copy's weights and optimizer state once its portion has been taken
        (:meth:`wire_state`): a finished group's copy was held until the next round's plan
        replaced the round. The trainer cannot step or give its state afterwards."""
        # The optimizer and the buffer lists hold the tensors themselves, which to_empty replaces in
        # the modules only: each reference goes, or the old storage stays.
        if self.optimizer is not None:
            self.optimizer.state.clear()
            self.optimizer.param_groups.clear()
        self._buffers, self._saved_buffers, self._float_buffers = [], [], []
        self.portion.to_empty(device="meta")

    def state(self) -> dict[str, torch.Tensor]:
        """The trained server portion, keyed by the full model's state_dict names."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.portion.state_dict().items()}

    def wire_state(self) -> dict[str, dict]:
        """The trained server portion encoded for the wire (:func:`shared.wire.encode_state`), keyed
        as :meth:`state`: each tensor copied once, by the encoder's snapshot (on a GPU, after its
        move to the CPU). ``encode_state(self.state())`` copied each one twice."""
        return encode_state(self.portion.state_dict())

    def step(self, batches: list[MemberBatch]) -> dict[str, MemberResult]:
        """Forward the concatenated batch, one SGD step on the copy, each member's dfx and loss.

        The members' losses are the run's loss (the plug-in's ``criterion``); the objective and the
        scale of the copy's gradient come from the group-loss plug-in
        (``shared/algorithms/group_loss.py``). A step whose results are not all finite is not
        applied: :class:`NonFiniteStep` names the members to leave out, and the copy (weights,
        momentum, BatchNorm statistics) stays as it was.
        """
        if self.u_shaped:
            raise ValueError("a U-shaped copy steps in two halves: forward, then backward")
        order, inputs, h, shares, block_share = self._forward(batches)
        logits = torch.split(h, [b.rows for b in order], dim=0)
        labels = []
        for b in order:
            if b.labels is None:
                raise ValueError(f"{b.device_id}: a step of a copy that computes the loss needs the labels")
            labels.append(b.labels.to(self.device))
        member_losses = [self.group_loss.criterion.mean(out, y) for out, y in zip(logits, labels)]
        self._zero_grad()
        if self._per_member:
            weights = self.group_loss.member_weights([b.rows for b in order], shares)
            total, dfx, contributions = self._defended_backward(order, member_losses, weights, inputs)
        else:
            total = self.group_loss.objective(h, labels, member_losses, shares)
            total.backward()
            dfx, contributions = {device: _input_grad(x) for device, x in inputs.items()}, []
        return self._apply(order, [float(x.detach()) for x in member_losses], member_losses, total, dfx,
                           contributions, shares, block_share)

    def forward(self, batches: list[MemberBatch]) -> tuple[ForwardPass, dict[str, MiddleResult]]:
        """U-shaped mode, a step's first half: the middle's output of the concatenated batch, each
        member's rows of it (on the CPU, in its activations' dtype) with its loss weight. The graph
        is kept for :meth:`backward`. :class:`NonFiniteStep` (naming every member: the output of
        the joint batch cannot tell whose activations made it so) for an output that is not all
        finite, the BatchNorm statistics put back."""
        if not self.u_shaped:
            raise ValueError("forward and backward are the halves of a U-shaped step; this copy computes the loss")
        order, inputs, output, shares, block_share = self._forward(batches)
        if not math.isfinite(float(output.detach().sum())):
            if self._buffers:
                torch._foreach_copy_(self._buffers, self._saved_buffers)
            raise NonFiniteStep({b.device_id: "the middle's output of the group's batch was not finite" for b in order},
                                attributed=len(order) == 1)
        weights = self.group_loss.member_weights([b.rows for b in order], shares)
        outputs = torch.split(output.detach(), [b.rows for b in order], dim=0)
        results = {b.device_id: MiddleResult(out.to("cpu", b.fx.dtype, copy=True),
                                             w * self.group_loss.dfx_multiplier(share))
                   for b, out, w, share in zip(order, outputs, weights, shares)}
        return ForwardPass(order, inputs, output, shares, weights, block_share), results

    def backward(self, forward: ForwardPass, gradients: Mapping[str, torch.Tensor]) -> dict[str, MemberResult]:
        """U-shaped mode, a step's second half: from each member's gradient of its own mean loss at
        its rows of the middle's output (``gradients``, shaped as its rows), the gradient of the
        group's objective (each weighted as the group loss says), each member's dfx and the copy's
        SGD step. A member with no gradient (dropped between the halves) leaves the objective; its
        rows stay in the batch the middle normalised. :class:`NonFiniteStep` as for :meth:`step`;
        the graph is kept, so the caller may call again without the members it names."""
        order, inputs = forward.order, forward.inputs
        rows = torch.split(forward.output, [b.rows for b in order], dim=0)
        sent = [gradients.get(b.device_id) for b in order]
        grads = [torch.zeros_like(out) if g is None else g.to(self.device, out.dtype) for out, g in zip(rows, sent)]
        # Each member's own objective: the dot product of its rows with its gradient, whose
        # gradient is the member's gradient of its mean loss (what the device backpropagated).
        member_objectives = [(out * g).sum() for out, g in zip(rows, grads)]
        self._zero_grad()
        for x in inputs.values():
            x.grad = None
        if self._per_member:
            total, dfx, contributions = self._defended_backward(order, member_objectives, forward.weights, inputs,
                                                                keep_graph=True)
        else:
            forward.output.backward(torch.cat([g * w for g, w in zip(grads, forward.weights)]), retain_graph=True)
            total = torch.stack([o.detach() * w for o, w in zip(member_objectives, forward.weights)]).sum()
            dfx, contributions = {device: _input_grad(x) for device, x in inputs.items()}, []
        answered = [b for b, g in zip(order, sent) if g is not None]
        results = self._apply(order, [None] * len(order), member_objectives, total, dfx, contributions,
                              forward.shares, forward.block_share)
        return {b.device_id: results[b.device_id] for b in answered}

    def discard(self) -> None:
        """Give up a U-shaped step after its first half (every member it answered was dropped):
        the BatchNorm statistics its forward pass moved are put back, and nothing is trained."""
        if self._buffers:
            torch._foreach_copy_(self._buffers, self._saved_buffers)

    def _forward(self, batches: list[MemberBatch]
                 ) -> tuple[list[MemberBatch], dict[str, torch.Tensor], torch.Tensor, list[float], dict[int, float]]:
        """The copy's forward pass over the members' concatenated activations: the members in
        batch order, their activations as leaves, the portion's output, each member's share and
        each block's. The BatchNorm statistics are saved first (a refused step puts them back)."""
        if not batches:
            raise ValueError("a step needs at least one member batch")
        for b in batches:
            if not self.start <= b.split_point < self.end:
                raise ValueError(f"{b.device_id}: split {b.split_point} outside this group's portion")
        share_of, block_share = self._shares(batches)
        if self._buffers:
            torch._foreach_copy_(self._saved_buffers, self._buffers)
        inputs = {b.device_id: b.fx.detach().to(self.device, torch.float32, copy=True).requires_grad_(True)
                  for b in batches}
        order: list[MemberBatch] = []
        h: torch.Tensor | None = None
        names = self.model.block_names()
        for index in range(self.start, self.end):
            joining = [b for b in batches if b.split_point == index]
            if joining:
                parts = ([h] if h is not None else []) + [inputs[b.device_id] for b in joining]
                h = torch.cat(parts, dim=0)
                order.extend(joining)
                h = self._standardised(h, [b.rows for b in order], index)
            if h is not None:
                h = self.model.blocks[names[index]](h)
        assert h is not None
        return order, inputs, h, [share_of[b.device_id] for b in order], block_share

    def _apply(self, order: list[MemberBatch], losses: Sequence[float | None], member_objectives: list[torch.Tensor],
               total: torch.Tensor, dfx: dict[str, torch.Tensor], contributions: list[Gradient],
               shares: list[float], block_share: Mapping[int, float]) -> dict[str, MemberResult]:
        """The copy's gradient scaled as the group loss says (its divisor, each block's
        multiplier), checked finite (:meth:`_check_finite`), the SGD step, and each member's
        result: its dfx times its multiplier, with its loss."""
        names = self.model.block_names()
        divisor = self.group_loss.server_grad_divisor(len(order))
        if divisor != 1:
            for p in self.portion.parameters():
                if p.grad is not None:
                    p.grad.div_(divisor)
        for index in range(self.start, self.end):
            if block_share[index] == 0.0:   # nobody passes this block: it got no gradient
                continue
            multiplier = self.group_loss.block_grad_multiplier(block_share[index])
            if multiplier != 1.0:
                for p in self.model.blocks[names[index]].parameters():
                    if p.grad is not None:
                        p.grad.mul_(multiplier)
        self._check_finite(order, member_objectives, total, dfx)
        if self._own_updates is not None:
            self._count_own_updates(order, contributions, divisor, block_share)
        if self.optimizer is not None:
            self.optimizer.step()
        # The gradients are as big as the copy, and the next step makes its own: not kept between
        # steps, where a group waits for its members (a round of several groups held one each).
        self._zero_grad()
        self.steps += 1
        results = {}
        for b, loss, share in zip(order, losses, shares):
            grad = dfx[b.device_id].detach()
            multiplier = self.group_loss.dfx_multiplier(share)
            if multiplier != 1.0:
                grad = grad.mul_(multiplier)
            results[b.device_id] = MemberResult(dfx=grad.to("cpu", b.fx.dtype), loss=loss)
        return results

    def _zero_grad(self) -> None:
        """Drop the copy's gradients (``optimizer.zero_grad``, for a copy with or without one)."""
        for p in self.portion.parameters():
            p.grad = None

    def leave(self, device_id: str) -> None:
        """``device_id`` was taken out of the group: its share of the group's data is given back,
        so each later step weighs the others as a group formed without it would. A step already
        training (or one whose batch still holds the member) is not changed."""
        if self.members is None or device_id not in self.members or device_id in self._left:
            return
        left = self._left | {device_id}
        staying = {d: m for d, m in self.members.items() if d not in left}
        self._group_shares = (left, _data_shares(staying, self.start, self.end) if staying else None)
        self._left = left

    def _standardised(self, h: torch.Tensor, rows: list[int], block: int) -> torch.Tensor:
        """``h`` (the group's batch at ``block``, where members join, ``rows`` per member in order)
        with each member's rows scaled as the defences say (:meth:`MemberDefence.activation_scales`,
        from each member's root mean square there); ``h`` itself when nothing changes."""
        if not self.defences:
            return h
        with torch.no_grad():
            rms = [float(part.pow(2).mean().sqrt()) for part in torch.split(h.detach(), rows, dim=0)]
        scales = [1.0] * len(rows)
        for defence in self.defences:
            scales = [s * f for s, f in zip(scales, defence.activation_scales([r * s for r, s in zip(rms, scales)], block))]
        if all(s == 1.0 for s in scales):
            return h
        per_row = torch.repeat_interleave(torch.tensor(scales, dtype=h.dtype, device=h.device),
                                          torch.tensor(rows, device=h.device))
        return h * per_row.view(-1, *([1] * (h.dim() - 1)))

    def _defended_backward(self, order: list[MemberBatch], member_losses: list[torch.Tensor], weights: list[float],
                           inputs: dict[str, torch.Tensor], keep_graph: bool = False
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[Gradient]]:
        """The step's gradients from each member's own (one backward pass per member), through
        the defences: each member's gradient of its mean loss (``member_losses``: the losses, or
        in U-shaped mode an objective with the same gradient), adjusted, then centred with the
        group loss's member ``weights`` and scaled back by their sum (the weighted mean of them is
        the plain step exactly). Sets the copy's ``.grad``; returns the objective (the weighted
        sum of the members' losses), each member's dfx, which no defence touches (a device is
        answered the gradient of the group's objective at its activations, as in the plain step),
        and each member's weighted own gradient (what the weighted mean sums). ``keep_graph``:
        the graph stays for another pass (a U-shaped step's retry)."""
        params = [p for _, p in self._params]
        xs = [inputs[b.device_id] for b in order]
        dfx = {b.device_id: torch.zeros_like(inputs[b.device_id]) for b in order}
        own: list[Gradient] = []
        for m, loss in enumerate(member_losses):
            grads = torch.autograd.grad(loss, params + xs, retain_graph=keep_graph or m < len(member_losses) - 1,
                                        allow_unused=True)
            own.append([g if g is not None else torch.zeros_like(p) for g, p in zip(grads[:len(params)], params)])
            for b, g in zip(order, grads[len(params):]):
                if g is not None:
                    dfx[b.device_id].add_(g, alpha=weights[m])
        for defence in self.defences:
            own = defence.adjust(own)
        total_weight = sum(weights)
        combined = self._center.center(own, [w / total_weight for w in weights])
        for p, g in zip(params, combined):
            p.grad = g.mul(total_weight)
        total = torch.stack([loss.detach() * w for loss, w in zip(member_losses, weights)]).sum()
        contributions = [[g * w for g in member] for member, w in zip(own, weights)] if self._own_updates is not None else []
        return total, dfx, contributions

    def _count_own_updates(self, order: list[MemberBatch], contributions: list[Gradient], divisor: int,
                           block_share: Mapping[int, float]) -> None:
        """Add to each member's own update what its weighted gradient moved the copy this step, as
        the step scaled the copy's gradient (the divisor and each block's multiplier) times ``-lr``."""
        assert self._own_updates is not None
        lr = self.lr
        scale = [-lr * (self.group_loss.block_grad_multiplier(block_share[b]) if block_share[b] else 0.0) / divisor
                 for b in self._param_block]
        for b, member in zip(order, contributions):
            own = self._own_updates.setdefault(b.device_id, [torch.zeros_like(p) for _, p in self._params])
            for total, g, s in zip(own, member, scale):
                total.add_(g, alpha=s)

    def member_states(self, members: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Each of ``members``' own state of the copy (``member_updates``): the copy ``W``, plus for
        each block it passes its own update over its share of the data of the members that pass
        that block (``s_m``), less every contributor's (``W + D_m / s_m - D``). The members' weighted
        mean is ``W`` less the updates of contributors not among them (dropped members). Empty
        unless the run uploads members' states."""
        if self._own_updates is None or not members:
            return {}
        if self.members is None:
            raise ValueError("member states need the group's members (their data sizes and cuts)")
        state = self.state()
        updates = {d: [u.to("cpu") for u in own] for d, own in self._own_updates.items()}
        everyone = [sum(parts, torch.zeros_like(state[name])) for (name, _), parts
                    in zip(self._params, zip(*updates.values()))] if updates else []
        block_shares: dict[int, dict[str, float]] = {}
        for b in range(self.start, self.end):
            passing = {d: m.samples for d, m in self.members.items() if d in members and m.split_point <= b}
            block_shares[b] = {d: n / sum(passing.values()) for d, n in passing.items()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for device in members:
            member_state = dict(state)
            own = updates.get(device)
            for i, ((name, _), b) in enumerate(zip(self._params, self._param_block)):
                share = block_shares[b].get(device)
                if share is None or not everyone:
                    continue   # a block the member does not pass: its device trained it (Algorithm 1 takes that)
                mine = own[i] if own is not None else torch.zeros_like(state[name])
                member_state[name] = state[name] + mine / share - everyone[i]
            out[device] = member_state
        return out

    def _check_finite(self, order: list[MemberBatch], member_losses: list[torch.Tensor], total: torch.Tensor,
                      dfx: dict[str, torch.Tensor]) -> None:
        """Raise :class:`NonFiniteStep` (after putting the copy back as it was) unless every
        member's loss and dfx, the step's objective, the copy's gradients and its BatchNorm
        statistics are finite.

        One read of tensors already in hand, brought back in one transfer: the sum of each (NaN
        and infinities propagate through a sum; a sum that overflows reads as a failure too, which
        only values already far out of range give). A sum is the cheapest exact pass: it reads each
        tensor once, as ``torch._foreach_norm`` and ``torch.aminmax`` do, and computes less. The
        check runs on every group step, the Main Server's hot path (benchmark (c),
        benchmarks/README.md, "(c) Main Server step latency and throughput").
        """
        grads = [p.grad for p in self.portion.parameters() if p.grad is not None]
        sums = [x for b, loss in zip(order, member_losses) for x in (loss.detach(), dfx[b.device_id].sum())]
        sums += [total.detach(), *(t.sum() for t in grads + self._float_buffers)]
        values = torch.stack([x.float() for x in sums]).tolist()
        if all(map(math.isfinite, values)):
            return
        culprits = {b.device_id: "its loss or its gradient (dfx) was not finite"
                    for i, b in enumerate(order) if not all(map(math.isfinite, values[2 * i:2 * i + 2]))}
        attributed = bool(culprits) and (len(culprits) < len(order) or len(order) == 1)
        if not attributed:
            culprits = {b.device_id: "the group's step was not finite and no member's own results showed whose "
                                     "activations caused it" for b in order}
        self._zero_grad()
        if self._buffers:
            torch._foreach_copy_(self._buffers, self._saved_buffers)
        raise NonFiniteStep(culprits, attributed)

    def _shares(self, batches: list[MemberBatch]) -> tuple[dict[str, float], dict[int, float]]:
        """Each member's share of the group's data, and for each block of the portion the share
        of the members cut at or before it (:class:`GroupLoss`); without ``members``, the step's
        members in equal parts."""
        if self.members is None:
            members = {b.device_id: GroupMember(1, b.split_point) for b in batches}
            return _data_shares(members, self.start, self.end)
        left, group_shares = self._group_shares
        for b in batches:
            known = self.members.get(b.device_id)
            if known is None:
                raise ValueError(f"{b.device_id!r}: not a member of this group")
            if known.split_point != b.split_point:
                raise ValueError(f"{b.device_id!r}: split {b.split_point}, where the group has it cut at {known.split_point}")
        if group_shares is None or any(b.device_id in left for b in batches):
            # A member that left but whose batch is in this step (it left while the step was
            # formed) still counts in it.
            staying = {d: m for d, m in self.members.items() if d not in left or any(b.device_id == d for b in batches)}
            return _data_shares(staying, self.start, self.end)
        return group_shares


def _input_grad(activations: torch.Tensor) -> torch.Tensor:
    """The gradient a backward pass left on a member's activations (dfx)."""
    assert activations.grad is not None  # every member's activations feed the objective
    return activations.grad


def _data_shares(members: Mapping[str, GroupMember], start: int, n_blocks: int) -> tuple[dict[str, float], dict[int, float]]:
    """Each member's part of the members' data, and for each block ``start..n_blocks-1`` the part
    of the members cut at or before it."""
    total = sum(m.samples for m in members.values())
    block_share = {index: sum(m.samples for m in members.values() if m.split_point <= index) / total
                   for index in range(start, n_blocks)}
    return {device: m.samples / total for device, m in members.items()}, block_share
