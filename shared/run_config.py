"""Loading a run configuration completely: the schema (``shared.config``) plus the checks that
need the algorithm registry and the model zoo.

``shared.config`` holds only the pydantic schema, so the algorithms can import its types without
a cycle (the registry imports the algorithms, which import ``shared.config``). This module sits
above both. Every place that builds a ``RunConfig`` from outside data (the Fed Server and testbed
CLIs, experiment grids, benchmarks, tests) goes through :func:`load_run_config` or
:func:`resolve_run_config`, so a bad configuration fails when it is read, before any process
starts, with a message naming the problem: a :class:`ConfigError` whose ``lines`` say, one line
per wrong field, which field is wrong, what it must be and what it got, without pydantic's internals
(the CLIs print them with :func:`exit_on_config_error`).
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel, ValidationError
from torch import nn

from shared.algorithms.base import Algorithm, DeviceLogic
from shared.algorithms.privacy_defence import PrivacyDefence
from shared.algorithms.registry import (
    ALGORITHMS, GROUPINGS, SELECTORS, build_algorithm, build_group_loss, build_grouping, build_member_defences,
    build_privacy_defences, build_selector, uploads_member_states,
)
from shared.config import RunConfig, merge_config_sources
from shared.data.device_transforms import check_device_transform
from shared.data import dataset_input_shape, dataset_num_classes
from shared.data.feature_skew import GaussianNoiseParams
from shared.evaluation import has_server_test_set
from shared.models import SplitModel, build_model, build_model_layout, candidate_split_points, profile_model
from shared.models.zoo import SPLIT_DEPTH_ZERO_MODELS
from shared.privacy.accountant import require_opacus

if TYPE_CHECKING:
    from shared.algorithms.selection import DeviceSelector


def validate_run_config(config: RunConfig) -> RunConfig:
    """Check what the schema alone cannot: known algorithm, selection, grouping and group-loss
    names; the model (it is built: import path, model_params, shapes, see
    :func:`build_config_model`); a server evaluation's test set; the algorithm's and the
    selector's own parameters; the per-device data transform and its parameters; and
    model/algorithm compatibility (a cut needs split points, FNR-FL/FedIPG/HiCS-FL need the parts
    they name in ``model_parts_needed``); a regression task's data set, algorithm and selection
    (:func:`_check_task`).

    Returns ``config`` unchanged; raises ValueError naming the problem (and, for unknown names,
    the valid choices).
    """
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if config.selection not in SELECTORS:
        raise ValueError(f"unknown selection {config.selection!r}; choose one of {sorted(SELECTORS)}")
    _check_task(config, ALGORITHMS[config.algorithm].needs_classes, SELECTORS[config.selection].needs_classes)
    model = build_config_model(config)
    check_device_transform(config.data)   # unknown names and bad parameters
    if config.evaluation.mode == "server" and not has_server_test_set(config.data):
        raise ValueError("evaluation.mode='server' needs a server-side test set: set data.test_file, "
                         "or use evaluation.mode 'federated' (or 'auto')")
    if config.grouping.method is not None:
        build_grouping(config.grouping.method)   # an unknown plug-in name lists the known ones
    build_member_defences(config.grouping.member_defences, config.grouping.member_defence_params,
                          build_group_loss(config.grouping.group_loss))
    # Building the algorithm and the selector validates algorithm_params, selection_params and the
    # algorithm's own requirements on the rest of the config (e.g. FNR-FL needs
    # data.public_samples), before any process starts.
    algorithm = build_algorithm(config)
    selector = build_selector(config)
    if config.model in SPLIT_DEPTH_ZERO_MODELS and algorithm.split_mode() != "zero":
        raise ValueError(f"model {config.model!r} has no meaningful cut: use it with a split-depth-zero algorithm "
                         f"(e.g. fedavg, fedbc), not {config.algorithm!r}")
    if algorithm.split_mode() != "zero" and algorithm.Logic.loss is not DeviceLogic.loss:
        # In split mode the Main Server computes the loss on its own portion's output (the group
        # loss over train.loss): a device objective would silently never be used.
        raise ValueError(f"algorithm {config.algorithm!r} cuts the model, but its device logic "
                         f"({algorithm.Logic.__name__}) defines its own loss, which split training never computes: "
                         f"make it split-depth-zero, or put the objective in a group loss (docs/extending.md)")
    if algorithm.split_mode() != "zero" and not model.split_points:
        raise ValueError(f"algorithm {config.algorithm!r} cuts the model, but model {config.model!r} declares no split "
                         f"points: return ModelDefinition(..., split_points=[...]) (docs/models.md)")
    candidates = _check_split_privacy(config, algorithm, model)
    _check_dp_sgd(config, algorithm, model, candidates)
    _check_private_updates(config, algorithm, selector)
    _check_secure_aggregation(config, algorithm, selector, model)
    if config.split.pinned:
        points = candidates if candidates is not None else split_candidates(config, model)
        wrong = {device: point for device, point in config.split.pinned.items() if point not in points}
        if wrong:
            raise ValueError(f"split.pinned: {', '.join(f'{d}: {k}' for d, k in sorted(wrong.items()))} is not one of "
                             f"the run's candidate split points {points}")
    for who, needs in ((f"algorithm {config.algorithm!r}", algorithm.model_parts_needed()),
                       (f"selection {config.selection!r}", selector.model_parts_needed())):
        for part in needs:
            if getattr(model, part) is None:
                what = "penultimate feature block" if part == "feature_block" else "output layer"
                raise ValueError(f"{who} needs the model's {what}, which model {config.model!r} does not declare "
                                 f"and it could not be inferred: return ModelDefinition(..., {part}=...) "
                                 f"(docs/models.md)")
    return config


def _check_dp_sgd(config: RunConfig, algorithm: Algorithm, model: SplitModel, candidates: Sequence[int] | None) -> None:
    """Sample-level DP-SGD (``train.dp_sgd``; docs/privacy.md) fits the run: every gradient the
    device trains on is a sum of per-sample gradients Opacus can compute and clip. So not in
    U-shaped mode (the device's head takes its gradients, scaled by the Main Server's weight,
    outside the optimizer's step), not with a device objective of the algorithm's own (a proximal or
    control term is not a sum over samples: DP-SGD would drop its gradient) nor with a defence that
    adds a penalty to it (``nopeek``), and not with a layer Opacus cannot train privately in the
    blocks a device may train (BatchNorm mixes the batch's samples), nor, in split mode, with a
    batch normalisation in the blocks the Main Server may train: the gradient it sends down for one
    sample would then depend on the batch's other samples, so clipping each would not bound what one
    sample adds. ValueError in one line."""
    if config.train.dp_sgd is None:
        return
    if config.split.u_shaped:
        raise ValueError("train.dp_sgd does not run in U-shaped mode (split.u_shaped): the device's head takes "
                         "its gradients outside the optimizer's step, so they would be neither clipped nor noised")
    if algorithm.split_mode() == "zero" and algorithm.Logic.loss is not DeviceLogic.loss:
        raise ValueError(f"train.dp_sgd: algorithm {config.algorithm!r}'s device objective "
                         f"({algorithm.Logic.__name__}.loss) adds terms that are not per-sample, whose gradient "
                         f"DP-SGD would drop: use an algorithm that trains on train.loss alone (e.g. fedavg)")
    penalised = [name for name, defence in zip(config.split_privacy.defences, build_privacy_defences(
        config.split_privacy.defences, config.split_privacy.defence_params))
        if type(defence).activation_penalty is not PrivacyDefence.activation_penalty]
    if penalised:
        raise ValueError(f"train.dp_sgd: split_privacy.defences {', '.join(penalised)} add a penalty over the whole "
                         f"batch to the device's objective, whose gradient DP-SGD would drop: leave them out")
    require_opacus("train.dp_sgd needs Opacus")
    from opacus.validators import ModuleValidator   # seconds to import: only for a run with DP-SGD

    deepest = max(candidates) if candidates else len(model.blocks)
    errors = ModuleValidator.validate(model.portion(0, deepest), strict=False)
    if errors:
        first = " ".join(str(errors[0]).split())
        raise ValueError(f"train.dp_sgd: Opacus cannot train the device's blocks of model {config.model!r} "
                         f"privately: {first[:200]}")
    if candidates:
        server = model.portion(min(candidates), len(model.blocks))
        coupled = sorted({type(m).__name__ for m in server.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})
        if coupled:
            raise ValueError(f"train.dp_sgd: the Main Server's blocks of model {config.model!r} normalise over the "
                             f"batch ({', '.join(coupled)}), so the gradient sent down for one sample depends on "
                             f"the others and clipping it bounds nothing: use a model without it past the cut "
                             f"(e.g. GroupNorm)")


def _check_split_privacy(config: RunConfig, algorithm: Algorithm, model: SplitModel) -> list[int] | None:
    """U-shaped mode and the privacy settings (docs/split-privacy.md) fit the run: a split algorithm, a
    group loss that weighs each member's loss (the Main Server weighs the gradients members send
    up with it), defences the run can apply, a grouping without label counts where devices
    withhold them, and a cut left to choose (:func:`split_candidates`). ValueError in one line.
    Returns those cuts, so they are profiled once (None for split depth zero, which has none)."""
    split_privacy = config.split_privacy
    if algorithm.split_mode() == "zero":
        for key, value in (("split.u_shaped", config.split.u_shaped or None), ("split_privacy.defences", split_privacy.defences or None),
                           ("split_privacy.label_counts", None if split_privacy.label_counts == "exact" else split_privacy.label_counts)):
            if value is not None:
                raise ValueError(f"algorithm {config.algorithm!r} trains the whole model on the device (split depth "
                                 f"zero) and sends no activation, gradient or label count, so {key} does not apply: "
                                 f"leave it unset")
        return None
    for name, defence in zip(split_privacy.defences, build_privacy_defences(split_privacy.defences, split_privacy.defence_params)):
        problem = defence.problem(config.split.u_shaped, config.train.loss)
        if problem is not None:
            raise ValueError(f"split_privacy.defences: {name}: {problem}")
    if config.split.u_shaped:
        loss = build_group_loss(config.grouping.group_loss)
        try:
            loss.member_weights([1], [1.0])
        except NotImplementedError:
            raise ValueError(f"split.u_shaped: each device computes its own loss, which group loss "
                             f"{config.grouping.group_loss!r} cannot weigh one by one (GroupLoss.member_weights): "
                             f"use per_member, per_member_sum, union_mean or data_weighted") from None
    if split_privacy.label_counts == "withheld" and build_grouping(algorithm.grouping()).uses_label_counts:
        able = ", ".join(name for name, grouping in GROUPINGS.items() if not grouping.uses_label_counts)
        raise ValueError(f"split_privacy.label_counts: withheld, but grouping {algorithm.grouping()!r} groups by label counts: "
                         f"set grouping.method to one that does not ({able})")
    return split_candidates(config, model)


def split_candidates(config: RunConfig, model: SplitModel) -> list[int]:
    """The cuts a run's split planner chooses among: ``split.candidates`` of the model; in U-shaped
    mode those before the head, which must start at one of the model's split points (Eq. 1 needs
    its costs there); then those every privacy defence allows (the ``floor``). ValueError, in one
    line, for a setting that leaves none, or lists a cut at or after the head."""
    points = list(model.split_points) if config.split.candidates is None else candidate_split_points(
        profile_model(model, config.model), config.split.candidates)
    if config.split.u_shaped:
        head = config.split.head_start(len(model.blocks))
        if head not in model.split_points:
            raise ValueError(f"split.head_blocks: {config.split.head_blocks} puts the devices' head at block {head}, "
                             f"which is not a split point of model {config.model!r} (its split points: "
                             f"{list(model.split_points)})")
        late = [k for k in points if k >= head]
        if late and config.split.candidates is not None and not isinstance(config.split.candidates, int):
            raise ValueError(f"split.candidates: {late} at or after the devices' head (block {head}, split.head_blocks "
                             f"{config.split.head_blocks}) would leave the Main Server no middle")
        points = [k for k in points if k < head]
        if not points:
            raise ValueError(f"split.u_shaped: no cut of model {config.model!r} lies before its head at block {head} "
                             f"(split.head_blocks {config.split.head_blocks})")
    allowed = points
    for defence in build_privacy_defences(config.split_privacy.defences, config.split_privacy.defence_params):
        allowed = defence.split_points(allowed)
    if not allowed:
        raise ValueError(f"split_privacy.defences leave no cut to choose among {points} (split_privacy.defence_params)")
    return allowed
def _check_private_updates(config: RunConfig, algorithm: Algorithm, selector: "DeviceSelector") -> None:
    """Privacy (``privacy.clipping``) needs an aggregate that is a mean of the devices' updates,
    computed from their clipped sum: ValueError in one line naming what needs each device's own
    update instead (an algorithm, a selection policy, a rule other than ``mean`` or its bounds, the
    Fed Server's norm check, ``member_updates``; docs/privacy.md)."""
    if not config.privacy.enabled:
        return
    _check_summed_updates(config, algorithm, selector, "privacy.clipping", "which privacy replaces with their clipped, "
                                                                           "noised sum")
    if config.updates.max_norm is not None:
        raise ValueError("privacy.clipping replaces updates.max_norm: every update is clipped to privacy.clip_norm "
                         "(leave updates.max_norm unset)")
    if config.privacy.noise is not None:
        multiplier = _check_budget(config)
        if config.privacy.noise == "distributed":
            _check_distributed_noise(config, multiplier)


def _check_distributed_noise(config: RunConfig, multiplier: float) -> None:
    """``privacy.noise: distributed`` (docs/privacy.md): the devices' shares of the noise are only
    private once summed, so secure aggregation with an explicit threshold (the fewest survivors
    whose sum is released, which sizes each share), and a ``value_range`` wide enough that the
    fixed point's per-entry clipping practically never cuts a noised entry (the clip bound plus
    eight standard deviations of a share): ValueError in one line otherwise."""
    secure = config.secure_aggregation
    if not secure.enabled:
        raise ValueError("privacy.noise: distributed needs secure_aggregation.enabled: each device adds only its "
                         "share of the noise, which protects nothing unless the Fed Server sees no more than the sum")
    if secure.threshold is None:
        raise ValueError("privacy.noise: distributed needs secure_aggregation.threshold: each device's share of the "
                         "noise is sized so that any threshold of survivors carry the whole noise")
    from shared.privacy.noise import distributed_noise_std

    needed = config.privacy.clip_norm + 8 * distributed_noise_std(multiplier, config.privacy.clip_norm,
                                                                  secure.threshold)
    if secure.value_range < needed:
        raise ValueError(f"secure_aggregation.value_range {secure.value_range:g} would cut the devices' noise: with "
                         f"noise multiplier {multiplier:.4g}, clip bound {config.privacy.clip_norm:g} and threshold "
                         f"{secure.threshold} it must be at least {needed:.4g} (the bound plus 8 standard deviations "
                         f"of a device's share)")


def _check_secure_aggregation(config: RunConfig, algorithm: Algorithm, selector: "DeviceSelector",
                              model: SplitModel) -> None:
    """Secure aggregation (``secure_aggregation.enabled``; docs/privacy.md) gives the Fed Server only
    the sums of the devices' portions, block by block: ValueError in one line for a run that clips
    for differential privacy without the devices' noise, checks each update's norm, has integer
    state entries, or needs each device's own update (as for privacy), or whose threshold exceeds
    its devices per round."""
    secure = config.secure_aggregation
    if not secure.enabled:
        return
    if config.privacy.enabled and config.privacy.noise != "distributed":
        raise ValueError("secure_aggregation runs privacy.clipping only with privacy.noise: distributed (the devices "
                         "add the noise): the Fed Server cannot clip or noise the updates secure aggregation hides "
                         "from it")
    if config.updates.max_norm is not None:
        raise ValueError("secure_aggregation cannot run updates.max_norm: the Fed Server cannot see an update's norm; "
                         "each device clips its entries to secure_aggregation.value_range")
    _check_summed_updates(config, algorithm, selector, "secure_aggregation", "which secure aggregation hides from "
                                                                             "the Fed Server")
    integer = sorted(k for k, v in model.state_dict().items() if not v.is_floating_point())
    if integer:
        raise ValueError(f"secure_aggregation cannot run model {config.model!r}: its integer state entries "
                         f"({', '.join(integer[:3])}) are not averaged as fixed-point values")
    if secure.threshold is not None and secure.threshold > config.per_round:
        raise ValueError(f"secure_aggregation.threshold {secure.threshold} exceeds the {config.per_round} devices "
                         f"of a round")


def _check_summed_updates(config: RunConfig, algorithm: Algorithm, selector: "DeviceSelector", setting: str,
                          sees: str) -> None:
    """An aggregate computed from the devices' summed updates (``setting``): ValueError in one line
    naming what needs each device's own update instead, which ``sees`` says what becomes of."""
    for who, reason in ((f"algorithm {config.algorithm!r}", algorithm.individual_updates),
                        (f"selection {config.selection!r}", selector.individual_updates)):
        if reason is not None:
            raise ValueError(f"{setting} cannot run {who}: {reason}, {sees}")
    if config.aggregation.rule != "mean":
        raise ValueError(f"{setting} needs aggregation.rule: mean (got {config.aggregation.rule!r}, which needs "
                         f"each device's own update, {sees})")
    if config.aggregation.params:
        raise ValueError(f"{setting} needs aggregation.params empty: the mean's weight and update bounds need "
                         f"each device's own update, {sees}")
    if uploads_member_states(config.grouping.member_defences):
        raise ValueError(f"{setting} cannot run grouping.member_defences member_updates: it weighs each "
                         "member's own server-side state, " + sees)


def _check_budget(config: RunConfig) -> float:
    """``privacy.delta`` below one over the population, and a budget that allows one round with
    the configured noise multiplier: ValueError in one line otherwise. Returns the run's noise
    multiplier (calibrating one to ``target_epsilon`` takes Opacus a search: done once here)."""
    privacy, population = config.privacy, config.data.num_devices
    if privacy.delta >= 1 / population:
        raise ValueError(f"privacy.delta {privacy.delta:g} is not below 1 / data.num_devices ({1 / population:g}): a "
                         f"mechanism that may publish one of {population} devices' data outright would meet it")
    from shared.privacy.accountant import PrivacyLedger   # Opacus: only for a run that adds noise
    from shared.privacy.budget import count_stddev, run_noise_multiplier
    from shared.privacy.clipping import AdaptiveClip

    multiplier = run_noise_multiplier(config)
    if privacy.clipping == "adaptive":
        AdaptiveClip(privacy.clip_norm, privacy.target_quantile, privacy.clip_learning_rate,
                     count_stddev(config, multiplier)).update_noise_multiplier(multiplier or 0.0)
    if privacy.noise_multiplier is not None and privacy.target_epsilon is not None:
        first = PrivacyLedger(privacy.accountant, privacy.delta).epsilon_after(privacy.noise_multiplier,
                                                                               config.per_round / population)
        if first > privacy.target_epsilon:
            raise ValueError(f"privacy.noise_multiplier {privacy.noise_multiplier:g} spends epsilon {first:.3g} in one "
                             f"round, past privacy.target_epsilon {privacy.target_epsilon:g}")
    assert multiplier is not None   # PrivacyConfig: noise needs a multiplier or a target
    return multiplier


def _check_task(config: RunConfig, algorithm_needs: str | None, selector_needs: str | None) -> None:
    """A regression task (``train.loss``, ``train.task``) needs data with float targets, which only
    ``dataset: local`` brings, and an algorithm and selection policy that do not need class labels
    (``Algorithm.needs_classes``). ValueError in one line otherwise."""
    if config.train.resolved_task != "regression":
        return
    loss = f"train.loss {config.train.loss!r}"
    if config.data.dataset != "local":
        raise ValueError(f"{loss} is a regression task, but data set {config.data.dataset!r} holds class labels: use "
                         f"data.dataset: local with float targets, or a classification loss (cross_entropy)")
    for who, needs in ((f"algorithm {config.algorithm!r}", algorithm_needs),
                       (f"selection {config.selection!r}", selector_needs)):
        if needs is not None:
            able = ", ".join(name for name, algorithm in ALGORITHMS.items() if algorithm.needs_classes is None)
            raise ValueError(f"{who} needs class labels ({needs}), so it cannot run a regression task ({loss}): "
                             f"use algorithm {_without_classes(ALGORITHMS)} with selection {_without_classes(SELECTORS)}")


def _without_classes(table: Mapping[str, type[Algorithm] | type[DeviceSelector]]) -> str:
    """The names of ``table`` whose plug-in runs without class labels, as ``a, b or c``."""
    names = [name for name, plug_in in table.items() if plug_in.needs_classes is None]
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


class ConfigError(ValueError):
    """A configuration that cannot be used. ``lines`` holds one line per problem, each naming the
    field (``train.lr: must be greater than 0 (got -1)``) or the file and line of a syntax error;
    ``str()`` is the lines joined by newlines."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = list(lines)
        super().__init__("\n".join(self.lines))


def _fields_at(model: type[BaseModel] | None, loc: Sequence[str | int]) -> list[str] | None:
    """The setting names of the (nested) schema at ``loc``, for an unknown key's message; None
    where ``loc`` leads into a free-form mapping (``model_params``, a list item)."""
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return list(model.model_fields) if model is not None else None


def _shown(value: Any) -> str:
    """A wrong value as the user wrote it, shortened: a whole sub-mapping is not repeated."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_error_lines(exc: ValidationError, prefix: str = "",
                       model: type[BaseModel] | None = None) -> list[str]:
    """One line per error of ``exc``: ``field.path: what it must be (got value)``.

    ``prefix`` is where the validated mapping sits in the file (``algorithm_params`` for an
    algorithm's ``Params``); ``model`` is the schema that was validated, so an unknown key's line
    lists the keys valid in its place. pydantic's type codes, ``input_value=...`` dumps and
    documentation links are left out: they describe pydantic, not the user's file.
    """
    lines = []
    for err in exc.errors(include_url=False):
        loc = [str(part) for part in err["loc"]]
        path = [prefix, *loc] if prefix else loc
        field = ".".join(path)   # empty for a check across the whole config
        kind, message = err["type"], err["msg"]
        if kind == "extra_forbidden":
            where = ".".join(path[:-1]) or "the top level"
            valid = _fields_at(model, loc[:-1])
            message = f"unknown key in {where}" + ("" if valid is None else
                                                   f" (valid keys: {', '.join(valid)})" if valid else " (it takes no keys)")
        elif kind == "missing":
            message = "is required"
        elif kind == "model_type":
            message = f"must be a mapping of settings (got {_shown(err['input'])})"
        else:
            message = message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
            message = "must be" + message[len("Input should be"):] if message.startswith("Input should be") else message
            if kind != "value_error" and not isinstance(err.get("input"), (dict, list)):
                message += f" (got {_shown(err.get('input'))})"
        lines.append(f"{field}: {message}" if field else message)
    return lines


