"""Experiment files: axis forms, grid expansion, exclusion, sub-grids, validation."""
from __future__ import annotations

import pytest

from experiments.grid import expand, parse_only
from experiments.spec import ExperimentSpec, load_spec


def _spec(**fields) -> ExperimentSpec:
    raw = {"name": "t", "base": {"rounds": 2, "data": {"num_devices": 4}}, "axes": {
        "seed": {"keys": ["seed", "data.seed"], "values": [0, 1]},
        "partition": {"dir0.1": {"data.partition": "dirichlet", "data.alpha": 0.1}, "iid": {"data.partition": "iid"}},
        "algorithm": ["fedavg", "s2fl"],
    }}
    raw.update(fields)
    return ExperimentSpec.model_validate(raw)


def test_grid_is_the_cartesian_product_in_axis_order_with_overrides_applied():
    cells = expand(_spec())
    assert len(cells) == 8
    assert [c.labels for c in cells[:3]] == [
        {"seed": "0", "partition": "dir0.1", "algorithm": "fedavg"},
        {"seed": "0", "partition": "dir0.1", "algorithm": "s2fl"},
        {"seed": "0", "partition": "iid", "algorithm": "fedavg"},
    ]
    c = cells[5]   # seed 1, dir0.1, s2fl
    assert c.labels == {"seed": "1", "partition": "dir0.1", "algorithm": "s2fl"}
    assert (c.config.seed, c.config.data.seed, c.config.data.alpha, c.config.algorithm) == (1, 1, 0.1, "s2fl")
    assert (c.config.rounds, c.config.data.num_devices) == (2, 4)            # from base
    assert c.cell_id == "seed-1__partition-dir0.1__algorithm-s2fl"
    assert len({cell.cell_id for cell in cells}) == len({cell.config_hash for cell in cells}) == 8


def test_exclude_rules_and_only_filters():
    spec = _spec(exclude=[{"algorithm": "s2fl", "partition": ["iid"]}])
    cells = expand(spec)
    assert len(cells) == 6
    assert not any(c.labels["algorithm"] == "s2fl" and c.labels["partition"] == "iid" for c in cells)
    sub = expand(spec, parse_only(["seed=0", "algorithm=fedavg,s2fl"]))
    assert {c.labels["seed"] for c in sub} == {"0"} and len(sub) == 3


def test_config_hash_follows_the_resolved_config_not_the_labels():
    a = expand(_spec())[0]
    b = expand(_spec(base={"rounds": 3, "data": {"num_devices": 4}}))[0]
    assert a.cell_id == b.cell_id and a.config_hash != b.config_hash


def _ran(cell, **drop_or_set) -> dict:
    """The config.yaml a run of ``cell`` wrote (run_id included), with settings removed (value
    None: a setting the project added after the run) or changed."""
    ran = {"run_id": "abc123", **cell.config.model_dump(mode="json")}
    for dotted, value in drop_or_set.items():
        *parents, leaf = dotted.split("__")
        node = ran
        for part in parents:
            node = node[part]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return ran


def test_a_run_is_the_cell_s_when_only_settings_added_since_at_their_defaults_differ():
    cell = expand(_spec())[1]   # s2fl, with every setting at its default but those the file sets
    assert cell.ran_as(cell.config_hash, None)                       # the same hash: no reading needed
    assert cell.ran_as("old-hash", _ran(cell))                       # the same settings, another hash
    # settings added after the run (absent from its config.yaml), here at their defaults
    assert cell.ran_as("old-hash", _ran(cell, deadlines__evaluate_s=None, evaluation=None))
    assert not cell.ran_as("old-hash", None)                         # nothing to compare with


@pytest.mark.parametrize("changes", [
    {"rounds": 3},                                  # the file changed a setting
    {"grouping__group_loss": "per_member"},          # a default changed since the run
    {"train__retired_setting": 1},                   # a setting the configuration no longer has
])
def test_a_run_with_any_other_difference_is_not_the_cell_s(changes):
    cell = expand(_spec())[1]
    assert not cell.ran_as("old-hash", _ran(cell, **changes))


def test_an_added_setting_the_cell_sets_away_from_its_default_is_a_difference():
    cell = expand(_spec(base={"rounds": 2, "data": {"num_devices": 4}, "deadlines": {"evaluate_s": 5.0}}))[1]
    assert not cell.ran_as("old-hash", _ran(cell, deadlines__evaluate_s=None))


