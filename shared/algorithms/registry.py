"""Algorithms, selection policies, aggregation rules and the Main Server's split-learning plug-ins
(grouping, group loss, member defences) by name. Adding one: write its module, add one line here."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError

from shared.algorithms.base import Algorithm
from shared.algorithms.data_weighted_loss import DataWeightedLoss
from shared.algorithms.fedavg import FedAvg
from shared.algorithms.fedbc import FedBC
from shared.algorithms.fnr_fl import FNRFL
from shared.algorithms.fedipg import FedIPG
from shared.algorithms.fedprox import FedProx
from shared.algorithms.group_loss import GroupLoss, PerMemberLoss, PerMemberSumLoss, UnionMeanLoss
from shared.algorithms.grouping import BalancedGrouping, Grouping, SingletonGrouping
from shared.algorithms.hics import HiCSSelector
from shared.algorithms.member_defence import (
    ClipMembers, MedianOfMembers, MemberDefence, MemberUpdates, Standardise, TrimmedMeanOfMembers,
)
from shared.algorithms.plugin_params import params_error
from shared.algorithms.random_grouping import RandomGrouping
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


#: What a group step does against a harmful member (``RoundPlan.member_defences``; ``grouping.member_defences``).
MEMBER_DEFENCES: dict[str, type[MemberDefence]] = {
    "standardise": Standardise,
    "clip": ClipMembers,
    "median": MedianOfMembers,
    "trimmed_mean": TrimmedMeanOfMembers,
    "member_updates": MemberUpdates,
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


def build_member_defences(names: list[str], params: Mapping[str, Mapping[str, Any]],
                          group_loss: GroupLoss) -> list[MemberDefence]:
    """The member defences ``names`` (in order) with their ``params`` by name, for a group step
    under ``group_loss``. ValueError naming what does not fit: an unknown name (with the choices),
    a name given twice, a bad parameter (``grouping.member_defence_params.clip.multiple: ...``),
    parameters for a defence not named, two defences that each replace the mean, or a group loss
    that cannot give per-member weights to a defence that needs each member's own gradient."""
    if len(set(names)) != len(names):
        raise ValueError(f"grouping.member_defences names a defence twice: {names}")
    stray = sorted(set(params) - set(names))
    if stray:
        raise ValueError(f"grouping.member_defence_params has parameters for {stray}, which "
                         f"grouping.member_defences does not name")
    defences = []
    for name in names:
        cls: type[MemberDefence] = _plug_in(MEMBER_DEFENCES, "member defence", name)
        try:
            defences.append(cls(params.get(name, {})))
        except ValidationError as exc:
            raise ValueError(params_error(f"grouping.member_defence_params.{name}", cls.Params, exc)) from None
    centers = [n for n, d in zip(names, defences) if d.centers]
    if len(centers) > 1:
        raise ValueError(f"grouping.member_defences: {' and '.join(centers)} each replace the members' mean; name one")
    uploads = [n for n, d in zip(names, defences) if d.uploads_members]
    if uploads and centers:
        raise ValueError(f"grouping.member_defences: {uploads[0]} sends each member's part of the mean, which "
                         f"{centers[0]} replaces; name one of the two")
    if any(d.per_member_gradients for d in defences):
        try:
            group_loss.member_weights([torch.zeros(1)], [1.0])
        except NotImplementedError:
            raise ValueError(f"grouping.member_defences {names} work on each member's own gradient, which group loss "
                             f"{type(group_loss).__name__} cannot weigh (GroupLoss.member_weights)") from None
    return defences


def uploads_member_states(names: list[str]) -> bool:
    """Whether the member defences ``names`` have the Main Server send each member's own state of
    its group's copy (``member_updates``)."""
    classes: list[type[MemberDefence]] = [_plug_in(MEMBER_DEFENCES, "member defence", name) for name in names]
    return any(cls.uploads_members for cls in classes)


def _plug_in(table: dict[str, type], what: str, name: str) -> type:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}") from None