def _params_schema(exc: ValidationError, config: RunConfig) -> tuple[str, type[BaseModel] | None]:
    """Which free-form mapping of ``config`` (and which model of its parameters) a ValidationError
    raised by :func:`validate_run_config` came from: the algorithm's and the selector's ``Params``
    validate ``algorithm_params`` and ``selection_params``; the Gaussian-noise transform validates
    ``data.device_transform_params``."""
    algorithm, selector = ALGORITHMS.get(config.algorithm), SELECTORS.get(config.selection)
    for prefix, schema in (("algorithm_params", algorithm.Params if algorithm else None),
                           ("selection_params", selector.Params if selector else None),
                           ("data.device_transform_params", GaussianNoiseParams)):
        if schema is not None and exc.title == schema.__name__:
            return prefix, schema
    return "", None


def build_config_model(config: RunConfig, layout: bool = True) -> SplitModel:
    """Build the run's model: to check it (import, parameters, shapes, parts), cheaply, on the meta
    device where its code runs there (``build_model_layout``); with ``layout`` False, with its real
    initial weights (the Fed Server's global model, an export's architecture)."""
    build = build_model_layout if layout else build_model
    return build(config.model, dataset_num_classes(config.data), dataset_input_shape(config.data),
                 seed=config.seed, params=config.model_params)


