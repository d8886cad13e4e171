"""What a round plan builds at the Main Server before the round opens: its model template and its
server-side weights, each refused (Invalid) when the plan may not or cannot ask for it."""
from __future__ import annotations

import logging

import torch

from shared.errors import Invalid
from shared.models import SplitModel, build_model_layout, check_model_origin
from shared.portions import decode_portion
from shared.round_label import round_label
from shared.schemas import RoundPlan
from shared.wire import WireError

log = logging.getLogger("main_server")


def plan_model(plan: RoundPlan, model_ref: str | None) -> SplitModel:
    """The plan's model as a template, its structure only (on the meta device: no memory, no
    initial weights; each group's copy allocates its own portion, :class:`GroupTrainer`): Invalid
    for a model the plan may not name (an import path is code: built only when the operator named
    it, ``--model``, never because a plan did; docs/security.md) or that cannot be built as the plan
    asks (unknown, a bad input_shape or num_classes: the plan's fault, not ours)."""
    try:
        check_model_origin(plan.model, model_ref)
        return build_model_layout(plan.model, plan.num_classes, tuple(plan.input_shape), seed=plan.seed,
                                  params=plan.model_params)
    except ValueError as exc:
        log.error("refusing the plan of %s: %s", round_label(plan.round_index, plan.round_id), exc)
        raise Invalid(f"invalid plan: {exc}") from None


def server_weights(plan: RoundPlan, template: SplitModel) -> tuple[int, dict[str, torch.Tensor]]:
    """The first server-side block (the smallest split point) and the plan's server weights from
    there to the end (U-shaped: to the devices' head start), decoded against ``template``; Invalid
    for a split point that leaves no server portion or weights that do not fit."""
    n_blocks = len(template.blocks)
    end = n_blocks if plan.head_start is None else plan.head_start
    if end > n_blocks:
        raise Invalid(f"head_start {end} is beyond the model's {n_blocks} blocks")
    for p in plan.participants:
        if p.split_point >= end:
            raise Invalid(f"{p.device_id}: split point {p.split_point} leaves no server portion (" +
                          (f"model has {n_blocks} blocks)" if plan.head_start is None else f"the head starts at block {end})"))
    start = min(p.split_point for p in plan.participants)
    try:
        return start, decode_portion(plan.server_weights, template, start, end, what="server_weights")
    except WireError as exc:
        raise Invalid(str(exc)) from None
