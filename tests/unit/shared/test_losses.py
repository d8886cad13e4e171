"""The loss registry (shared/losses.py): names and tasks, what each built-in computes, the
evaluation sums, the origin check of an import-path loss, and the warning for a squashing head."""
from __future__ import annotations

import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shared.config import TrainConfig
from shared.losses import LOSSES, build_loss, check_loss_origin, label_counts_problem, resolve_task, softmax_head_warning


def test_every_built_in_loss_names_a_torch_function_and_a_task():
    for name, builtin in LOSSES.items():
        assert callable(getattr(F, builtin.function)), name
        assert resolve_task(name, None) == builtin.task
    assert TrainConfig().loss == "cross_entropy" and TrainConfig().task == "classification"
    assert TrainConfig(loss="mse").task == "regression"


@pytest.mark.parametrize(("loss", "task", "message"), [
    ("squared", None, "unknown loss 'squared': use a built-in name"),
    ("my_pkg.losses:pinball", None, "is an import path: set train.task to classification or regression"),
    ("mse", "classification", "loss 'mse' is a regression loss, but train.task is 'classification'"),
])
def test_a_loss_the_task_cannot_be_known_for_is_refused_in_one_line(loss, task, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(loss=loss, task=task)


def test_an_import_path_takes_its_task_from_the_config():
    assert TrainConfig(loss="my_pkg.losses:pinball", task="regression").task == "regression"


def test_cross_entropy_is_exactly_what_training_and_evaluation_computed_before():
    gen = torch.Generator().manual_seed(0)
    out, y = torch.randn(7, 4, generator=gen), torch.randint(0, 4, (7,), generator=gen)
    loss = build_loss()
    assert torch.equal(loss.mean(out, y), F.cross_entropy(out, y))
    assert torch.equal(loss.total(out, y), F.cross_entropy(out, y, reduction="sum"))


def test_a_single_target_is_compared_with_the_single_output_and_sums_are_per_sample():
    out = torch.tensor([[1.0], [3.0]])
    y = torch.tensor([0.0, 1.0])                   # [N] against [N, 1]: no broadcast to [N, N]
    mse = build_loss("mse")
    assert mse.mean(out, y).item() == pytest.approx((1 + 4) / 2)
    assert mse.total(out, y).item() == pytest.approx(1 + 4)
    two = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    targets = torch.zeros(2, 2)
    # Each sample's loss is averaged over its targets: the sum over samples is the mean times N.
    assert mse.total(two, targets).item() == pytest.approx(mse.mean(two, targets).item() * 2)
    assert build_loss("mae").mean(out, y).item() == pytest.approx((1 + 2) / 2)


def test_multi_label_predictions_are_probabilities():
    loss = build_loss("bce_with_logits")
    out = torch.tensor([[0.0, 2.0]])
    assert loss.task == "regression" and loss.expects_logits
    assert torch.allclose(loss.predictions(out), torch.sigmoid(out))
    assert build_loss("mse").predictions(out) is out


def test_a_users_loss_is_imported_only_where_the_operator_named_it(tmp_path, monkeypatch):
    # The targets arrive shaped like the output ([N, 1] here), so the function needs no squeeze.
    (tmp_path / "user_losses.py").write_text("def doubled(out, y):\n    return 2 * ((out - y) ** 2).mean()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "user_losses", raising=False)
    check_loss_origin("mse", None)                       # a built-in name may come from anywhere
    with pytest.raises(ValueError, match="start this process with --loss user_losses:doubled"):
        check_loss_origin("user_losses:doubled", None)
    assert "user_losses" not in sys.modules
    check_loss_origin("user_losses:doubled", "user_losses:doubled")
    loss = build_loss("user_losses:doubled", "regression")
    out, y = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 1.0])
    assert loss.mean(out, y).item() == pytest.approx(5.0) and loss.total(out, y).item() == pytest.approx(10.0)
    assert not loss.expects_logits


def _head(*last: nn.Module) -> nn.Sequential:
    return nn.Sequential(OrderedDict(body=nn.Linear(4, 4), head=nn.Sequential(nn.Linear(4, 3), *last)))


def test_a_head_that_squashes_what_the_loss_expects_raw_gets_a_warning_saying_what_to_do():
    ce = build_loss()
    warning = softmax_head_warning(_head(nn.Softmax(dim=1)), ce)
    assert warning is not None and "ends in nn.Softmax" in warning and "remove the final nn.Softmax" in warning
    assert "train.loss: nll" in (softmax_head_warning(_head(nn.LogSoftmax(dim=1)), ce) or "")
    assert softmax_head_warning(_head(), ce) is None                              # raw logits: fine
    assert softmax_head_warning(_head(nn.LogSoftmax(dim=1)), build_loss("nll")) is None   # log-probs for nll
    assert softmax_head_warning(_head(nn.Sigmoid()), build_loss("bce_with_logits")) is not None
    assert softmax_head_warning(_head(nn.Sigmoid()), build_loss("mse")) is None


def test_label_counts_have_one_bin_for_a_regression_task():
    assert label_counts_problem(10, 10, "classification") is None
    assert label_counts_problem(1, 3, "regression") is None
    assert label_counts_problem(3, 10, "classification") == "label_counts has 3 entries; the model has 10 classes"
    assert "a regression task counts all samples in 1 bin" in (label_counts_problem(3, 3, "regression") or "")
