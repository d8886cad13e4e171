"""Unit tests for shared.run_config's error messages: one line per wrong field, naming the field,
what it must be and what it got, without pydantic's internals; files that are missing or not
valid YAML/JSON are named with the line."""
from __future__ import annotations

import pytest

from shared.algorithms.registry import ALGORITHMS
from shared.run_config import ConfigError, load_run_config, resolve_run_config


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("SFL_RUN__"):
            monkeypatch.delenv(name)


def _lines(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(data)
    assert str(info.value) == "\n".join(info.value.lines)
    return info.value.lines


def _assert_no_pydantic_internals(lines: list[str]) -> None:
    for line in lines:
        assert "\n" not in line
        for internal in ("type=", "input_value", "input_type", "pydantic.dev", "validation error for",
                         "Value error,", "Input should be"):
            assert internal not in line, line


@pytest.mark.parametrize("data, expected", [
    ({"train": {"lr": -1}}, "train.lr: must be greater than 0 (got -1)"),
    ({"rounds": "abc"}, "rounds: must be a valid integer, unable to parse string as an integer (got 'abc')"),
    ({"data": {"partition": "foo"}}, "data.partition: must be 'iid', 'dirichlet' or 'natural' (got 'foo')"),
    ({"train": 5}, "train: must be a mapping of settings (got 5)"),
    ({"grouping": {"method": "random", "label_balance": True}},
     "grouping: set grouping.method or grouping.label_balance, not both"),
    ({"data": {"num_devices": 3}, "devices_per_round": 4}, "devices_per_round cannot exceed data.num_devices"),
    ({"algorithm": "nope"}, f"unknown algorithm 'nope'; choose one of {sorted(ALGORITHMS)}"),
])
def test_one_line_naming_the_field_what_it_must_be_and_what_it_got(data, expected):
    lines = _lines(data)
    assert lines == [expected]
    _assert_no_pydantic_internals(lines)


def test_every_wrong_field_gets_its_own_line():
    lines = _lines({"train": {"lr": -1, "batch_size": 0}, "rounds": 0, "data": {"partition": "foo"}})
    assert sorted(line.split(":")[0] for line in lines) == ["data.partition", "rounds", "train.batch_size", "train.lr"]
    _assert_no_pydantic_internals(lines)


def test_unknown_key_says_which_key_where_and_the_valid_ones():
    from shared.config import TrainConfig

    [line] = _lines({"train": {"lrr": 0.1}})
    assert line == f"train.lrr: unknown key in train (valid keys: {', '.join(TrainConfig.model_fields)})"
    [line] = _lines({"trian": {}})
    assert line.startswith("trian: unknown key in the top level (valid keys: algorithm, model, ")


def test_parameters_of_the_algorithm_selector_and_transform_are_named_under_their_mapping():
    from shared.algorithms.fedbc import FedBCParams

    [line] = _lines({"algorithm": "fedbc", "algorithm_params": {"lam": 1}})
    assert line == ("algorithm_params.lam: unknown key in algorithm_params "
                    f"(valid keys: {', '.join(FedBCParams.model_fields)})")
    [line] = _lines({"algorithm": "s2fl", "algorithm_params": {"x": 1}})
    assert line == "algorithm_params.x: unknown key in algorithm_params (it takes no keys)"
    [line] = _lines({"algorithm": "fedbc", "algorithm_params": {"gamma": -1}})
    assert line.startswith("algorithm_params.gamma: must be ") and line.endswith("(got -1)")
    [line] = _lines({"selection": "hics", "selection_params": {"temperature": "hot"}})
    assert line.startswith("selection_params.temperature: must be a valid number")
    [line] = _lines({"algorithm": "fedavg", "data": {"num_devices": 3, "partition": "iid",
                                                     "device_transform": "gaussian_noise",
                                                     "device_transform_params": {"sigma": -1}}})
    assert line == "data.device_transform_params.sigma: must be greater than or equal to 0 (got -1)"


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        resolve_run_config(missing)
    assert info.value.lines == [f"{missing}: file not found"]


@pytest.mark.parametrize("name, text, where", [
    ("run.yaml", "train:\n  lr: 0.1\n rounds: 3\n", ", line 3, column 2: not valid YAML: "),
    ("run.json", '{"train": {"lr": 0.1,}}', ", line 1, column 22: not valid JSON: "),
])
def test_syntax_error_names_the_file_and_line(tmp_path, name, text, where):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve_run_config(path)
    [line] = info.value.lines
    assert line.startswith(f"{path}{where}"), line


def test_malformed_override_is_one_line():
    with pytest.raises(ConfigError) as info:
        resolve_run_config(overrides=["train.lr=[1"])
    [line] = info.value.lines
    assert line.startswith("override 'train.lr=[1': the value is not valid YAML")


def test_a_split_algorithm_whose_device_logic_defines_a_loss_is_refused(monkeypatch):
    # In split mode the Main Server computes the loss: a device objective would never be used.
    import torch

    from shared.algorithms import registry
    from shared.algorithms.base import DeviceLogic
    from shared.algorithms.split_learning import S2FL

    class OwnLoss(DeviceLogic):
        def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return model(x).sum()

    class SplitWithOwnLoss(S2FL):
        Logic = OwnLoss

    monkeypatch.setitem(registry.ALGORITHMS, "split_own_loss", SplitWithOwnLoss)
    with pytest.raises(ValueError, match=r"its device logic \(OwnLoss\) defines its own loss, which split training "
                                         r"never computes"):
        load_run_config({"algorithm": "split_own_loss"})
    load_run_config({"algorithm": "s2fl"})


PRIVATE = {"algorithm": "fedavg", "aggregation": {"rule": "mean"}, "privacy": {"clipping": "fixed"},
           "data": {"num_devices": 10}, "devices_per_round": 5}
NOISED = {**PRIVATE, "privacy": {"clipping": "fixed", "noise": "central", "noise_multiplier": 1.0, "delta": 1e-3}}
SECURE = {"algorithm": "fedavg", "aggregation": {"rule": "mean"}, "secure_aggregation": {"enabled": True},
          "data": {"num_devices": 10}, "devices_per_round": 5}
# Distributed noise: z = 1, C = 1, threshold 3: a device's share has std 1 / sqrt(3), so the range
# must hold 1 + 8 / sqrt(3) = 5.62.
DISTRIBUTED = {**SECURE, "secure_aggregation": {"enabled": True, "threshold": 3, "value_range": 6.0},
               "privacy": {"clipping": "fixed", "noise": "distributed", "noise_multiplier": 1.0, "delta": 1e-3}}


def _with(base: dict, **changes) -> dict:
    data = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for dotted, value in changes.items():
        section, _, key = dotted.partition(".")
        if key:
            data.setdefault(section, {})[key] = value
        else:
            data[section] = value
    return data


def test_private_runs_of_a_weighted_mean_pass():
    for data in (PRIVATE, NOISED, _with(PRIVATE, algorithm="s2fl"), _with(PRIVATE, algorithm="fedadam"),
                 _with(NOISED, **{"privacy.clipping": "adaptive", "privacy.clipped_count_stddev": 2.0})):
        load_run_config(data)


@pytest.mark.parametrize("data, message", [
    (_with(PRIVATE, algorithm="fedbc"), "privacy.clipping cannot run algorithm 'fedbc': it weighs each device's update"),
    (_with(PRIVATE, algorithm="scaffold"), "privacy.clipping cannot run algorithm 'scaffold': each device sends"),
    (_with(PRIVATE, selection="hics"), "privacy.clipping cannot run selection 'hics'"),
    (_with(PRIVATE, **{"aggregation.rule": "median"}), "privacy.clipping needs aggregation.rule: mean (got 'median'"),
    (_with(PRIVATE, **{"aggregation.rule": "krum"}), "needs aggregation.rule: mean (got 'krum'"),
    (_with(PRIVATE, **{"aggregation.rule": "trimmed_mean"}), "privacy.clipping needs aggregation.rule: mean"),
    (_with(PRIVATE, **{"updates.max_norm": 5.0}), "privacy.clipping replaces updates.max_norm"),
    (_with(PRIVATE, algorithm="s2fl", **{"grouping.member_defences": ["member_updates"]}),
     "privacy.clipping cannot run grouping.member_defences member_updates"),
    (_with(PRIVATE, **{"privacy.noise": "central"}), "privacy.noise needs privacy.noise_multiplier or"),
    (_with(PRIVATE, **{"privacy.noise_multiplier": 1.0}), "privacy.noise_multiplier and privacy.target_epsilon need"),
    (_with(NOISED, **{"privacy.delta": 0.5}), "privacy.delta 0.5 is not below 1 / data.num_devices"),
    (_with(NOISED, **{"privacy.noise_multiplier": 0.3, "privacy.target_epsilon": 1.0}),
     "privacy.noise_multiplier 0.3 spends epsilon"),
    (_with(NOISED, **{"privacy.clipping": "adaptive", "privacy.clipped_count_stddev": 0.4}),
     "privacy.clipped_count_stddev 0.4 is too small"),
    (_with(SECURE, algorithm="fedbc"), "secure_aggregation cannot run algorithm 'fedbc': it weighs each device's"),
    (_with(SECURE, algorithm="scaffold"), "secure_aggregation cannot run algorithm 'scaffold'"),
    (_with(SECURE, selection="hics"), "secure_aggregation cannot run selection 'hics'"),
    (_with(SECURE, **{"aggregation.rule": "median"}), "secure_aggregation needs aggregation.rule: mean (got 'median'"),
    (_with(SECURE, **{"aggregation.rule": "krum"}), "secure_aggregation needs aggregation.rule: mean (got 'krum'"),
    (_with(SECURE, **{"aggregation.rule": "trimmed_mean"}), "secure_aggregation needs aggregation.rule: mean"),
    (_with(SECURE, **{"aggregation.rule": "bounded_mean"}), "secure_aggregation needs aggregation.rule: mean"),
    (_with(SECURE, **{"updates.max_norm": 5.0}), "secure_aggregation cannot run updates.max_norm"),
    (_with(SECURE, privacy={"clipping": "fixed"}), "secure_aggregation runs privacy.clipping only with privacy.noise: "
                                                   "distributed"),
    (_with(DISTRIBUTED, **{"privacy.noise": "central"}), "secure_aggregation runs privacy.clipping only with"),
    (_with(NOISED, **{"privacy.noise": "distributed"}), "privacy.noise: distributed needs secure_aggregation.enabled"),
    (_with(DISTRIBUTED, **{"secure_aggregation.threshold": None}),
     "privacy.noise: distributed needs secure_aggregation.threshold"),
    (_with(DISTRIBUTED, **{"privacy.clipping": "adaptive"}), "privacy.noise: distributed needs privacy.clipping: fixed"),
    (_with(DISTRIBUTED, **{"secure_aggregation.value_range": 5.0}),
     "secure_aggregation.value_range 5 would cut the devices' noise: with noise multiplier 1, clip bound 1 and "
     "threshold 3 it must be at least 5.619"),
    (_with(SECURE, model="resnet8"), "secure_aggregation cannot run model 'resnet8': its integer state entries"),
    (_with(SECURE, **{"secure_aggregation.threshold": 6}), "secure_aggregation.threshold 6 exceeds the 5 devices"),
    (_with(SECURE, **{"secure_aggregation.neighbours": 3}), "secure_aggregation.neighbours must be even"),
    (_with(SECURE, **{"secure_aggregation.neighbours": 2, "secure_aggregation.threshold": 4}),
     "secure_aggregation.threshold 4 exceeds a neighbourhood's 3 shares"),
])
def test_what_a_private_or_secure_run_cannot_serve_is_refused_in_one_line(data, message):
    with pytest.raises(ConfigError) as info:
        load_run_config(data)
    assert len(info.value.lines) == 1 and message in info.value.lines[0], info.value.lines


def test_secure_runs_of_a_whole_model_weighted_mean_pass():
    for data in (SECURE, _with(SECURE, algorithm="fedprox"), _with(SECURE, algorithm="fedadam"),
                 _with(SECURE, algorithm="s2fl"), _with(SECURE, algorithm="sfl"),
                 _with(SECURE, algorithm="s2fl", **{"split.u_shaped": True}),
                 _with(SECURE, **{"secure_aggregation.threshold": 5}), DISTRIBUTED,
                 _with(SECURE, **{"secure_aggregation.neighbours": 2, "secure_aggregation.threshold": 3}),
                 _with(DISTRIBUTED, **{"privacy.noise_multiplier": None, "privacy.target_epsilon": 8.0,
                                      "secure_aggregation.value_range": 8.0})):
        load_run_config(data)


def test_withheld_label_counts_run_with_every_grouping_that_reads_none():
    for method in ("random", "singleton", "speed"):
        load_run_config({"algorithm": "s2fl", "split_privacy": {"label_counts": "withheld"},
                         "grouping": {"method": method}})


DP_SGD = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}


