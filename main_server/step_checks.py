"""What a step a device sends the Main Server must be before it joins its group's batch: its
activations and labels decode to the shapes the round's model expects at the sender's split point
(:meth:`StepChecks.decode_batch`; in U-shaped mode the activations alone,
:meth:`StepChecks.decode_forward`, and later the gradient at the middle's output,
:meth:`StepChecks.decode_gradient`), and their values can do no harm to the copy every member
trains (:meth:`StepChecks.harmful_values`). Nothing here changes any state."""
from __future__ import annotations

import math

import torch

from main_server.group_trainer import MemberBatch
from shared.errors import Invalid
from shared.models import SplitModel
from shared.schemas import BackwardRequest, ForwardRequest, RoundPlan, StepRequest, WireTensor
from shared.torch_device import model_device
from shared.wire import WireError, decode_tensor


def activation_shapes(template: SplitModel, input_shape: list[int]) -> dict[int, tuple[int, ...]]:
    """The activation shape (less the batch) entering each block of ``template``, by block index:
    what a device cut after that many blocks sends."""
    x = torch.zeros(1, *input_shape, device=model_device(template))   # the meta device: shapes only
    template.eval()
    shapes: dict[int, tuple[int, ...]] = {}
    with torch.no_grad():
        h = x
        for k in range(len(template.blocks)):
            shapes[k] = tuple(h.shape[1:])
            h = template.forward_blocks(h, k, k + 1)
    return shapes


class StepChecks:
    """The checks of one round's steps, against its ``plan`` (batch size, activation bound,
    classes) and its model ``template`` (the activation shapes at every split point)."""

    def __init__(self, plan: RoundPlan, template: SplitModel) -> None:
        self.plan = plan
        # Class labels int64 [B]; a regression task's targets float32 [B] (one model output) or
        # [B, outputs] (docs/wire-format.md).
        self.regression = plan.train.resolved_task == "regression"
        self.label_dtype = "float32" if self.regression else "int64"
        self.label_tail = [] if not self.regression or plan.num_classes == 1 else [plan.num_classes]
        # build_model has run one sample through the blocks: an input_shape the model cannot take
        # (too small for its pooling) was refused before.
        self.activation_shapes = activation_shapes(template, plan.input_shape)

    def decode_batch(self, req: StepRequest, split_point: int) -> MemberBatch:
        """The step's activations and labels, Invalid unless they decode and fit the group's batch
        at ``split_point``: fx float32 or float16 of shape [B, the activation shape there] with
        1 <= B <= the batch size, labels int64 of shape [B] (regression: float32 targets [B] or
        [B, outputs]). A U-shaped round takes no labels: Invalid, before they are decoded."""
        if self.plan.head_start is not None:
            raise Invalid("this round is U-shaped: labels stay on the device; send the activations to the "
                          "step's forward half and the head's gradient to its backward half")
        fx = self._activations(req.fx, split_point)
        try:
            labels = decode_tensor(req.labels, expect_dtype=self.label_dtype, what="labels")   # targets: finite
        except WireError as exc:
            raise Invalid(str(exc)) from None
        if list(labels.shape) != [fx.shape[0], *self.label_tail]:
            raise Invalid(f"labels: shape {list(labels.shape)} where {[fx.shape[0], *self.label_tail]} was expected")
        return MemberBatch(req.device_id, split_point, fx, labels)

    def decode_forward(self, req: ForwardRequest, split_point: int) -> MemberBatch:
        """A U-shaped step's activations, as :meth:`decode_batch` checks them; Invalid in a round
        whose Main Server computes the loss (it needs the labels)."""
        if self.plan.head_start is None:
            raise Invalid("this round is not U-shaped: the Main Server computes the loss, so a step sends its "
                          "activations with their labels")
        return MemberBatch(req.device_id, split_point, self._activations(req.fx, split_point))

    def decode_gradient(self, req: BackwardRequest, rows: int) -> torch.Tensor:
        """A U-shaped step's gradient at the middle's output, Invalid unless it is float32 or
        float16, finite, and shaped as the member's ``rows`` of that output."""
        assert self.plan.head_start is not None
        try:
            gradient = decode_tensor(req.gradient, what="gradient")   # finite
        except WireError as exc:
            raise Invalid(str(exc)) from None
        if gradient.dtype not in (torch.float32, torch.float16):
            raise Invalid(f"gradient: dtype {req.gradient.dtype} where float32 or float16 was expected")
        expected = [rows, *self.activation_shapes[self.plan.head_start]]
        if list(gradient.shape) != expected:
            raise Invalid(f"gradient: shape {list(gradient.shape)} where {expected} (the member's rows of the "
                          f"middle's output) was expected")
        return gradient

    def _activations(self, wire: WireTensor, split_point: int) -> torch.Tensor:
        """A step's activations, Invalid unless float32 or float16 of shape [B, the activation
        shape at ``split_point``] with 1 <= B <= the batch size (their values: :meth:`harmful_values`)."""
        try:
            # finiteness with the magnitude, in harmful_values' one pass
            fx = decode_tensor(wire, require_finite=False, what="fx")
        except WireError as exc:
            raise Invalid(str(exc)) from None
        if fx.dtype not in (torch.float32, torch.float16):
            raise Invalid(f"fx: dtype {wire.dtype} where float32 or float16 was expected")
        expected_tail = self.activation_shapes[split_point]
        batch = fx.shape[0] if fx.dim() else 0
        if tuple(fx.shape[1:]) != expected_tail or not 1 <= batch <= self.plan.train.batch_size:
            raise Invalid(f"fx: shape {list(fx.shape)} where [B, {', '.join(map(str, expected_tail))}] "
                          f"with 1 <= B <= {self.plan.train.batch_size} was expected for split point {split_point}")
        return fx

    def harmful_values(self, batch: MemberBatch) -> str | None:
        """Why a well-formed step's values must not join the group batch, or None: activations
        that are not finite or exceed ``max_activation`` in magnitude (one such member's
        activations, joined into the batch, swamp or poison the copy every member trains), or
        labels outside the model's classes (a regression task's targets were checked finite when
        decoded). One pass over each tensor (``torch.aminmax``)."""
        lowest, highest = (v.item() for v in torch.aminmax(batch.fx))   # NaN propagates to both
        if not (math.isfinite(lowest) and math.isfinite(highest)):
            return "fx: contains NaN or Inf"
        peak = max(-lowest, highest)
        if peak > self.plan.max_activation:
            return f"fx: |activation| up to {peak:.3g}, beyond the bound {self.plan.max_activation:g} (grouping.max_activation)"
        if self.regression or batch.labels is None:
            return None
        low_label, high_label = torch.aminmax(batch.labels)   # batch >= 1 here; both bounds in one torch call
        if int(low_label) < 0 or int(high_label) >= self.plan.num_classes:
            return f"labels: values must lie in [0, {self.plan.num_classes})"
        return None
