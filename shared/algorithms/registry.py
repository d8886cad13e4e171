"""Algorithms, selection policies, aggregation rules, the Main Server's split-learning plug-ins
(grouping, group loss, member defences) and the devices' privacy defences by name. Adding one: write its module, add one line here.

Each line names its class by import path; the class is imported when its name is first looked up
(``plugin_table.py`` says why), so this module imports none of the plug-ins it lists.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from pydantic import ValidationError

from shared.algorithms.plugin_params import params_error
from shared.algorithms.plugin_table import PluginTable
from shared.algorithms.robust_aggregation import AggregationRule, rule_params_error

if TYPE_CHECKING:
    from shared.algorithms.base import Algorithm
    from shared.algorithms.group_loss import GroupLoss
    from shared.algorithms.grouping import Grouping
    from shared.algorithms.member_defence import MemberDefence
    from shared.algorithms.privacy_defence import PrivacyDefence
    from shared.algorithms.selection import DeviceSelector
    from shared.config import RunConfig
    from shared.losses import Loss



class _Defence(Protocol):
    """A defence plug-in (a member defence, a privacy defence): built from its parameters, which
    its ``Params`` model checks (:func:`_named_defences`)."""

    Params: ClassVar[Any]   # a pydantic model class (each plug-in names its own subclass)

    def __init__(self, params: Mapping[str, Any] | None = None) -> None: ...


D = TypeVar("D", bound=_Defence)

ALGORITHMS: PluginTable[Algorithm] = PluginTable("algorithm", "shared.algorithms.base:Algorithm", {
    "s2fl": "shared.algorithms.split_learning:S2FL",
    "sfl": "shared.algorithms.split_learning:SFL",
    "fedavg": "shared.algorithms.fedavg:FedAvg",
    "fedbc": "shared.algorithms.fedbc:FedBC",
    "fnr-fl": "shared.algorithms.fnr_fl:FNRFL",
    "fedipg": "shared.algorithms.fedipg:FedIPG",
    "fedprox": "shared.algorithms.fedprox:FedProx",
    "scaffold": "shared.algorithms.scaffold:Scaffold",
    "fedadagrad": "shared.algorithms.fedopt:FedAdagrad",
    "fedadam": "shared.algorithms.fedopt:FedAdam",
    "fedyogi": "shared.algorithms.fedopt:FedYogi",
})


SELECTORS: PluginTable[DeviceSelector] = PluginTable("selection", "shared.algorithms.selection:DeviceSelector", {
    "random": "shared.algorithms.selection:DeviceSelector",
    "hics": "shared.algorithms.hics:HiCSSelector",
})


#: How the Fed Server combines a round's uploads (``aggregation.rule``; docs/configuration.md, ``aggregation.*``).
AGGREGATION_RULES: PluginTable[AggregationRule] = PluginTable(
    "aggregation rule", "shared.algorithms.robust_aggregation:AggregationRule", {
        "bounded_mean": "shared.algorithms.robust_aggregation:BoundedMean",
        "mean": "shared.algorithms.robust_aggregation:Mean",
        "median": "shared.algorithms.robust_aggregation:Median",
        "trimmed_mean": "shared.algorithms.robust_aggregation:TrimmedMean",
        "krum": "shared.algorithms.robust_aggregation:Krum",
        "multi_krum": "shared.algorithms.robust_aggregation:MultiKrum",
    })


#: How the Main Server groups a round's devices (``RoundPlan.grouping``; ``grouping.method``).
GROUPINGS: PluginTable[Grouping] = PluginTable("grouping", "shared.algorithms.grouping:Grouping", {
    "balanced": "shared.algorithms.grouping:BalancedGrouping",
    "singleton": "shared.algorithms.grouping:SingletonGrouping",
    "random": "shared.algorithms.random_grouping:RandomGrouping",
    "split_point": "shared.algorithms.split_point_grouping:SplitPointGrouping",
    "speed": "shared.algorithms.speed_grouping:SpeedGrouping",
})


#: How a group step combines its members' losses (``RoundPlan.group_loss``; ``grouping.group_loss``).
GROUP_LOSSES: PluginTable[GroupLoss] = PluginTable("group_loss", "shared.algorithms.group_loss:GroupLoss", {
    "per_member": "shared.algorithms.group_loss:PerMemberLoss",
    "per_member_sum": "shared.algorithms.group_loss:PerMemberSumLoss",
    "union_mean": "shared.algorithms.group_loss:UnionMeanLoss",
    "data_weighted": "shared.algorithms.data_weighted_loss:DataWeightedLoss",
})


#: What a group step does against a harmful member (``RoundPlan.member_defences``; ``grouping.member_defences``).
MEMBER_DEFENCES: PluginTable[MemberDefence] = PluginTable(
    "member defence", "shared.algorithms.member_defence:MemberDefence", {
        "standardise": "shared.algorithms.member_defence:Standardise",
        "clip": "shared.algorithms.member_defence:ClipMembers",
        "median": "shared.algorithms.member_defence:MedianOfMembers",
        "trimmed_mean": "shared.algorithms.member_defence:TrimmedMeanOfMembers",
        "member_updates": "shared.algorithms.member_defence:MemberUpdates",
    })


#: What a device does so that what it sends gives less away (``split_privacy.defences``; docs/split-privacy.md).
PRIVACY_DEFENCES: PluginTable[PrivacyDefence] = PluginTable(
    "privacy defence", "shared.algorithms.privacy_defence:PrivacyDefence", {
        "floor": "shared.algorithms.privacy_defence:SplitFloor",
        "noise": "shared.algorithms.privacy_defence:ActivationNoise",
        "nopeek": "shared.algorithms.nopeek:NoPeek",
        "label_noise": "shared.algorithms.label_noise:LabelNoise",
    })


def build_algorithm(config: RunConfig) -> Algorithm:
    """The configured algorithm object."""
    return ALGORITHMS.choose(config.algorithm)(config)


def build_selector(config: RunConfig, output_layer: str | None = None) -> DeviceSelector:
    """The configured device selection policy (``output_layer``: the model's, for HiCS-FL)."""
    return SELECTORS.choose(config.selection)(config, output_layer)


def build_aggregation_rule(config: RunConfig) -> AggregationRule:
    """The configured aggregation rule; ValueError names an unknown rule (with the choices) or
    each bad parameter (``aggregation.params.clip: ...``)."""
    rule = AGGREGATION_RULES.choose(config.aggregation.rule)
    try:
        return rule(config.aggregation.params)
    except ValidationError as exc:   # a plain ValueError: the config loader prints it as it is
        raise ValueError(rule_params_error(rule, exc)) from None


def build_grouping(name: str) -> Grouping:
    """The grouping plug-in registered as ``name`` (ValueError naming the choices if none is)."""
    return GROUPINGS.choose(name)()


def build_group_loss(name: str, criterion: Loss | None = None) -> GroupLoss:
    """The group-loss plug-in registered as ``name``, combining members' losses of ``criterion``
    (the run's loss; None: cross-entropy). ValueError naming the choices if no plug-in is."""
    return GROUP_LOSSES.choose(name)(criterion)


def build_member_defences(names: list[str], params: Mapping[str, Mapping[str, Any]],
                          group_loss: GroupLoss) -> list[MemberDefence]:
    """The member defences ``names`` (in order) with their ``params`` by name, for a group step
    under ``group_loss``. ValueError naming what does not fit: an unknown name (with the choices),
    a name given twice, a bad parameter (``grouping.member_defence_params.clip.multiple: ...``),
    parameters for a defence not named, two defences that each replace the mean (or one with
    ``member_updates``, which sends the mean's parts), or a group loss that cannot give per-member
    weights to a defence that needs each member's own gradient."""
    defences = _named_defences(MEMBER_DEFENCES, names, params, "grouping.member_defences",
                               "grouping.member_defence_params")
    centers = [n for n, d in zip(names, defences) if d.centers]
    if len(centers) > 1:
        raise ValueError(f"grouping.member_defences: {' and '.join(centers)} each replace the members' mean; name one")
    uploads = [n for n, d in zip(names, defences) if d.uploads_members]
    if uploads and centers:
        raise ValueError(f"grouping.member_defences: {uploads[0]} sends each member's part of the mean, which "
                         f"{centers[0]} replaces; name one of the two")
    if any(d.per_member_gradients for d in defences):
        try:
            group_loss.member_weights([1], [1.0])
        except NotImplementedError:
            raise ValueError(f"grouping.member_defences {names} work on each member's own gradient, which group loss "
                             f"{type(group_loss).__name__} cannot weigh (GroupLoss.member_weights)") from None
    return defences


def build_privacy_defences(names: list[str], params: Mapping[str, Mapping[str, Any]]) -> list[PrivacyDefence]:
    """The privacy defences ``names`` (in order) with their ``params`` by name. ValueError naming
    what does not fit: an unknown name (with the choices), a name given twice, a bad parameter
    (``split_privacy.defence_params.noise.scale: ...``), or parameters for a defence not named."""
    return _named_defences(PRIVACY_DEFENCES, names, params, "split_privacy.defences", "split_privacy.defence_params")


def _named_defences(table: PluginTable[D], names: list[str], params: Mapping[str, Mapping[str, Any]],
                    names_key: str, params_key: str) -> list[D]:
    """``table``'s plug-ins ``names`` (config key ``names_key``), in order, each built with its
    parameters from ``params`` (config key ``params_key``); ValueError naming a name given twice,
    parameters for a name not given, an unknown name or a bad parameter."""
    if len(set(names)) != len(names):
        raise ValueError(f"{names_key} names a defence twice: {names}")
    stray = sorted(set(params) - set(names))
    if stray:
        raise ValueError(f"{params_key} has parameters for {stray}, which {names_key} does not name")
    defences = []
    for name in names:
        cls = table.choose(name)
        try:
            defences.append(cls(params.get(name, {})))
        except ValidationError as exc:
            raise ValueError(params_error(f"{params_key}.{name}", cls.Params, exc)) from None
    return defences


def uploads_member_states(names: list[str]) -> bool:
    """Whether the member defences ``names`` have the Main Server send each member's own state of
    its group's copy (``member_updates``)."""
    return any(MEMBER_DEFENCES.choose(name).uploads_members for name in names)
