"""The device-side privacy defences (``split_privacy.defences``): the split floor, activation noise,
NoPeek's distance correlation and the randomised-response label noise."""
from __future__ import annotations

import math

import pytest
import torch

from shared.algorithms.label_noise import randomised_response_targets
from shared.algorithms.nopeek import distance_correlation
from shared.algorithms.privacy_defence import private_generator
from shared.algorithms.registry import build_privacy_defences


def _defence(name: str, **params):
    return build_privacy_defences([name], {name: params} if params else {})[0]


def test_floor_leaves_out_the_shallower_cuts():
    assert _defence("floor", split=2).split_points([1, 2, 3]) == [2, 3]
    assert _defence("floor", split=4).split_points([1, 2, 3]) == []


def test_parameters_are_checked_by_name():
    with pytest.raises(ValueError, match=r"split_privacy.defence_params.floor"):
        build_privacy_defences(["floor"], {})
    with pytest.raises(ValueError, match=r"split_privacy.defence_params.noise"):
        build_privacy_defences(["noise"], {"noise": {"scale": -1.0}})
    with pytest.raises(ValueError, match="names a defence twice"):
        build_privacy_defences(["noise", "noise"], {})
    with pytest.raises(ValueError, match="does not name"):
        build_privacy_defences(["noise"], {"nopeek": {"weight": 1.0}})


@pytest.mark.parametrize("scale", [0.1, 1.0])
def test_noise_is_scaled_to_each_samples_rms(scale):
    fx = torch.randn(8, 16, 7, 7) * torch.tensor([0.1, 1, 10, 100, 1, 1, 1, 1]).view(-1, 1, 1, 1)
    sent = _defence("noise", scale=scale).sent_activations(fx, torch.Generator().manual_seed(0))
    rms = fx.flatten(1).pow(2).mean(1).sqrt()
    ratio = (sent - fx).flatten(1).pow(2).mean(1).sqrt() / rms
    assert torch.allclose(ratio, torch.full_like(ratio, scale), rtol=0.1)
    assert not sent.requires_grad


def test_private_generator_draws_differ():
    assert not torch.equal(torch.rand(4, generator=private_generator()), torch.rand(4, generator=private_generator()))


def test_distance_correlation():
    gen = torch.Generator().manual_seed(0)
    x, z = torch.randn(512, 10, generator=gen), torch.randn(512, 10, generator=gen)
    assert float(distance_correlation(x, x)) == pytest.approx(1.0, abs=1e-4)
    assert float(distance_correlation(x, 3 * x + 1)) == pytest.approx(1.0, abs=1e-4)   # scale and shift free
    # Less the less the activations say of the inputs (the sample statistic is biased above 0).
    assert float(distance_correlation(x, z)) < 0.35 < float(distance_correlation(x, x + z)) < 0.9


def test_nopeek_penalty_is_differentiable_in_the_activations_and_skips_one_sample():
    nopeek = _defence("nopeek", weight=2.0)
    x = torch.randn(16, 1, 4, 4)
    fx = (x.flatten(1) @ torch.randn(16, 8)).requires_grad_(True)
    penalty = nopeek.activation_penalty(x, fx)
    assert penalty is not None
    assert float(penalty.detach()) == pytest.approx(2.0 * float(distance_correlation(x, fx).detach()))
    penalty.backward()
    assert fx.grad is not None and torch.isfinite(fx.grad).all() and fx.grad.abs().sum() > 0
    assert nopeek.activation_penalty(x[:1], fx[:1]) is None


def test_randomised_response_targets_are_unbiased_and_keep_the_label_at_the_stated_rate():
    classes, epsilon = 10, 2.0
    labels = torch.arange(classes).repeat(20_000)
    targets = randomised_response_targets(labels, classes, epsilon, torch.Generator().manual_seed(0))
    assert torch.allclose(targets.sum(1), torch.ones(len(labels)))
    onehot = torch.nn.functional.one_hot(labels, classes).float()
    assert torch.allclose(targets.view(20_000, classes, classes).mean(0), onehot[:classes], atol=0.05)
    kept = float((targets.argmax(1) == labels).float().mean())
    assert kept == pytest.approx(math.exp(epsilon) / (math.exp(epsilon) + classes - 1), abs=0.01)


def test_label_noise_needs_u_shaped_cross_entropy():
    label_noise = _defence("label_noise", epsilon=1.0)
    assert "u_shaped" in label_noise.problem(False, "cross_entropy")
    assert "train.loss" in label_noise.problem(True, "mse")
    assert label_noise.problem(True, "cross_entropy") is None
    with pytest.raises(ValueError, match="class labels"):
        label_noise.gradient_targets(torch.zeros(4, 10), 10, torch.Generator())
