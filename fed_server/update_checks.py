"""Checks on a device's upload before it is accepted: its claims (sample count, timings) and the
size of its update. What a device may still do within these bounds: docs/security.md."""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from shared.errors import Invalid
from shared.schemas import DeviceTimings, UpdateRequest


def table_time(timings: DeviceTimings) -> float:
    """The time-table value of one device round: Eq. 1's terms, each measured.

    Client compute + transfer + the server-side training of the device's steps. Not included:
    waiting at the group barrier for slower members (not the device's own cost) and the
    host-process overhead between those sections, which on a testbed with many virtual devices in
    one Python process is mostly interpreter contention, a cost no real device has.
    """
    return max(1e-6, timings.compute_s + timings.transfer_s + timings.server_s)


#: Largest training loss an upload may report (either sign). Far above any loss of a training
#: that has not diverged; small enough that the round record's sample-weighted mean stays finite
#: (a reported 1e308 made it infinite, and ``/v1/status`` could no longer be encoded as JSON).
MAX_TRAIN_LOSS = 1e12


def check_claims(req: UpdateRequest, registered_samples: int, deadline_s: float) -> None:
    """Refuse (:class:`Invalid`) an upload whose claims the Fed Server knows to be impossible.

    * ``num_samples`` is the device's aggregation weight, so it must be the count the device
      registered with: a device cannot outweigh the others by claiming more data in one upload.
    * Every timing, and the time-table sum of :func:`table_time`, must fit in the round's
      deadline: an upload arrives before the attempt closes, so the device cannot have spent longer.
      Each figure alone may be finite and still overflow the sum (``1e308 + 1e308``).
    * ``train_loss`` lies within ``±MAX_TRAIN_LOSS``.
    """
    device_id, timings = req.device_id, req.timings
    if req.num_samples != registered_samples:
        raise Invalid(f"num_samples={req.num_samples} of {device_id!r} differs from the {registered_samples} "
                      f"samples it registered with")
    for name, value in timings.model_dump().items():
        if value > deadline_s:
            raise Invalid(f"timings.{name}={value:.4g}s of {device_id!r} exceeds the round deadline of {deadline_s:g}s")
    total = table_time(timings)
    if total > deadline_s:
        raise Invalid(f"timings compute_s + transfer_s + server_s = {total:.4g}s of {device_id!r} exceeds "
                      f"the round deadline of {deadline_s:g}s")
    if abs(req.train_loss) > MAX_TRAIN_LOSS:
        raise Invalid(f"train_loss={req.train_loss:.4g} of {device_id!r} is beyond ±{MAX_TRAIN_LOSS:g}")


def update_norm(state: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``state - global_state`` over the floating-point entries ``state`` holds."""
    total = 0.0
    for key, value in state.items():
        if value.is_floating_point():
            total += float((value.double() - global_state[key].double()).pow(2).sum())
    return math.sqrt(total)


def clip_update(state: Mapping[str, torch.Tensor], global_state: Mapping[str, torch.Tensor],
                max_norm: float, norm: float | None = None) -> dict[str, torch.Tensor]:
    """``global + (state - global) * min(1, max_norm / norm)``: the update scaled into the norm ball.
    ``norm``: the update's norm when the caller has already computed it."""
    norm = update_norm(state, global_state) if norm is None else norm
    if norm <= max_norm:
        return dict(state)
    scale = max_norm / norm
    return {key: (global_state[key] + (value - global_state[key]) * scale).to(value.dtype)
            if value.is_floating_point() else value for key, value in state.items()}
