"""Privacy defences: what a device does so that what it sends gives less of its data away.

In split learning a device sends the activations at its cut every step, and in U-shaped mode
(``split.u_shaped``) the gradient at its head's input too. An honest-but-curious server can rebuild
the input from the activations (a decoder trained on public data, worse the shallower the cut) and
read the labels from the gradient (its norm and direction). These plug-ins act where that data is
made: on the device, and for the privacy floor on the Fed Server's choice of cut
(docs/split-privacy.md says what each protects):

* ``floor``: the split planner never gives a device a cut shallower than ``split``
  (:class:`SplitFloor`, here): the sliding split gives the slowest devices the shallowest cut,
  which leaks most, and the floor trades their speed for privacy in the open;
* ``noise``: Gaussian noise on the activations sent, scaled to each sample's root mean square
  (:class:`ActivationNoise`, here);
* ``nopeek``: a distance-correlation penalty between the inputs and the activations in the device's
  objective (``shared/algorithms/nopeek.py``);
* ``label_noise``: U-shaped mode; the gradient sent up is computed from randomised-response labels,
  debiased (``shared/algorithms/label_noise.py``).

A run names any of them, in order, in ``split_privacy.defences`` with their parameters in
``split_privacy.defence_params.<name>``; devices learn them from the run (``RunInfo.privacy``). Adding one
is a :class:`PrivacyDefence` subclass and one line in ``PRIVACY_DEFENCES``
(``shared/algorithms/registry.py``; docs/extending.md).

Randomness on the device comes from a generator the device seeds from the operating system's
entropy (:func:`private_generator`), never from the run's seed, which the servers know: noise they
could replay would hide nothing.
"""
from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field


def private_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the operating system's entropy, on ``device``: draws the servers
    cannot replay."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


class PrivacyDefenceParams(BaseModel):
    """A defence's parameters (``split_privacy.defence_params.<name>``); none by default."""

    model_config = ConfigDict(extra="forbid")


class PrivacyDefence:
    """A defence's hooks; the base changes nothing. Stateless but for its parameters."""

    Params: ClassVar[type[PrivacyDefenceParams]] = PrivacyDefenceParams

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self.params = self.Params.model_validate(dict(params or {}))

    def problem(self, u_shaped: bool, loss: str) -> str | None:
        """Why the defence cannot run in this run (``u_shaped``: ``split.u_shaped``; ``loss``:
        ``train.loss``), in one line, or None."""
        return None

    def split_points(self, points: Sequence[int]) -> list[int]:
        """Fed Server: the cuts the split planner may give a device, of ``points`` (ascending)."""
        return list(points)

    def activation_penalty(self, x: torch.Tensor, fx: torch.Tensor) -> torch.Tensor | None:
        """Device: a term added to the device's objective for a batch ``x`` and its activations
        ``fx`` at the cut (differentiable in ``fx``), or None."""
        return None

    def sent_activations(self, fx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Device: the activations sent in place of ``fx`` (detached); the returned gradient
        is applied to ``fx`` as it is (additive noise passes it through)."""
        return fx

    def gradient_targets(self, targets: torch.Tensor, num_classes: int,
                         generator: torch.Generator) -> torch.Tensor:
        """Device, U-shaped mode: the targets the gradient sent up is computed from, given the
        ones it would be computed from (class labels ``[B]``, or class probabilities ``[B, C]``
        where an earlier defence made them). The device's own head trains on the true labels."""
        return targets


class SplitFloorParams(PrivacyDefenceParams):
    split: int = Field(ge=1)


class SplitFloor(PrivacyDefence):
    """``floor``: no cut shallower than ``split`` blocks on the device."""

    Params = SplitFloorParams

    def split_points(self, points: Sequence[int]) -> list[int]:
        params = self.params
        assert isinstance(params, SplitFloorParams)
        return [k for k in points if k >= params.split]


class ActivationNoiseParams(PrivacyDefenceParams):
    scale: float = Field(0.5, gt=0, allow_inf_nan=False)


class ActivationNoise(PrivacyDefence):
    """``noise``: each sample's activations plus Gaussian noise of standard deviation ``scale``
    times their root mean square (so the noise keeps its proportion to the signal however the
    activations grow during training)."""

    Params = ActivationNoiseParams

    def sent_activations(self, fx: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        params = self.params
        assert isinstance(params, ActivationNoiseParams)
        flat = fx.detach().flatten(1)
        rms = flat.pow(2).mean(dim=1).sqrt().view(-1, *([1] * (fx.dim() - 1)))
        noise = torch.randn(fx.shape, generator=generator, device=fx.device, dtype=fx.dtype)
        return fx.detach() + noise * rms * params.scale
