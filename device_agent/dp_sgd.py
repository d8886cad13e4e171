"""Sample-level DP-SGD on a device's trained blocks (``train.dp_sgd``; docs/privacy.md, "Sample-level
DP-SGD"): Opacus's per-sample gradients and its DP optimizer around the round's SGD optimizer.

Opacus computes each sample's gradient with hooks on the trained layers (``GradSampleModule``),
from each layer's input and the gradient at its output. That is the same in a whole-model round,
where the device backpropagates its own loss, and in a split round, where the gradient at the cut
(dfx) comes from the Main Server: per-sample gradients come through dfx. ``DPOptimizer`` then
clips each sample's gradient (over all the trained parameters together) to ``max_grad_norm``, sums
them, adds Gaussian noise of ``noise_multiplier`` x ``max_grad_norm`` drawn from the device's
private generator (seeded from the operating system's entropy, never from the run's seed, which
the servers know), and divides by the batch size before the SGD step. Gradients are of a batch's
mean loss (``loss_reduction="mean"``): a split round's dfx is the gradient of the Main Server's
mean over the batch, and Opacus scales it back to each sample's.

Opacus's backward hooks wrap each trained layer's output, which an in-place activation after it
(``ReLU(inplace=True)``, as in the built-in ``cnn``) may not modify: while a round trains
privately its layers compute out of place (the same values; the flag is restored afterwards).
"""
from __future__ import annotations

import torch

from shared.config import DpSgdConfig
from shared.privacy.accountant import require_opacus


class PrivateSteps:
    """One round's DP-SGD: ``module``'s per-sample gradients and ``optimizer`` wrapped to clip and
    noise them (:attr:`optimizer`); :meth:`close` removes Opacus's hooks and per-sample gradients,
    so that the module's ``state_dict`` and later rounds are as without it."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, terms: DpSgdConfig,
                 batch_size: int, generator: torch.Generator) -> None:
        """ValueError in one line where Opacus is not installed on the device, or cannot compute
        per-sample gradients of one of ``module``'s layers."""
        require_opacus("this run trains with DP-SGD (train.dp_sgd), which needs Opacus on the device")
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self._in_place = [m for m in module.modules() if getattr(m, "inplace", False) is True]
        for layer in self._in_place:
            setattr(layer, "inplace", False)   # a plain attribute; Module.__setattr__ is typed for tensors and modules
        try:
            self._module = GradSampleModule(module, batch_first=True, loss_reduction="mean", strict=True)
        except NotImplementedError as exc:
            self._restore()
            raise ValueError(f"train.dp_sgd: Opacus cannot compute per-sample gradients here: {exc}") from None
        self.optimizer: torch.optim.Optimizer = DPOptimizer(
            optimizer, noise_multiplier=terms.noise_multiplier, max_grad_norm=terms.max_grad_norm,
            expected_batch_size=batch_size, loss_reduction="mean", generator=generator)

    def close(self) -> None:
        """Remove the hooks and every attribute Opacus added to the parameters; layers compute in
        place again where they did."""
        self._module.cleanup()
        self._restore()

    def _restore(self) -> None:
        for layer in self._in_place:
            setattr(layer, "inplace", True)
