"""An experiment file: a base run configuration and named axes whose Cartesian product is the grid.

The file is YAML (docs/experiments.md has the full format)::

    name: table2-cnn
    base: {rounds: 20, data: {num_devices: 100}, devices_per_round: 10}
    axes:
      algorithm: [fedavg, sfl, s2fl]                    # list: the axis name is the config key
      partition:                                       # mapping: label -> overrides
        dir0.1: {data.partition: dirichlet, data.alpha: 0.1}
        iid: {data.partition: iid}
      seed: {keys: [seed, data.seed], values: [0, 1, 2]}   # one value set on several keys
    exclude:
      - {algorithm: [fedavg, sfl], group_loss: union_mean}   # cells matching a whole rule are dropped
    targets: [0.8, 0.9]

Every cell's configuration is validated when the file is loaded, so a typo fails before any run.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.config import load_config_file
from shared.run_config import ConfigError, config_error_lines

Overrides = dict[str, Any]   # dotted config key -> value
_LABEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]*$")


class ReportSpec(BaseModel):
    """How the report groups cells: one line per ``series`` value, mean and std over ``repeat``."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("series", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    # Axis (or axes, joined with "/") drawn as separate lines; default: the first axis.
    series: list[str] = Field(default_factory=list)
    repeat: str | None = None   # axis averaged over (default: "seed" when there is one)
    # Last-round values of these ``algorithm_metrics`` keys become table columns
    # (e.g. FedBC's ``local_acc_pooled``, FedIPG's ``id_accuracy`` / ``ood_accuracy``).
    metrics: list[str] = Field(default_factory=list)
    # Mean test accuracy of the last ``last_k`` completed rounds, a steadier figure than the final one.
    last_k: int = Field(3, ge=1)


class ExperimentSpec(BaseModel):
    """A whole experiment file, axes normalised to ``axis -> label -> overrides``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    description: str = ""
    base: dict[str, Any] = Field(default_factory=dict)
    axes: dict[str, dict[str, Overrides]]
    exclude: list[dict[str, list[str]]] = Field(default_factory=list)
    targets: list[float] = Field(default_factory=list)   # test accuracies for time/bytes-to-target
    agents: int = Field(1, ge=1, le=64)                  # device agent processes per cell
    timeout_s: float = Field(3600.0, gt=0)               # a cell that runs longer is marked failed
    report: ReportSpec = Field(default_factory=ReportSpec)

    @field_validator("axes", mode="before")
    @classmethod
    def _normalise_axes(cls, raw: Any) -> Any:
        if not isinstance(raw, dict) or not raw:
            raise ValueError("'axes' must be a non-empty mapping of axis name -> values")
        return {str(name): normalise_axis(str(name), values) for name, values in raw.items()}

    @field_validator("exclude", mode="before")
    @classmethod
    def _normalise_exclude(cls, raw: Any) -> Any:
        if not isinstance(raw, list):
            raise ValueError("'exclude' must be a list of {axis: label or [labels]} rules")
        rules = []
        for rule in raw:
            if not isinstance(rule, dict) or not rule:
                raise ValueError(f"an exclude rule must be a non-empty mapping, got {rule!r}")
            rules.append({str(k): [str(x) for x in (v if isinstance(v, list) else [v])] for k, v in rule.items()})
        return rules

    @field_validator("targets")
    @classmethod
    def _targets_in_range(cls, targets: list[float]) -> list[float]:
        if any(not 0 < t <= 1 for t in targets):
            raise ValueError("targets are test accuracies in (0, 1]")
        return sorted(targets)

    @model_validator(mode="after")
    def _check_references(self) -> "ExperimentSpec":
        for rule in self.exclude:
            self.check_selection(rule, "exclude rule")
        for name in (*self.report.series, self.report.repeat):
            if name is not None and name not in self.axes:
                raise ValueError(f"report names unknown axis {name!r} (axes: {', '.join(self.axes)})")
        return self

    def check_selection(self, selection: dict[str, list[str]], what: str) -> None:
        """ValueError unless every axis and label that ``selection`` names exists."""
        for axis, labels in selection.items():
            if axis not in self.axes:
                raise ValueError(f"{what} names unknown axis {axis!r} (axes: {', '.join(self.axes)})")
            unknown = set(labels) - set(self.axes[axis])
            if unknown:
                raise ValueError(f"{what} names unknown labels {sorted(unknown)} of axis {axis!r}")

    @property
    def series_axes(self) -> list[str]:
        return self.report.series or [next(iter(self.axes))]

    def series_label(self, labels: dict[str, str]) -> str:
        """A cell's line in the plots: its labels on the series axes."""
        return "/".join(labels[a] for a in self.series_axes)

    @property
    def repeat_axis(self) -> str | None:
        if self.report.repeat:
            return self.report.repeat
        return "seed" if "seed" in self.axes and "seed" not in self.series_axes else None


def _label(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if not _LABEL.match(text):
        raise ValueError(f"axis label {text!r} must be letters, digits and _ . : + - (give the axis as a label mapping)")
    return text


def normalise_axis(name: str, values: Any) -> dict[str, Overrides]:
    """The three accepted forms of an axis -> ``{label: {dotted key: value}}``."""
    if isinstance(values, list):
        values = {"key": name, "values": values}
    if not isinstance(values, dict) or not values:
        raise ValueError(f"axis {name!r}: give a list of values, a mapping of label -> overrides, or {{key(s), values}}")
    if "values" in values:
        extra = set(values) - {"key", "keys", "values"}
        if extra or ("key" in values) == ("keys" in values):
            raise ValueError(f"axis {name!r}: the values form takes 'values' and exactly one of 'key' / 'keys'")
        keys = [values["key"]] if "key" in values else list(values["keys"])
        if not isinstance(values["values"], list) or not values["values"]:
            raise ValueError(f"axis {name!r}: 'values' must be a non-empty list")
        out = {}
        for v in values["values"]:
            label = _label(v)
            if label in out:
                raise ValueError(f"axis {name!r}: duplicate value {label!r}")
            out[label] = {str(k): v for k in keys}
        return out
    out = {}
    for label, overrides in values.items():
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, dict):
            raise ValueError(f"axis {name!r}, label {label!r}: overrides must be a mapping of config keys to values")
        out[_label(label)] = {str(k): v for k, v in overrides.items()}
    return out


def load_spec(path: str | Path) -> ExperimentSpec:
    """Read and validate an experiment file; :class:`~shared.run_config.ConfigError` says, one
    line per problem, that the file is missing, where its YAML is wrong, or which field is."""
    try:
        raw = load_config_file(path)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError([f"{path}: {line}" for line in config_error_lines(exc, model=ExperimentSpec)]) from None
