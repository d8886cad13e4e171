"""Loading a run configuration completely: the schema (``shared.config``) plus the checks that
need the algorithm registry and the model zoo.

``shared.config`` holds only the pydantic schema, so the algorithms can import its types without
a cycle (the registry imports the algorithms, which import ``shared.config``). This module sits
above both. Every place that builds a ``RunConfig`` from outside data (the Fed Server and testbed
CLIs, experiment grids, benchmarks, tests) goes through :func:`load_run_config` or
:func:`resolve_run_config`, so a bad configuration fails when it is read, before any process
starts, with a message naming the problem.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shared.algorithms.registry import (
    ALGORITHMS, SELECTORS, build_algorithm, build_group_loss, build_grouping, build_selector,
)
from shared.config import RunConfig, merge_config_sources
from shared.data.device_transforms import check_device_transform
from shared.data import dataset_input_shape, dataset_num_classes
from shared.models import SplitModel, build_model_layout
from shared.models.zoo import SPLIT_DEPTH_ZERO_MODELS


def validate_run_config(config: RunConfig) -> RunConfig:
    """Check what the schema alone cannot: known algorithm, selection, grouping and group-loss
    names; the model (it is built: import path, model_params, shapes, see
    :func:`build_config_model`); the algorithm's and the selector's own parameters; the per-device
    data transform and its parameters; and model/algorithm compatibility (a cut needs split points,
    FNR-FL/FedIPG/HiCS-FL need the parts they name in ``model_parts_needed``).

    Returns ``config`` unchanged; raises ValueError naming the problem (and, for unknown names,
    the valid choices).
    """
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if config.selection not in SELECTORS:
        raise ValueError(f"unknown selection {config.selection!r}; choose one of {sorted(SELECTORS)}")
    model = build_config_model(config)
    check_device_transform(config.data)   # unknown names and bad parameters
    if config.grouping.method is not None:
        build_grouping(config.grouping.method)   # an unknown plug-in name lists the known ones
    build_group_loss(config.grouping.group_loss)
    # Building the algorithm and the selector validates algorithm_params, selection_params and the
    # algorithm's own requirements on the rest of the config (e.g. FNR-FL needs
    # data.public_samples), before any process starts.
    algorithm = build_algorithm(config)
    selector = build_selector(config)
    if config.model in SPLIT_DEPTH_ZERO_MODELS and algorithm.split_mode() != "zero":
        raise ValueError(f"model {config.model!r} has no meaningful cut: use it with a split-depth-zero algorithm "
                         f"(e.g. fedavg, fedbc), not {config.algorithm!r}")
    if algorithm.split_mode() != "zero" and not model.split_points:
        raise ValueError(f"algorithm {config.algorithm!r} cuts the model, but model {config.model!r} declares no split "
                         f"points: return ModelDefinition(..., split_points=[...]) (docs/models.md)")
    for who, needs in ((f"algorithm {config.algorithm!r}", algorithm.model_parts_needed()),
                       (f"selection {config.selection!r}", selector.model_parts_needed())):
        for part in needs:
            if getattr(model, part) is None:
                what = "penultimate feature block" if part == "feature_block" else "output layer"
                raise ValueError(f"{who} needs the model's {what}, which model {config.model!r} does not declare "
                                 f"and it could not be inferred: return ModelDefinition(..., {part}=...) "
                                 f"(docs/models.md)")
    return config


def build_config_model(config: RunConfig) -> SplitModel:
    """Build the run's model to check it (import, parameters, shapes, parts), cheaply: on the meta
    device where its code runs there, else for real (``build_model_layout``)."""
    return build_model_layout(config.model, dataset_num_classes(config.data), dataset_input_shape(config.data),
                              seed=config.seed, params=config.model_params)


def load_run_config(data: Mapping[str, Any]) -> RunConfig:
    """A plain (nested) dict -> a fully validated ``RunConfig``; ValueError (pydantic's
    ValidationError is one) says what is wrong."""
    return validate_run_config(RunConfig.model_validate(data))


def resolve_run_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    env_prefix: str = "SFL_RUN__",
) -> RunConfig:
    """Defaults < config file < environment (``SFL_RUN__TRAIN__LR=0.1``) < ``key=value`` overrides,
    validated completely (see :func:`shared.config.merge_config_sources`)."""
    return load_run_config(merge_config_sources(config_file, overrides, env_prefix))
