"""FedProx (Li et al., "Federated Optimization in Heterogeneous Networks", MLSys 2020).

FedAvg whose devices minimise ``F_k(w) + (mu / 2) ||w - w^t||^2`` over their local steps, ``w^t``
the global model they received: the proximal term keeps a device's local training near the
global model when devices' data or amounts of work differ. The Fed Server aggregates as FedAvg
does (the configured aggregation rule). Split depth zero.

Not one of the five papers this project is built on: it is the worked example of adding an
algorithm (docs/extending.md), one module and one line in ``shared/algorithms/registry.py``. Left
as the paper leaves it open: ``mu`` is fixed for the run (the paper also tries adapting it), and
every device runs the run's ``train.local_epochs`` (the paper also lets devices do less work,
its "inexact" solutions).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import Field

from shared.algorithms.base import Algorithm, AlgorithmParams, DeviceLogic, Payload
from shared.algorithms.proximal import frozen_parameters, proximal_penalty

if TYPE_CHECKING:
    from shared.data import ArrayDataset


class FedProxParams(AlgorithmParams):
    """``algorithm_params`` of FedProx."""

    #: The proximal weight mu (the paper tries 0.001 to 1); 0 is FedAvg.
    mu: float = Field(0.01, ge=0, allow_inf_nan=False)


class FedProxLogic(DeviceLogic):
    """Device side: the run's loss (cross-entropy by default) plus (mu / 2) ||w - w^t||^2 against the
    weights the round began with."""

    def begin_round(self, model: torch.nn.Module, extras: Payload, data: "ArrayDataset") -> None:
        self.mu = FedProxParams.model_validate(self.params).mu
        self.reference = frozen_parameters(model)

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ce = self.criterion.mean(model(x), y)
        return ce if self.mu == 0.0 else ce + 0.5 * self.mu * proximal_penalty(model, self.reference)


class FedProx(Algorithm):
    """Fed Server side: FedAvg's (the base class's defaults), with the proximal weight sent to the devices."""

    Params = FedProxParams
    Logic = FedProxLogic
