"""Layer-wise aggregation of the Fed Server (S2FL paper, Algorithm 1).

Devices are cut at different layers, so plain FedAvg does not apply: for every layer of the
full model W, each participating device i contributes exactly once, through its own uploaded
client portion ``Wc_i`` if that portion holds the layer, otherwise through the server-side copy
``Ws_group(i)`` of its data-balance group; the weight is the device's data size ``|D_i|``::

    W[layer] = sum_i |D_i| * (Wc_i[layer] if layer in Wc_i else Ws_group(i)[layer]) / sum_i |D_i|

(the sum running over the devices that supplied the layer).

Decisions where the paper is silent:

* a key that no contribution supplies keeps the global value (returned as a clone);
* floating tensors are averaged in float64 and cast back to the global dtype; integer/bool
  tensors (e.g. BatchNorm ``num_batches_tracked``) get the weighted average rounded to the
  nearest integer (``torch.round``, half to even);
* keys in a contribution that the global state does not have are an error (they would mean a
  naming mismatch that silently turns aggregation into a no-op).

FedAvg is the special case where every ``client_state`` holds every key.

This is the ``mean`` aggregation rule; the other rules and the bounds on weights and updates
(``RunConfig.aggregation``) are in ``shared/algorithms/robust_aggregation.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Contribution", "check_contributions", "check_state", "layerwise_aggregate"]


@dataclass
class Contribution:
    """One participating device's share in Algorithm 1.

    ``weight`` is ``|D_i|``; ``client_state`` the device's uploaded client portion and
    ``server_state`` the server-side copy of the device's group (``None`` for split depth
    zero). Keys in both are full-model ``state_dict`` keys; the client portion wins on overlap.

    ``key_weights``, where given, replaces ``weight`` key by key: a contribution that stands for
    several devices, each key with their summed weight (the mean of a private round's clipped
    updates, whose holders differ from block to block: ``fed_server/aggregation.py``).
    """

    weight: float
    client_state: Mapping[str, torch.Tensor]
    server_state: Mapping[str, torch.Tensor] | None = None
    key_weights: Mapping[str, float] | None = None

    def weight_of(self, key: str) -> float:
        """The contribution's weight for ``key``."""
        return float(self.key_weights[key] if self.key_weights is not None else self.weight)


def check_state(global_state: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], what: str) -> None:
    """ValueError naming ``what`` and the key unless every key of ``state`` is in ``global_state``
    with the same shape (a naming mismatch would silently turn aggregation into a no-op)."""
    for key, value in state.items():
        if key not in global_state:
            raise ValueError(f"{what} key {key!r} is not in the global state")
        if tuple(value.shape) != tuple(global_state[key].shape):
            raise ValueError(f"{what}[{key!r}] has shape {tuple(value.shape)}, "
                             f"global shape is {tuple(global_state[key].shape)}")


def check_contributions(global_state: Mapping[str, torch.Tensor], contributions: Sequence[Contribution]) -> None:
    """ValueError unless there is a contribution and each has a finite weight > 0 and only keys of
    ``global_state`` with its shapes (every aggregation rule's precondition)."""
    if len(contributions) == 0:
        raise ValueError("layerwise_aggregate needs at least one contribution")
    for idx, contrib in enumerate(contributions):
        for w in [float(contrib.weight), *map(float, (contrib.key_weights or {}).values())]:
            if not math.isfinite(w) or w <= 0.0:
                raise ValueError(f"contribution {idx}: weight must be finite and > 0, got {w}")
        for part_name, part in (("client_state", contrib.client_state), ("server_state", contrib.server_state)):
            if part is not None:
                check_state(global_state, part, f"contribution {idx}: {part_name}")


def layerwise_aggregate(
    global_state: Mapping[str, torch.Tensor], contributions: Sequence[Contribution]
) -> dict[str, torch.Tensor]:
    """Algorithm 1: per-key ``|D_i|``-weighted average over the devices that supply the key.

    Returns a new state dict with the keys of ``global_state`` in its order; results live on
    the global tensor's device with its dtype. Raises ``ValueError`` for no contributions, a
    non-positive / non-finite weight, a shape mismatch (naming the key) or an unknown key.
    """
    check_contributions(global_state, contributions)
    # The float64 sums live in two scratch buffers per device the model's tensors are on, sized
    # for the largest tensor and reused for every key: a fresh product and sum per contribution
    # and key took fresh memory, its pages faulted in each time (measured:
    # benchmarks/why-the-code-is-as-it-is.md, "Layer-wise aggregation sums"). The arithmetic is
    # the same, operation for operation (convert to float64, multiply by the weight, add,
    # divide), so the result is bit for bit that of a fresh product and sum.
    scratch: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    largest = max((g.numel() for g in global_state.values()), default=0)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, g in global_state.items():
            if g.device not in scratch:
                scratch[g.device] = (torch.empty(largest, dtype=torch.float64, device=g.device),
                                     torch.empty(largest, dtype=torch.float64, device=g.device))
            acc_buffer, term_buffer = scratch[g.device]
            acc = acc_buffer[:g.numel()].view(g.shape)
            term = term_buffer[:g.numel()].view(g.shape)
            total_w = 0.0
            supplied = False
            for contrib in contributions:
                if key in contrib.client_state:
                    value = contrib.client_state[key]
                elif contrib.server_state is not None and key in contrib.server_state:
                    value = contrib.server_state[key]
                else:
                    continue
                w = contrib.weight_of(key)
                target = term if supplied else acc
                target.copy_(value)
                target.mul_(w)
                if supplied:
                    acc.add_(term)
                supplied = True
                total_w += w
            if not supplied:
                out[key] = g.detach().clone()
                continue
            acc.div_(total_w)
            out[key] = acc.to(g.dtype) if g.is_floating_point() else acc.round_().to(g.dtype)
    return out