@pytest.mark.parametrize("data", [
    {"algorithm": "fedavg", "model": "cnn"},
    {"algorithm": "s2fl", "model": "cnn", "split_privacy": {"defences": ["noise"], "defence_params": {"noise": {"scale": 0.5}}}},
])
def test_dp_sgd_runs_where_every_device_gradient_is_a_sum_over_samples(data):
    config = load_run_config({**data, "train": {"dp_sgd": DP_SGD}})
    assert config.train.dp_sgd is not None and config.train.dp_sgd.delta == 1e-5


@pytest.mark.parametrize("data, expected", [
    ({"algorithm": "s2fl", "split": {"u_shaped": True}}, "does not run in U-shaped mode"),
    ({"algorithm": "fedprox"}, "algorithm 'fedprox''s device objective"),
    ({"algorithm": "s2fl", "split_privacy": {"defences": ["nopeek"], "defence_params": {"nopeek": {"weight": 0.5}}}},
     "split_privacy.defences nopeek add a penalty"),
    ({"algorithm": "fedavg", "model": "resnet8", "data": {"dataset": "cifar10"}},
     "Opacus cannot train the device's blocks of model 'resnet8' privately"),
    # BatchNorm1d in the last block, past every cut (tests/integration/batchnorm_model.py): the Main
    # Server trains it over the batch, and the gradient it sends down for a sample mixes the others.
    ({"algorithm": "s2fl", "model": "batchnorm_model:net"},
     "the Main Server's blocks of model 'batchnorm_model:net' normalise over the batch (BatchNorm1d)"),
])
def test_dp_sgd_is_refused_in_one_line_where_it_would_not_be_dp_sgd(data, expected):
    lines = _lines({**data, "train": {"dp_sgd": DP_SGD}})
    assert len(lines) == 1 and expected in lines[0] and "train.dp_sgd" in lines[0], lines
