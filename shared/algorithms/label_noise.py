"""``label_noise``: U-shaped mode; the gradient a device sends up is computed from noised labels.

In U-shaped mode the labels stay on the device, but the gradient it sends up at its head's input
gives them away: for a linear head ``W`` and cross-entropy it is ``W^T (p - e_y) / B`` per sample,
and its direction (or its likeness to a known sample's) names the class (ExPLoit, arXiv
2112.01299; similarity-based label inference, arXiv 2203.05222). Marvell's noise is designed for two
classes; this defence instead makes what the server sees label-differentially private (Ghazi et
al., "Deep learning with label differential privacy", arXiv 2102.06062): each sample's label is
replaced by randomised response with parameter ``epsilon`` (kept with probability
``e^eps / (e^eps + C - 1)``, else one of the other ``C - 1`` classes uniformly), and the one-hot
vector of the drawn class is debiased, ``(e_r - q) / (p - q)``, so its expectation is the true
one-hot vector. The sent gradient is that of cross-entropy against these targets: unbiased for the
Main Server's middle and the device's front, noisier the smaller ``epsilon``. Whatever the server
computes from it is ``epsilon``-label-differentially private for each sample, since the gradient
depends on the label only through the drawn class (a head without batch normalisation, as the
built-in models' heads). The device's own head trains on the true labels.
"""
from __future__ import annotations

import math

import torch
from pydantic import Field

from shared.algorithms.privacy_defence import PrivacyDefence, PrivacyDefenceParams


def randomised_response_targets(labels: torch.Tensor, num_classes: int, epsilon: float,
                                 generator: torch.Generator) -> torch.Tensor:
    """Debiased one-hot targets ``[B, C]`` of ``labels`` after randomised response at ``epsilon``:
    each row's expectation is the label's one-hot vector, and each row sums to 1."""
    keep = math.exp(epsilon) / (math.exp(epsilon) + num_classes - 1)
    other = 1.0 / (math.exp(epsilon) + num_classes - 1)
    labels = labels.long()
    kept = torch.rand(labels.shape, generator=generator, device=labels.device) < keep
    # Another class, uniformly: the label plus 1..C-1, modulo C.
    shift = torch.randint(1, num_classes, labels.shape, generator=generator, device=labels.device)
    drawn = torch.where(kept, labels, (labels + shift) % num_classes)
    onehot = torch.nn.functional.one_hot(drawn, num_classes).to(torch.float32)
    return (onehot - other) / (keep - other)


class LabelNoiseParams(PrivacyDefenceParams):
    epsilon: float = Field(2.0, gt=0, allow_inf_nan=False)


class LabelNoise(PrivacyDefence):
    """``label_noise``: the gradient sent up from randomised-response labels at ``epsilon``, debiased."""

    Params = LabelNoiseParams

    def problem(self, u_shaped: bool, loss: str) -> str | None:
        if not u_shaped:
            return "label_noise protects the gradient a U-shaped device sends up: set split.u_shaped: true"
        if loss != "cross_entropy":
            return f"label_noise computes the sent gradient with cross-entropy against soft targets; train.loss is {loss!r}"
        return None

    def gradient_targets(self, targets: torch.Tensor, num_classes: int,
                         generator: torch.Generator) -> torch.Tensor:
        params = self.params
        assert isinstance(params, LabelNoiseParams)
        if targets.dim() != 1:
            raise ValueError("label_noise draws from class labels: name it before any defence that changes them")
        return randomised_response_targets(targets, num_classes, params.epsilon, generator)
