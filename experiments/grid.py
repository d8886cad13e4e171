"""Grid expansion: an experiment's axes -> the ordered list of cells, each with a validated config."""
from __future__ import annotations

import copy
import functools
import hashlib
import itertools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared.config import RunConfig, set_dotted
from shared.run_config import ConfigError, load_run_config

from experiments.spec import ExperimentSpec


@dataclass(frozen=True)
class Cell:
    """One run of the grid: the label it has on each axis and its resolved configuration."""

    labels: dict[str, str]   # axis -> label, in axis order
    config: RunConfig

    @property
    def cell_id(self) -> str:
        """Directory name: ``axis-label__axis-label`` (labels are restricted to path-safe characters)."""
        return "__".join(f"{axis}-{label}" for axis, label in self.labels.items())

    @property
    def config_hash(self) -> str:
        """Fingerprint of the resolved configuration: a cell whose file changed is run again."""
        text = json.dumps(self.config.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def ran_as(self, record_hash: object, ran_config: Mapping[str, Any] | None) -> bool:
        """Whether a run recorded with ``record_hash`` and configuration ``ran_config`` (its run
        directory's ``config.yaml``) is this cell's configuration.

        The same hash is. Otherwise the run's configuration is compared key by key: a setting
        added to the configuration after the run (absent from ``ran_config``) matches when this
        cell has it at the value that keeps the earlier behaviour: its default (how settings are
        added here), or, for a setting whose default changed since, the one in
        :data:`EARLIER_BEHAVIOUR`. Any other difference, a changed default included, means the
        cell is run again. Without this, every setting the project added made every committed
        cell look unrun (the hash covers every setting).
        """
        if record_hash == self.config_hash:
            return True
        if ran_config is None:
            return False
        ran = _flatten({k: v for k, v in ran_config.items() if k != "run_id"})
        now = _flatten(self.config.model_dump(mode="json"))
        if set(ran) - set(now):   # a setting the configuration no longer has
            return False
        default = _defaults()
        return all(ran[key] == value if key in ran else value == EARLIER_BEHAVIOUR.get(key, default.get(key, _MISSING))
                   for key, value in now.items())


_MISSING = object()
#: Settings whose default is not the behaviour of runs made before the setting existed: the value
#: those runs ran with. ``split.warm_up`` came with the paper's warm-up as its default and became
#: ``estimated`` on 2026-12-07; ``split.undominated`` came on by default, a change of the median
#: rule, the same day.
EARLIER_BEHAVIOUR: dict[str, Any] = {"split.warm_up": "every_split", "split.undominated": False}


@functools.cache
def _defaults() -> dict[str, Any]:
    """Every setting's default, flattened (built once: a grid compares each of its cells)."""
    return _flatten(RunConfig().model_dump(mode="json"))


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _excluded(labels: dict[str, str], rules: list[dict[str, list[str]]]) -> bool:
    return any(all(labels[axis] in allowed for axis, allowed in rule.items()) for rule in rules)


def build_config(base: dict[str, Any], overrides: dict[str, Any]) -> RunConfig:
    """``base`` (nested or dotted keys) with the cell's dotted overrides applied on top."""
    data: dict[str, Any] = {}
    for key, value in base.items():
        set_dotted(data, key, copy.deepcopy(value))
    for key, value in overrides.items():
        set_dotted(data, key, copy.deepcopy(value))
    return load_run_config(data)


def expand(spec: ExperimentSpec, only: dict[str, list[str]] | None = None) -> list[Cell]:
    """Every cell of the grid in axis order (the first axis varies slowest), minus excluded ones.

    ``only`` (axis -> labels) keeps a sub-grid, e.g. ``{"seed": ["0"]}``. Raises ConfigError
    naming the cell whose configuration is invalid and each wrong field.
    """
    only = only or {}
    spec.check_selection(only, "--only")
    names = list(spec.axes)
    cells = []
    for combo in itertools.product(*(spec.axes[name].items() for name in names)):
        labels = {name: label for name, (label, _) in zip(names, combo)}
        if _excluded(labels, spec.exclude) or any(labels[a] not in keep for a, keep in only.items()):
            continue
        overrides: dict[str, Any] = {}
        for _, axis_overrides in combo:
            overrides.update(axis_overrides)
        try:
            config = build_config(spec.base, overrides)
        except ConfigError as exc:
            cell = ", ".join(f"{k}={v}" for k, v in labels.items())
            raise ConfigError([f"cell {cell}: {line}" for line in exc.lines]) from None
        cells.append(Cell(labels, config))
    if not cells:
        raise ValueError("the grid has no cells (every combination is excluded or filtered out)")
    return cells


def parse_only(items: list[str]) -> dict[str, list[str]]:
    """``["seed=0,1", "model=cnn"]`` -> ``{"seed": ["0", "1"], "model": ["cnn"]}``."""
    out: dict[str, list[str]] = {}
    for item in items:
        axis, sep, labels = item.partition("=")
        if not sep or not axis or not labels:
            raise ValueError(f"--only takes AXIS=LABEL[,LABEL...], got {item!r}")
        out.setdefault(axis.strip(), []).extend(x.strip() for x in labels.split(","))
    return out
