"""Algorithms, selection policies, aggregation rules and the Main Server's split-learning plug-ins
(grouping, group loss) by name. Adding one: write its module, add one line here."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import ValidationError

from shared.algorithms.base import Algorithm
from shared.algorithms.data_weighted_loss import DataWeightedLoss
from shared.algorithms.fedavg import FedAvg
from shared.algorithms.fedbc import FedBC
from shared.algorithms.fnr_fl import FNRFL
from shared.algorithms.fedipg import FedIPG
from shared.algorithms.fedopt import FedAdagrad, FedAdam, FedYogi
from shared.algorithms.fedprox import FedProx
from shared.algorithms.group_loss import GroupLoss, PerMemberLoss, PerMemberSumLoss, UnionMeanLoss
from shared.algorithms.grouping import BalancedGrouping, Grouping, SingletonGrouping
from shared.algorithms.hics import HiCSSelector
from shared.algorithms.random_grouping import RandomGrouping
from shared.algorithms.scaffold import Scaffold
from shared.algorithms.split_point_grouping import SplitPointGrouping
from shared.algorithms.robust_aggregation import (
    AggregationRule, BoundedMean, Krum, Mean, Median, MultiKrum, TrimmedMean, rule_params_error,
)
from shared.algorithms.selection import DeviceSelector
from shared.algorithms.split_learning import S2FL, SFL

if TYPE_CHECKING:
    from shared.config import RunConfig
    from shared.losses import Loss

ALGORITHMS: dict[str, type[Algorithm]] = {
    "s2fl": S2FL,
    "sfl": SFL,
    "fedavg": FedAvg,
    "fedbc": FedBC,
    "fnr-fl": FNRFL,
    "fedipg": FedIPG,
    "fedprox": FedProx,
    "scaffold": Scaffold,
    "fedadagrad": FedAdagrad,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
}


SELECTORS: dict[str, type[DeviceSelector]] = {
    "random": DeviceSelector,
    "hics": HiCSSelector,
}


#: How the Fed Server combines a round's uploads (``aggregation.rule``; docs/configuration.md, ``aggregation.*``).
AGGREGATION_RULES: dict[str, type[AggregationRule]] = {
    "bounded_mean": BoundedMean,
    "mean": Mean,
    "median": Median,
    "trimmed_mean": TrimmedMean,
    "krum": Krum,
    "multi_krum": MultiKrum,
}


#: How the Main Server groups a round's devices (``RoundPlan.grouping``; ``grouping.method``).
GROUPINGS: dict[str, type[Grouping]] = {
    "balanced": BalancedGrouping,
    "singleton": SingletonGrouping,
    "random": RandomGrouping,
    "split_point": SplitPointGrouping,
}


#: How a group step combines its members' losses (``RoundPlan.group_loss``; ``grouping.group_loss``).
GROUP_LOSSES: dict[str, type[GroupLoss]] = {
    "per_member": PerMemberLoss,
    "per_member_sum": PerMemberSumLoss,
    "union_mean": UnionMeanLoss,
    "data_weighted": DataWeightedLoss,
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


def build_aggregation_rule(config: "RunConfig") -> AggregationRule:
    """The configured aggregation rule; ValueError names an unknown rule (with the choices) or
    each bad parameter (``aggregation.params.clip: ...``)."""
    rule = _plug_in(AGGREGATION_RULES, "aggregation rule", config.aggregation.rule)
    try:
        return rule(config.aggregation.params)
    except ValidationError as exc:   # a plain ValueError: the config loader prints it as it is
        raise ValueError(rule_params_error(rule, exc)) from None


def build_grouping(name: str) -> Grouping:
    """The grouping plug-in registered as ``name`` (ValueError naming the choices if none is)."""
    return _plug_in(GROUPINGS, "grouping", name)()


def build_group_loss(name: str, criterion: "Loss | None" = None) -> GroupLoss:
    """The group-loss plug-in registered as ``name``, combining members' losses of ``criterion``
    (the run's loss; None: cross-entropy). ValueError naming the choices if no plug-in is."""
    return _plug_in(GROUP_LOSSES, "group_loss", name)(criterion)


def _plug_in(table: dict[str, type], what: str, name: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None
