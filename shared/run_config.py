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
from shared.evaluation import has_server_test_set
from shared.models.zoo import MODEL_NAMES, SPLIT_DEPTH_ZERO_MODELS


def validate_run_config(config: RunConfig) -> RunConfig:
    """Check what the schema alone cannot: known algorithm, selection, model, grouping and
    group-loss names, a server evaluation's test set, the
    algorithm's and the selector's own parameters, the per-device data transform and its
    parameters, and model/algorithm compatibility.

    Returns ``config`` unchanged; raises ValueError naming the problem (and, for unknown names,
    the valid choices).
    """
    if config.algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {config.algorithm!r}; choose one of {sorted(ALGORITHMS)}")
    if config.selection not in SELECTORS:
        raise ValueError(f"unknown selection {config.selection!r}; choose one of {sorted(SELECTORS)}")
    if config.model not in MODEL_NAMES:
        raise ValueError(f"unknown model {config.model!r}; choose one of {list(MODEL_NAMES)}")
    check_device_transform(config.data)   # unknown names and bad parameters
    if config.evaluation.mode == "server" and not has_server_test_set(config.data):
        raise ValueError("evaluation.mode='server' needs a server-side test set: set data.test_file, "
                         "or use evaluation.mode 'federated' (or 'auto')")
    if config.grouping.method is not None:
        build_grouping(config.grouping.method)   # an unknown plug-in name lists the known ones
    build_group_loss(config.grouping.group_loss)
    # Building the algorithm and the selector validates algorithm_params, selection_params and the
    # algorithm's own requirements on the rest of the config (e.g. FNR-FL needs
    # data.public_samples), before any process starts.
    algorithm = build_algorithm(config)
    build_selector(config)
    if config.model in SPLIT_DEPTH_ZERO_MODELS and algorithm.split_mode() != "zero":
        raise ValueError(f"model {config.model!r} has no meaningful cut: use it with a split-depth-zero algorithm "
                         f"(e.g. fedavg, fedbc), not {config.algorithm!r}")
    return config


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
