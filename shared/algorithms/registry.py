"""Algorithms and selection policies by name. Adding one: write its module, add one line here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from shared.algorithms.base import Algorithm
from shared.algorithms.fedavg import FedAvg
from shared.algorithms.fedbc import FedBC
from shared.algorithms.fnr_fl import FNRFL
from shared.algorithms.fedipg import FedIPG
from shared.algorithms.hics import HiCSSelector
from shared.algorithms.selection import DeviceSelector
from shared.algorithms.split_learning import S2FL, SFL

if TYPE_CHECKING:
    from shared.config import RunConfig

ALGORITHMS: dict[str, type[Algorithm]] = {
    "s2fl": S2FL,
    "sfl": SFL,
    "fedavg": FedAvg,
    "fedbc": FedBC,
    "fnr-fl": FNRFL,
    "fedipg": FedIPG,
}


SELECTORS: dict[str, type[DeviceSelector]] = {
    "random": DeviceSelector,
    "hics": HiCSSelector,
}


def build_algorithm(config: "RunConfig") -> Algorithm:
    """The configured algorithm object."""
    try:
        return ALGORITHMS[config.algorithm](config)
    except KeyError:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; choose one of {sorted(ALGORITHMS)}") from None


def build_selector(config: "RunConfig", output_layer: str | None = None) -> DeviceSelector:
    """The configured device selection policy (``output_layer``: the model's, for HiCS-FL)."""
    try:
        return SELECTORS[config.selection](config, output_layer)
    except KeyError:
        raise ValueError(f"unknown selection {config.selection!r}; choose one of {sorted(SELECTORS)}") from None
