"""A regression task end to end in the shared code: which runs the configuration check refuses (one
line each), and float targets through the data loaders, the held-out split and the label counts."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shared.data import ArrayDataset
from shared.data.holdout import holdout_split
from shared.data.local import DataError, load_csv, load_local, load_npz
from shared.data.spec import DataSpec
from shared.run_config import ConfigError, load_run_config

LOCAL = {"dataset": "local", "num_devices": 3, "num_classes": 1, "input_shape": [1, 1, 4]}
MODEL = {"model": "logreg"}


def _config(**changes) -> dict:
    return {"algorithm": "fedavg", **MODEL, "data": dict(LOCAL), "train": {"loss": "mse"}, **changes}


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
def test_algorithms_that_need_no_classes_run_a_regression_task(algorithm):
    config = load_run_config(_config(algorithm=algorithm))
    assert config.train.task == "regression"


@pytest.mark.parametrize("algorithm", ["s2fl", "sfl"])
def test_split_learning_runs_a_regression_task(algorithm):
    # S2FL's grouping balances label counts: a regression task counts all samples in one bin,
    # so its groups are formed by size alone (docs/models.md, "Loss and task").
    config = load_run_config(_config(algorithm=algorithm, model="cnn", data={**LOCAL, "input_shape": [1, 28, 28]}))
    assert config.train.task == "regression"


@pytest.mark.parametrize(("changes", "message"), [
    ({"algorithm": "fedbc"}, "algorithm 'fedbc' needs class labels (its devices report the accuracy"),
    ({"algorithm": "fnr-fl"}, "algorithm 'fnr-fl' needs class labels"),
    ({"algorithm": "fedipg"}, "algorithm 'fedipg' needs class labels"),
    ({"selection": "hics"}, "selection 'hics' needs class labels"),
    ({"data": {"dataset": "mnist"}}, "is a regression task, but data set 'mnist' holds class labels"),
])
def test_what_needs_class_labels_refuses_a_regression_task_in_one_line(changes, message):
    with pytest.raises(ConfigError) as info:
        load_run_config(_config(**changes))
    assert len(info.value.lines) == 1 and message in info.value.lines[0], info.value.lines
    assert "cannot run a regression task (train.loss 'mse')" in info.value.lines[0] or "mnist" in message


def test_a_bad_loss_is_a_config_error_naming_the_train_settings():
    with pytest.raises(ConfigError) as info:
        load_run_config(_config(train={"loss": "squared"}))
    assert info.value.lines == [
        "train: unknown loss 'squared': use a built-in name (cross_entropy, nll, mse, l1, mae, smooth_l1, huber, "
        "bce_with_logits) or an import path package.module:function"]


def _spec(num_classes: int = 1) -> DataSpec:
    return DataSpec(dataset="local", num_classes=num_classes, input_shape=[2], label_column="y")


def test_float_targets_are_kept_for_a_regression_task(tmp_path: Path):
    np.savez(tmp_path / "one.npz", x=np.ones((3, 2), np.float32), y=np.array([0.5, -1.25, 3.0]))
    data = load_npz(tmp_path / "one.npz", _spec(), task="regression")
    assert data.y.dtype == torch.float32 and data.y.tolist() == [0.5, -1.25, 3.0]
    np.savez(tmp_path / "two.npz", x=np.ones((3, 2), np.float32), y=np.arange(6, dtype=np.float64).reshape(3, 2))
    assert load_npz(tmp_path / "two.npz", _spec(2), task="regression").y.shape == (3, 2)
    (tmp_path / "rows.csv").write_text("a,y,b\n1,0.25,2\n3,-7.5,4\n")
    data = load_csv(tmp_path / "rows.csv", _spec(), task="regression")
    assert data.y.tolist() == [0.25, -7.5] and data.x.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    with pytest.raises(DataError, match="must hold integer class labels, got dtype float64"):
        load_npz(tmp_path / "one.npz", _spec(), task="classification")


@pytest.mark.parametrize(("y", "num_classes", "message"), [
    (np.array([1.0, np.nan, 2.0]), 1, "holds NaN or infinite targets \\(first in sample 1\\)"),
    (np.zeros((3, 3)), 2, "must be \\[N, 2\\] targets \\(data.num_classes = 2 model outputs\\), got shape \\[3, 3\\]"),
    (np.array(["a", "b", "c"]), 1, "must hold numeric targets"),
])
def test_bad_targets_are_one_line_naming_the_file(tmp_path: Path, y, num_classes, message):
    np.savez(tmp_path / "bad.npz", x=np.ones((3, 2), np.float32), y=y)
    with pytest.raises(DataError, match=message):
        load_npz(tmp_path / "bad.npz", _spec(num_classes), task="regression")


def test_csv_regression_takes_one_target_and_image_folders_none(tmp_path: Path):
    (tmp_path / "rows.csv").write_text("a,y,b\n1,x,2\n")
    with pytest.raises(DataError, match="line 2, column 'y': 'x' is not a number"):
        load_csv(tmp_path / "rows.csv", _spec(), task="regression")
    with pytest.raises(DataError, match="a .csv file holds one target column"):
        load_csv(tmp_path / "rows.csv", _spec(2), task="regression")
    (tmp_path / "images" / "0").mkdir(parents=True)
    spec = DataSpec(dataset="local", num_classes=1, input_shape=[1, 4, 4])
    with pytest.raises(DataError, match="an image folder's sub-folders are classes, but the run is a regression task"):
        load_local(str(tmp_path / "images"), spec, {}, task="regression")


def test_float_targets_count_in_one_bin_and_are_held_out_unstratified():
    data = ArrayDataset(torch.zeros(10, 2), torch.linspace(0, 1, 10), 1)
    assert data.label_counts().tolist() == [10]
    train, held = holdout_split(np.zeros((10, 3), np.float32), 0.2, seed=1)
    assert len(train) == 8 and len(held) == 2 and sorted([*train, *held]) == list(range(10))
