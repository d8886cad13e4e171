"""A device trains with the run's loss: the algorithm's device logic gets it, and a task that names
another loss than the run's (which the device checked when it started) is refused."""
from __future__ import annotations

import pytest
import torch

from device_agent.task_training import _task_terms
from shared.algorithms.base import Payload
from shared.algorithms.registry import ALGORITHMS
from shared.data import ArrayDataset
from shared.config import TrainConfig
from shared.errors import Invalid
from shared.losses import build_loss
from shared.models import build_model_layout
from shared.schemas import TaskResponse

LAYOUT = build_model_layout("cnn", 10, (1, 28, 28))


def _task(**train) -> TaskResponse:
    return TaskResponse(status="train", round_id=1, split_point=2, num_blocks=2, algorithm="fedprox",
                        params={"mu": 0.0}, train=TrainConfig(**train))


def test_the_device_logic_trains_on_the_run_s_loss():
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(5, 3), torch.randn(5)
    for name in ("fedavg", "fedprox"):
        logic = ALGORITHMS[name].device_logic({"mu": 0.0} if name == "fedprox" else {}, build_loss("mse"))
        logic.begin_round(model, Payload(), ArrayDataset(x, y, 1))
        expected = (model(x).squeeze(1) - y).square().mean()
        assert logic.loss(model, x, y).item() == pytest.approx(expected.item())
    classes = torch.nn.Linear(3, 4)
    default = ALGORITHMS["fedavg"].device_logic({})     # no loss given: cross-entropy, as before
    labels = torch.tensor([0, 1, 2, 3, 0])
    assert torch.equal(default.loss(classes, x, labels), torch.nn.functional.cross_entropy(classes(x), labels))


def test_a_task_naming_another_loss_than_the_run_s_is_refused():
    _, logic, _ = _task_terms(_task(loss="mse"), build_loss("mse"), LAYOUT)
    assert logic.criterion.name == "mse"
    with pytest.raises(Invalid, match="the task's loss 'l1' \\(regression\\) is not the run's 'mse'"):
        _task_terms(_task(loss="l1"), build_loss("mse"), LAYOUT)
