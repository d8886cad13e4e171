"""The Main Server computes the run's loss where the labels are: a regression plan's group step
trains on the MSE of float targets, one label-count bin per device, and refuses class labels.
Plans, joins and steps come from the ``kit`` fixture (conftest.py)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from main_server.group_round import GroupRound
from shared.config import TrainConfig
from shared.errors import Invalid
from shared.models import build_model
from shared.wire import encode_state
from shared.schemas import JoinRequest

OUTPUTS = 1


def _plan(kit, devices: list[str], loss: str = "mse", task: str | None = None):
    model = build_model("logreg", OUTPUTS, (1, 1, kit.FEATURES), seed=0)
    return kit.make_plan(devices, grouping="balanced", group_size=2, num_classes=OUTPUTS,
                         server_weights=encode_state(model.portion(1, len(model.blocks)).state_dict()),
                         train=TrainConfig(lr=kit.LR, batch_size=kit.BATCH, loss=loss, task=task))


def test_a_regression_group_step_descends_the_mse_of_the_float_targets(kit):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(kit.BATCH, kit.FEATURES, generator=gen)
    y = torch.randn(kit.BATCH, generator=gen)

    async def body() -> None:
        state = GroupRound(_plan(kit, ["a"]), kit.Uploads())
        answer = await state.join(JoinRequest(device_id="a", label_counts=[kit.BATCH], num_steps=1))
        assert answer.members == ["a"] and answer.label_distance == 0.0   # one bin: nothing to balance
        group = state.group_by_device["a"]
        head = group.trainer.portion
        before = {k: v.clone() for k, v in head.state_dict().items()}
        # The reference: the MSE of the head's one output against the targets, by hand.
        weight, bias = before["blocks.head.weight"].clone().requires_grad_(), before["blocks.head.bias"].clone()
        bias.requires_grad_()
        fx = x.clone().requires_grad_()
        expected = ((fx @ weight.T + bias).squeeze(1) - y).square().mean()
        expected.backward()
        outcome = await state.step(kit.step_req("a", 0, x, y))
        assert outcome.result.loss == pytest.approx(float(expected.detach()), rel=1e-6)
        assert torch.allclose(outcome.result.dfx, fx.grad, atol=1e-6)
        after = head.state_dict()
        assert torch.allclose(after["blocks.head.weight"], weight.detach() - kit.LR * weight.grad, atol=1e-6)
    kit.run(body)


def test_a_regression_round_refuses_class_labels_and_several_bins(kit):
    async def body() -> None:
        state = GroupRound(_plan(kit, ["a", "b"]), kit.Uploads())
        with pytest.raises(Invalid, match="a regression task counts all samples in 1 bin"):
            await state.join(JoinRequest(device_id="a", label_counts=[2, 2], num_steps=1))
        await asyncio.gather(*(state.join(JoinRequest(device_id=d, label_counts=[kit.BATCH], num_steps=1))
                               for d in ("a", "b")))
        labels = torch.zeros(kit.BATCH, dtype=torch.int64)
        with pytest.raises(Invalid, match="labels: dtype int64 where float32 was expected"):
            await state.step(kit.step_req("a", 0, torch.zeros(kit.BATCH, kit.FEATURES), labels))
        with pytest.raises(Invalid, match="labels: shape \\[4, 2\\] where \\[4\\] was expected"):
            await state.step(kit.step_req("b", 0, torch.zeros(kit.BATCH, kit.FEATURES), torch.zeros(kit.BATCH, 2)))
    kit.run(body)


def test_an_import_path_loss_in_a_plan_is_used_only_when_the_operator_named_it(kit):
    async def body() -> None:
        plan = _plan(kit, ["a"], loss="my_pkg.losses:pinball", task="regression")   # never imported: refused first
        with pytest.raises(Invalid, match="start this process with --loss my_pkg.losses:pinball"):
            GroupRound(plan, kit.Uploads())
    kit.run(body)
