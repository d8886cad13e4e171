"""Unit tests for shared.config (and its full loading, shared.run_config): precedence of the config sources and strict validation."""
from __future__ import annotations

import json

import pytest
from shared.config import RunConfig, parse_override, set_dotted
from shared.run_config import ConfigError, resolve_run_config


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No SFL_RUN__* variable from the surrounding environment may leak into a test."""
    import os

    for name in list(os.environ):
        if name.startswith("SFL_RUN__"):
            monkeypatch.delenv(name)


def _yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ precedence
def test_defaults():
    cfg = resolve_run_config()
    assert cfg == RunConfig()
    assert cfg.train.lr == 0.05 and cfg.algorithm == "s2fl" and cfg.model == "cnn"
    assert cfg.per_round == cfg.data.num_devices == 10
    # the documented S2FL choices (docs/s2fl.md: "Why group size 4", "Members with more steps than others")
    assert cfg.grouping.group_size == 4 and cfg.grouping.group_loss == "data_weighted"


def test_file_overrides_defaults(tmp_path):
    cfg = resolve_run_config(_yaml(tmp_path, "train:\n  lr: 0.1\nrounds: 3\n"))
    assert cfg.train.lr == 0.1
    assert cfg.rounds == 3
    assert cfg.train.batch_size == 32  # untouched defaults stay


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"train": {"lr": 0.3}, "algorithm": "sfl"}))
    cfg = resolve_run_config(path)
    assert cfg.train.lr == 0.3 and cfg.algorithm == "sfl"


def test_empty_file_is_defaults(tmp_path):
    assert resolve_run_config(_yaml(tmp_path, "")) == RunConfig()


def test_non_mapping_file_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="must be a mapping"):
        resolve_run_config(_yaml(tmp_path, "- 1\n- 2\n"))


def test_env_overrides_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SFL_RUN__TRAIN__LR", "0.15")
    cfg = resolve_run_config(_yaml(tmp_path, "train:\n  lr: 0.1\n  batch_size: 16\n"))
    assert cfg.train.lr == 0.15
    assert cfg.train.batch_size == 16  # the file's sibling key survives


def test_override_beats_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SFL_RUN__TRAIN__LR", "0.15")
    cfg = resolve_run_config(_yaml(tmp_path, "train:\n  lr: 0.1\n"), overrides=["train.lr=0.2"])
    assert cfg.train.lr == 0.2


def test_env_only(monkeypatch):
    monkeypatch.setenv("SFL_RUN__TRAIN__LR", "0.15")
    monkeypatch.setenv("SFL_RUN__DATA__NUM_DEVICES", "4")
    monkeypatch.setenv("SFL_RUN__DEVICES_PER_ROUND", "2")
    monkeypatch.setenv("SFL_RUN__HALF_PRECISION", "true")
    cfg = resolve_run_config()
    assert cfg.train.lr == 0.15
    assert cfg.data.num_devices == 4 and cfg.devices_per_round == 2 and cfg.per_round == 2
    assert cfg.half_precision is True


def test_env_with_bare_prefix_is_ignored(monkeypatch):
    monkeypatch.setenv("SFL_RUN__", "whatever")
    assert resolve_run_config() == RunConfig()


def test_overrides_apply_in_order_and_parse_yaml_values():
    cfg = resolve_run_config(
        overrides=["train.lr=0.2", "train.lr=0.25", "devices.profiles=[low, high-mid]", "grouping.label_balance=false"]
    )
    assert cfg.train.lr == 0.25
    assert cfg.devices.profiles == ["low", "high-mid"]
    assert cfg.grouping.label_balance is False


# ------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "override",
    ["bogus=1", "train.bogus=1", "data.bogus=1", "grouping.nope=true", "deadlines.x=1", "devices.y=1", "split.z=1"],
)
def test_unknown_keys_rejected(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: unknown key in "):
        resolve_run_config(overrides=[override])


def test_unknown_key_in_file_rejected(tmp_path):
    with pytest.raises(ValueError):
        resolve_run_config(_yaml(tmp_path, "train:\n  learning_rate: 0.1\n"))


def test_unknown_env_key_rejected(monkeypatch):
    monkeypatch.setenv("SFL_RUN__TRAIN__LEARNING_RATE", "0.1")
    with pytest.raises(ValueError):
        resolve_run_config()


def test_unknown_algorithm_lists_valid_names():
    from shared.algorithms.registry import ALGORITHMS

    with pytest.raises(ValueError, match="unknown algorithm 'nope'") as info:
        resolve_run_config(overrides=["algorithm=nope"])
    for name in ALGORITHMS:
        assert name in str(info.value)


def test_unknown_model_lists_valid_names():
    from shared.models.zoo import MODEL_NAMES

    with pytest.raises(ValueError, match="unknown model 'resnet50'") as info:
        resolve_run_config(overrides=["model=resnet50"])
    for name in MODEL_NAMES:
        assert name in str(info.value)


def test_devices_per_round_cannot_exceed_num_devices():
    with pytest.raises(ValueError, match="devices_per_round cannot exceed"):
        resolve_run_config(overrides=["data.num_devices=3", "devices_per_round=4"])
    assert resolve_run_config(overrides=["data.num_devices=3", "devices_per_round=3"]).per_round == 3


@pytest.mark.parametrize(
    "override",
    ["train.lr=0", "train.lr=-1", "train.momentum=1", "train.batch_size=0", "rounds=0", "devices_per_round=0",
     "grouping.group_loss=sum", "devices.time_scale=0", "devices.time_scale=-2", "devices.time_scale=fast"],
)
def test_out_of_range_values_rejected(override):
    with pytest.raises(ValueError):  # pydantic's ValidationError, or run_config's check of plug-in names
        resolve_run_config(overrides=[override])


def test_time_scale_is_auto_by_default_or_a_number():
    assert resolve_run_config().devices.time_scale == "auto"
    assert resolve_run_config(overrides=["devices.time_scale=60"]).devices.time_scale == 60.0
    assert resolve_run_config(overrides=["devices.time_scale=auto"]).devices.time_scale == "auto"


# ------------------------------------------------------------------------------------ helpers
def test_parse_override():
    assert parse_override("train.lr=0.1") == ("train.lr", 0.1)
    assert parse_override(" model = cnn") == ("model", "cnn")
    assert parse_override("a=b=c") == ("a", "b=c")
    assert parse_override("x=[1, 2]") == ("x", [1, 2])
    assert parse_override("flag=true") == ("flag", True)


@pytest.mark.parametrize("text", ["train.lr", "", "lr:0.1"])
def test_parse_override_requires_equals(text):
    with pytest.raises(ValueError, match="must look like key.path=value"):
        parse_override(text)


def test_resolve_rejects_override_without_equals():
    with pytest.raises(ValueError, match="key.path=value"):
        resolve_run_config(overrides=["train.lr"])


def test_set_dotted_creates_levels():
    d: dict = {"a": {"keep": 1}}
    set_dotted(d, "a.b.c", 2)
    set_dotted(d, "top", 3)
    assert d == {"a": {"keep": 1, "b": {"c": 2}}, "top": 3}