@pytest.mark.parametrize("fields, message", [
    ({"axes": {}}, "non-empty"),
    ({"axes": {"algorithm": ["fedavg", "fedavg"]}}, "duplicate"),
    ({"axes": {"x": {"key": "seed", "keys": ["seed"], "values": [1]}}}, "exactly one"),
    ({"axes": {"a": {"bad label!": {}}}}, "axis label"),
    ({"exclude": [{"nope": "x"}]}, "unknown axis"),
    ({"exclude": [{"algorithm": "fedprox"}]}, "unknown labels"),
    ({"report": {"series": "nope"}}, "unknown axis"),
    ({"targets": [1.5]}, "targets"),
    ({"surprise": 1}, "Extra inputs"),
])
def test_bad_experiment_files_are_rejected_with_the_reason(fields, message):
    with pytest.raises(ValueError, match=message):
        _spec(**fields)


def test_an_invalid_cell_config_names_the_cell():
    spec = _spec(axes={"algorithm": ["fedavg", "no-such-algorithm"]})
    with pytest.raises(ValueError, match="algorithm=no-such-algorithm"):
        expand(spec)


def test_an_invalid_cell_config_is_one_line_per_field_with_the_cell():
    from shared.run_config import ConfigError

    spec = _spec(axes={"lr": {"neg": {"train.lr": -1, "rounds": 0}}})
    with pytest.raises(ConfigError) as info:
        expand(spec)
    assert sorted(info.value.lines) == ["cell lr=neg: rounds: must be greater than or equal to 1 (got 0)",
                                        "cell lr=neg: train.lr: must be greater than 0 (got -1)"]


def test_experiment_file_errors_name_the_file_and_the_field(tmp_path):
    from shared.run_config import ConfigError

    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_spec(missing)
    assert info.value.lines == [f"{missing}: file not found"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: t\naxes: {algorithm: [fedavg]}\nsurprise: 1\n")
    with pytest.raises(ConfigError) as info:
        load_spec(bad)
    [line] = info.value.lines
    assert line.startswith(f"{bad}: surprise: unknown key in the top level (valid keys: name, description, base, axes")


def test_only_filters_are_checked():
    with pytest.raises(ValueError, match="unknown labels"):
        expand(_spec(), parse_only(["seed=7"]))
    with pytest.raises(ValueError, match="AXIS=LABEL"):
        parse_only(["seed"])


def test_series_and_repeat_defaults():
    spec = _spec()
    assert spec.series_axes == ["seed"] and spec.repeat_axis is None   # the first axis is the series
    spec = _spec(report={"series": ["algorithm", "partition"]})
    assert spec.repeat_axis == "seed"
    assert spec.series_label({"seed": "0", "partition": "iid", "algorithm": "s2fl"}) == "s2fl/iid"


def test_every_shipped_experiment_file_expands(tmp_path):
    from pathlib import Path

    files = sorted(Path(__file__).resolve().parents[3].joinpath("experiments", "grids").glob("*.yaml"))
    assert len(files) >= 8
    for path in files:
        spec = load_spec(path)
        assert expand(spec), path


def test_a_run_from_before_a_setting_matches_the_value_that_keeps_its_behaviour_not_a_changed_default():
    # split.warm_up came with the paper's warm-up as its default, which changed later: a run
    # recorded before the setting existed (no split.warm_up in its config.yaml) ran the paper's
    # warm-up, so it is a cell that names every_split, and not one at today's default.
    from experiments.grid import Cell, build_config

    paper = Cell({"v": "paper"}, build_config({"algorithm": "s2fl", "split": {"warm_up": "every_split"}}, {}))
    default = Cell({"v": "default"}, build_config({"algorithm": "s2fl"}, {}))
    assert default.config.split.warm_up == "estimated"
    ran = paper.config.model_dump(mode="json")
    del ran["split"]["warm_up"]
    assert paper.ran_as("an older hash", ran) and not default.ran_as("an older hash", ran)
    # A run that recorded the setting is compared with it as recorded.
    recorded = default.config.model_dump(mode="json")
    assert default.ran_as("an older hash", recorded) and not paper.ran_as("an older hash", recorded)
    # split.undominated came on by default: a run from before it ran the rule without it.
    rule = Cell({"v": "rule"}, build_config({"algorithm": "s2fl", "split": {"undominated": False}}, {}))
    ran = rule.config.model_dump(mode="json")
    del ran["split"]["undominated"]
    assert rule.ran_as("an older hash", ran) and not default.ran_as("an older hash", ran)


def test_every_committed_result_still_counts_as_its_grid_s_run():
    # docs/results/<grid> holds each shipped grid's committed cells. A changed default must not
    # make them look unrun (run again from scratch) nor match cells that now run something else:
    # the grids name the values their cells ran with (docs/experiments.md, "Resume").
    from pathlib import Path

    from experiments.runner import is_finished

    root = Path(__file__).resolve().parents[3]
    checked = 0
    for path in sorted((root / "experiments" / "grids").glob("*.yaml")):
        out = root / "docs" / "results" / path.stem
        if out.is_dir():
            unrun = [cell.cell_id for cell in expand(load_spec(path)) if not is_finished(out, cell)]
            assert not unrun, (path.name, unrun[:3])
            checked += 1
    assert checked >= 10
