"""The proximal term shared by the algorithms that pull local training towards the global model
(FedBC's penalty, FedProx's): the received weights frozen at the start of a round, and the squared
distance of the trained ones to them."""
from __future__ import annotations

from collections.abc import Mapping

import torch


def frozen_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of ``model``'s trainable parameters by name: the global weights it was just loaded with."""
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def proximal_penalty(model: torch.nn.Module, reference: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """||w - z||^2 over the trainable parameters named in ``reference`` (differentiable in w).

    No 1/2 in front (FedBC's penalty as its paper and code write it), so its gradient is 2 (w - z)."""
    params = dict(model.named_parameters())
    terms = [((params[name] - ref) ** 2).sum() for name, ref in reference.items()]
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).sum()