def run_warnings(config: RunConfig, model: SplitModel) -> list[str]:
    """Lines a run that starts should print once, before its rounds (the Fed Server logs them, the
    testbed's launcher prints them): a model head that does not suit the loss, and a
    ``data.test_file`` that federated evaluation leaves unread."""
    from shared.losses import build_loss, softmax_head_warning

    lines = [softmax_head_warning(model, build_loss(config.train.loss, config.train.task))]
    if config.evaluation.mode == "federated" and config.data.test_file is not None:
        lines.append(f"data.test_file {config.data.test_file!r} is ignored: evaluation.mode is federated, so the "
                     f"devices evaluate on their held-out part; set evaluation.mode: server (or auto) to evaluate "
                     f"on the file")
    return [line for line in lines if line is not None]


def load_run_config(data: Mapping[str, Any]) -> RunConfig:
    """A plain (nested) dict -> a fully validated ``RunConfig``; :class:`ConfigError` (a
    ValueError) says what is wrong, one line per problem."""
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(config_error_lines(exc, model=RunConfig)) from None
    try:
        return validate_run_config(config)
    except ValidationError as exc:
        raise ConfigError(config_error_lines(exc, *_params_schema(exc, config))) from None
    except ValueError as exc:   # the registry's and the transforms' checks: one line each
        raise ConfigError([str(exc)]) from None


def resolve_run_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    env_prefix: str = "SFL_RUN__",
) -> RunConfig:
    """Defaults < config file < environment (``SFL_RUN__TRAIN__LR=0.1``) < ``key=value`` overrides,
    validated completely (see :func:`shared.config.merge_config_sources`). A missing or unreadable
    file, a syntax error and a malformed override are :class:`ConfigError` too."""
    try:
        data = merge_config_sources(config_file, overrides, env_prefix)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    return load_run_config(data)


def exit_on_config_error(exc: ConfigError) -> NoReturn:
    """For the CLIs: print ``config error: <line>`` per problem to stderr and exit with status 2
    (argparse's status for bad usage), without a traceback."""
    for line in exc.lines:
        print(f"config error: {line}", file=sys.stderr)
    sys.exit(2)
