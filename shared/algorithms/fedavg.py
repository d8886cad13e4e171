"""FedAvg: split depth zero, data-size-weighted average of whole models."""
from __future__ import annotations

from shared.algorithms.base import Algorithm


class FedAvg(Algorithm):
    """The base class's defaults are exactly FedAvg: the configured selection (uniformly random by
    default), whole model on the device, cross-entropy, data-size-weighted average (Algorithm 1
    with every layer supplied by the devices)."""

