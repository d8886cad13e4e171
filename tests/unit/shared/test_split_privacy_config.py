"""The run's privacy settings are checked at start, one line each: U-shaped mode and the
defences only where a split algorithm runs, a head at a split point, withheld label counts only
with a grouping that reads none, and cuts left to choose."""
from __future__ import annotations

import pytest

from shared.models import build_model
from shared.run_config import ConfigError, load_run_config, split_candidates


def _refused(config: dict) -> str:
    with pytest.raises(ConfigError) as refused:
        load_run_config(config)
    assert len(refused.value.lines) == 1
    return refused.value.lines[0]


def test_split_depth_zero_takes_no_privacy_setting():
    assert "split.u_shaped does not apply" in _refused({"algorithm": "fedavg", "split": {"u_shaped": True}})
    assert "split_privacy.defences does not apply" in _refused({"algorithm": "fedavg", "split_privacy": {"defences": ["noise"]}})


def test_the_head_must_start_at_a_split_point_and_leave_a_cut_before_it():
    # resnet8: 6 blocks, split points 1-3; a head of 2 blocks starts at block 4.
    line = _refused({"model": "resnet8", "split": {"u_shaped": True, "head_blocks": 2}})
    assert "split.head_blocks: 2" in line and "not a split point" in line
    assert "would leave the Main Server no middle" in _refused(
        {"split": {"u_shaped": True, "candidates": [1, 3]}})


def test_withheld_counts_need_a_grouping_that_reads_none():
    line = _refused({"algorithm": "s2fl", "split_privacy": {"label_counts": "withheld"}})
    assert "grouping 'balanced' groups by label counts" in line and "random" in line
    load_run_config({"algorithm": "s2fl", "grouping": {"method": "random"}, "split_privacy": {"label_counts": "withheld"}})


def test_label_noise_needs_u_shaped_mode():
    assert "split_privacy.defences: label_noise: " in _refused({"split_privacy": {"defences": ["label_noise"]}})


def test_a_floor_above_every_cut_is_refused():
    assert "leave no cut" in _refused({"split_privacy": {"defences": ["floor"],
                                                   "defence_params": {"floor": {"split": 3}}},
                                       "split": {"u_shaped": True}})


def test_split_candidates_u_shaped_with_a_floor():
    config = load_run_config({"split": {"u_shaped": True}, "split_privacy": {"defences": ["floor"],
                                                                       "defence_params": {"floor": {"split": 2}}}})
    assert split_candidates(config, build_model("cnn")) == [2]   # cnn: split points 1-3, head at 3
    assert split_candidates(load_run_config({}), build_model("cnn")) == [1, 2, 3]
