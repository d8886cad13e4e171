"""Sample-level DP-SGD in a device's round (device_agent/dp_sgd.py, through device_agent/trainer.py):
each sample's gradient clipped, the noise of the stated scale, in a whole-model round and through
the Main Server's dfx in a split round; nothing of Opacus left on the model afterwards."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from device_agent.timing import RoundClock
from device_agent.trainer import TrainContext, TrainSettings, batches, train_round
from shared.config import DpSgdConfig
from shared.data import ArrayDataset
from shared.models import build_model

SHAPE = (1, 8, 8)
N = 12
LR = 0.5
CLIP = 0.05


def _data() -> ArrayDataset:
    gen = torch.Generator().manual_seed(1)
    y = torch.arange(N) % 2
    x = torch.randn(N, *SHAPE, generator=gen)
    x[y == 0, :, :, :4] += 1.0
    return ArrayDataset(x=x, y=y, num_classes=2)


def _settings(noise: float) -> TrainSettings:
    # One batch of every sample, one epoch: one DP-SGD step.
    return TrainSettings(LR, 0.0, 0.0, N, 1, 0, dp_sgd=DpSgdConfig(noise_multiplier=noise, max_grad_norm=CLIP))


def _clipped_mean(per_sample: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each sample's gradient clipped to CLIP over all parameters together, summed, over the batch size."""
    total = {k: torch.zeros_like(v) for k, v in per_sample[0].items()}
    for grads in per_sample:
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads.values()))
        factor = min(1.0, CLIP / (float(norm) + 1e-6))
        for k, g in grads.items():
            total[k] += factor * g
    return {k: v / len(per_sample) for k, v in total.items()}


def _whole_model_expected(model, data) -> dict[str, torch.Tensor]:
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    per_sample = []
    for i in range(N):
        loss = F.cross_entropy(ref(data.x[i:i + 1]), data.y[i:i + 1])
        grads = torch.autograd.grad(loss, list(params.values()))
        per_sample.append(dict(zip(params, grads)))
    step = _clipped_mean(per_sample)
    return {k: p.detach() - LR * step[k] for k, p in params.items()}


def _trained(model, k: int, context: TrainContext, noise: float) -> dict[str, torch.Tensor]:
    client = copy.deepcopy(model)
    weights = {key: v.clone() for key, v in client.portion(0, k).state_dict().items()}
    train_round(client, k, weights, _data(), _settings(noise), context)
    portion = client.portion(0, k)
    # Nothing of Opacus stays on the model: no per-sample gradients, no hooks.
    assert not any(hasattr(p, "grad_sample") for p in portion.parameters())
    assert not any(m._forward_hooks or m._backward_hooks for m in portion.modules())
    return dict(portion.named_parameters())


@pytest.fixture(scope="module")
def model():
    return build_model("cnn", num_classes=2, input_shape=SHAPE, seed=0)


def test_a_whole_model_step_is_the_mean_of_clipped_per_sample_gradients(model):
    n_blocks = len(model.blocks)
    trained = _trained(model, n_blocks, TrainContext(RoundClock(None)), noise=1e-9)
    expected = _whole_model_expected(model, _data())
    for key, value in trained.items():
        torch.testing.assert_close(value.detach(), expected[key], atol=1e-5, rtol=1e-4, msg=key)
    # The clip bound acted: without it the step would be the plain mean gradient's.
    plain = copy.deepcopy(model)
    loss = F.cross_entropy(plain(_data().x), _data().y)
    loss.backward()
    assert any(not torch.allclose(p.detach() - LR * p.grad, trained[k].detach(), atol=1e-4)
               for k, p in plain.named_parameters())


def test_a_split_step_clips_the_per_sample_gradients_that_come_through_dfx(model):
    k = 1
    server = copy.deepcopy(model).portion(k, len(model.blocks))
    received: list[torch.Tensor] = []

    def send_step(step: int, fx: torch.Tensor, labels: torch.Tensor):
        inp = fx.detach().clone().requires_grad_(True)
        loss = F.cross_entropy(server(inp), labels)
        dfx = torch.autograd.grad(loss, inp)[0]
        received.append(dfx)
        return dfx, float(loss.detach())

    trained = _trained(model, k, TrainContext(RoundClock(None), send_step=send_step), noise=1e-9)
    # By hand: sample i's gradient is the batch size times its row of dfx pulled back through the front.
    front = copy.deepcopy(model).portion(0, k)
    params = dict(front.named_parameters())
    (x, _), = batches(_data(), N, 1, 0)   # the round's one batch, in its shuffled order
    (dfx,) = received
    per_sample = []
    for i in range(N):
        fx = front(x[i:i + 1])
        grads = torch.autograd.grad(fx, list(params.values()), grad_outputs=N * dfx[i:i + 1])
        per_sample.append(dict(zip(params, grads)))
    step = _clipped_mean(per_sample)
    for key, value in trained.items():
        torch.testing.assert_close(value.detach(), params[key].detach() - LR * step[key], atol=1e-5, rtol=1e-4,
                                   msg=key)


def test_the_noise_has_the_stated_scale(model):
    # Noise multiplier 1: each parameter moves by LR x (its clipped mean gradient + N(0, CLIP^2) / N).
    n_blocks = len(model.blocks)
    trained = _trained(model, n_blocks, TrainContext(RoundClock(None)), noise=1.0)
    expected = _whole_model_expected(model, _data())
    noise = torch.cat([((trained[k].detach() - expected[k]) * N / -LR).flatten() for k in expected])
    assert noise.numel() > 1000
    assert abs(float(noise.std()) / CLIP - 1.0) < 0.1
    assert abs(float(noise.mean())) < 0.1 * CLIP
