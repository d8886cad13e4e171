"""``nopeek``: a distance-correlation penalty between a device's inputs and the activations it sends.

NoPeek (Vepakomma et al., "NoPeek: Information leakage reduction to share activations in
distributed deep learning", arXiv 2008.09161) adds ``weight * DCOR(X, Z)`` to the device's
objective, where ``X`` is a batch of inputs and ``Z`` the activations at the cut: the front learns
activations whose pairwise distances say less about the inputs', so a decoder has less to invert.
The penalty is computed on the device, per batch, and its gradient is added to the one the Main
Server sends back (nothing of it travels). A choice the paper leaves open: the sample distance
correlation of Székely et al., unsquared, on each sample flattened; a tiny constant under each
square root keeps the gradient finite at zero distance (a sample with itself).
"""
from __future__ import annotations

import torch
from pydantic import Field

from shared.algorithms.privacy_defence import PrivacyDefence, PrivacyDefenceParams

#: Added under every square root: the gradient of a distance is infinite at zero.
_TINY = 1e-12


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    """The double-centred matrix of the Euclidean distances between the rows of ``x`` (flattened)."""
    flat = x.flatten(1)
    squared = flat.pow(2).sum(dim=1)
    d2 = (squared[:, None] + squared[None, :] - 2.0 * flat @ flat.T).clamp_min(0.0)
    d = (d2 + _TINY).sqrt()
    return d - d.mean(dim=0, keepdim=True) - d.mean(dim=1, keepdim=True) + d.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """The sample distance correlation of the rows of ``x`` and ``z`` (same batch size), in [0, 1]:
    0 for independent samples, 1 for distances in proportion."""
    a, b = _centred_distances(x), _centred_distances(z)
    covariance = (a * b).mean()
    variances = (a * a).mean() * (b * b).mean()
    return (covariance.clamp_min(0.0) + _TINY).sqrt() / (variances + _TINY).pow(0.25)


class NoPeekParams(PrivacyDefenceParams):
    weight: float = Field(0.5, gt=0, allow_inf_nan=False)


class NoPeek(PrivacyDefence):
    """``nopeek``: ``weight`` x the distance correlation of the batch's inputs and activations."""

    Params = NoPeekParams

    def activation_penalty(self, x: torch.Tensor, fx: torch.Tensor) -> torch.Tensor | None:
        params = self.params
        assert isinstance(params, NoPeekParams)
        if x.shape[0] < 2:   # one sample has no distances
            return None
        return params.weight * distance_correlation(x.to(fx.dtype), fx)
