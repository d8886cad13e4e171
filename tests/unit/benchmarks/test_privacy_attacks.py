"""The privacy benchmark's attacks (benchmarks/privacy_attacks.py) on constructed cases: each must
succeed where the evidence says the label, and stay at chance where it says nothing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks import privacy_attacks as attacks
from benchmarks.images import ssim, to_unit_range
from shared.data import load_dataset
from shared.data.spec import DataSpec
from shared.models import build_model
from shared.secagg.encoding import encode

CLASSES = 10


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _labels(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CLASSES, (n,), generator=_generator(seed))


def _cross_entropy_gradients(labels: torch.Tensor, features: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """What a device with a linear head ``W`` sends up under cross-entropy: ``W^T (p - onehot(y))``,
    with ``p`` a softmax of random logits (a model that has learnt little)."""
    generator = _generator(seed)
    weight = torch.randn(CLASSES, features, generator=generator)
    p = torch.softmax(0.5 * torch.randn(len(labels), CLASSES, generator=generator), dim=1)
    return (p - torch.nn.functional.one_hot(labels, CLASSES).float()) @ weight, weight


def test_binary_auc_known_values_and_ties() -> None:
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8])
    assert attacks.binary_auc(scores, torch.tensor([False, False, True, True])) == pytest.approx(0.75)
    assert attacks.binary_auc(scores, torch.tensor([False, False, False, True])) == pytest.approx(1.0)
    assert attacks.binary_auc(-scores, torch.tensor([False, False, False, True])) == pytest.approx(0.0)
    assert attacks.binary_auc(torch.zeros(4), torch.tensor([True, False, True, False])) == pytest.approx(0.5)
    assert attacks.binary_auc(scores, torch.ones(4, dtype=torch.bool)) != attacks.binary_auc(scores, torch.ones(4, dtype=torch.bool))


def test_reading_the_labels_is_a_perfect_attack() -> None:
    labels = _labels(500)
    result = attacks.judge(attacks.one_hot_scores(labels, CLASSES), labels)
    assert (result.accuracy, result.auc, result.samples) == (1.0, 1.0, 500)
    assert result.chance_accuracy == pytest.approx(float(torch.bincount(labels).max()) / 500)
    with pytest.raises(ValueError):
        attacks.judge(torch.zeros(3, CLASSES), labels)


def test_similarity_attack_reads_cross_entropy_gradients_and_not_noise() -> None:
    labels = _labels(2000)
    gradients, weight = _cross_entropy_gradients(labels)
    result = attacks.judge(attacks.similarity_scores(gradients, weight), labels)
    assert result.accuracy > 0.95 and result.auc > 0.99
    unrelated = attacks.judge(attacks.similarity_scores(torch.randn(2000, 64, generator=_generator(3)), weight), labels)
    assert unrelated.accuracy < unrelated.chance_accuracy + 0.05 and abs(unrelated.auc - 0.5) < 0.03


def test_direction_attack_clusters_cross_entropy_gradients_and_not_noise() -> None:
    labels = _labels(2000)
    gradients, _ = _cross_entropy_gradients(labels)
    assert attacks.direction_attack(gradients, labels, CLASSES).accuracy > 0.9
    unrelated = attacks.direction_attack(torch.randn(2000, 64, generator=_generator(4)), labels, CLASSES)
    assert unrelated.accuracy < unrelated.chance_accuracy + 0.1 and abs(unrelated.auc - 0.5) < 0.05


def test_norm_attack_finds_the_class_with_larger_gradients_and_not_in_noise() -> None:
    labels = _labels(8000)
    gradients = torch.randn(8000, 64, generator=_generator(5))
    scaled = gradients * torch.where(labels == 3, 3.0, 1.0)[:, None]
    found = attacks.norm_attack(scaled, labels, CLASSES)
    assert found.auc > 0.99 and found.accuracy > 0.98
    assert found.chance_accuracy == pytest.approx(1 - float((labels == 3).double().mean()))
    unrelated = attacks.norm_attack(gradients, labels, CLASSES)
    assert unrelated.auc < 0.55 and unrelated.accuracy < unrelated.chance_accuracy + 0.02


def _device_counts(devices: int, seed: int = 0) -> torch.Tensor:
    """Devices' label counts, each skewed towards a class of its own (Dirichlet-like)."""
    generator = _generator(seed)
    counts = torch.randint(5, 40, (devices, CLASSES), generator=generator)
    counts[torch.arange(devices), torch.randint(0, CLASSES, (devices,), generator=generator)] += 100
    return counts


def test_head_update_attack_reads_the_bias_change_and_not_noise() -> None:
    counts = _device_counts(200)
    generator = _generator(6)
    global_bias = torch.randn(CLASSES, generator=generator)
    # The bias rises with the share of each class, less what the model already predicts.
    shares = counts.double() / counts.sum(dim=1, keepdim=True)
    uploads = [global_bias + 0.1 * (share - 0.1) + 0.002 * torch.randn(CLASSES, generator=generator) for share in shares]
    scores = attacks.distribution_scores([attacks.head_update_scores(global_bias, u) for u in uploads])
    found = attacks.device_level(scores, counts)
    assert found.accuracy == 1.0 and found.auc > 0.95
    noise = attacks.distribution_scores([torch.randn(CLASSES, generator=generator) for _ in range(200)])
    unrelated = attacks.device_level(noise, counts)
    assert unrelated.accuracy < 0.25 and abs(unrelated.auc - 0.5) < 0.05


def test_head_update_attack_reads_fixed_point_words_as_the_change_and_finds_only_noise_once_masked() -> None:
    # Under secure aggregation the Fed Server stores int64 words of each device's change: unmasked
    # they still give the class shares away (the attack is not blind to the encoding), masked
    # they give nothing.
    counts = _device_counts(200)
    generator = _generator(8)
    shares = counts.double() / counts.sum(dim=1, keepdim=True)
    changes = [0.1 * (share - 0.1) + 0.002 * torch.randn(CLASSES, generator=generator) for share in shares]
    words = [torch.from_numpy(encode(c.numpy(), bits=30, limit=1.0).view(np.int64)) for c in changes]
    global_bias = torch.randn(CLASSES, generator=generator)
    read = attacks.device_level(attacks.distribution_scores(
        [attacks.head_update_scores(global_bias, w) for w in words]), counts)
    assert read.accuracy == 1.0 and read.auc > 0.95
    masked = [w + torch.randint(-2**62, 2**62, (CLASSES,), generator=generator) for w in words]
    hidden = attacks.device_level(attacks.distribution_scores(
        [attacks.head_update_scores(global_bias, w) for w in masked]), counts)
    assert hidden.accuracy < 0.25 and abs(hidden.auc - 0.5) < 0.05


def test_an_inverse_network_rebuilds_through_an_invertible_front_and_not_through_a_blind_one() -> None:
    generator = _generator(7)
    # Images with structure: a bright square at a random place on a dark ground.
    images = torch.zeros(600, 1, 14, 14)
    corners = torch.randint(0, 9, (600, 2), generator=generator)
    for image, (y, x) in zip(images, corners.tolist()):
        image[0, y:y + 5, x:x + 5] = 1.0
    auxiliary, private = images[:500], images[500:]
    invertible = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(196, 128))
    blind = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(196, 128))
    with torch.no_grad():
        blind[1].weight.zero_()
    baseline = ssim(auxiliary.mean(dim=0, keepdim=True).expand_as(private), private).mean()
    for front, rebuilds in ((invertible, True), (blind, False)):
        inverse = attacks.train_inverse(front, auxiliary, epochs=20)
        with torch.no_grad():
            score = ssim(inverse(front(private)).clamp(0, 1), private).mean()
        assert (score > baseline + 0.3) == rebuilds, (score, baseline)


def test_unsplit_rebuilds_through_a_front_it_only_knows_the_shape_of_and_not_through_a_blind_one() -> None:
    # Four MNIST digits through the cnn's first block, whose weights UnSplit does not know (its
    # clone starts from another seed), against a front that averages each channel over the whole
    # image: UnSplit finds the digits through the first (SSIM 0.28 where the test set's mean image
    # scores 0.08) and nothing through the second.
    train, test = load_dataset(DataSpec(max_samples=200))
    low, high = float(train.x.min()), float(train.x.max())
    images = test.x[:4]
    truth = to_unit_range(images, low, high)

    def front(seed: int, blind: bool) -> torch.nn.Module:
        first = build_model("cnn", 10, (1, 28, 28), seed=seed).portion(0, 1)
        return torch.nn.Sequential(first, torch.nn.AdaptiveAvgPool2d(1)) if blind else first

    budget = attacks.UnSplitBudget(rounds=8, input_steps=40, model_steps=40, lr=2e-3)
    found = {}
    for blind in (False, True):
        with torch.no_grad():
            fx = front(1, blind)(images)
        rebuilt = attacks.unsplit(front(2, blind), fx, (1, 28, 28), low, high, budget, seed=3)
        assert rebuilt.shape == truth.shape and 0.0 <= float(rebuilt.min()) <= float(rebuilt.max()) <= 1.0
        found[blind] = float(ssim(rebuilt, truth).mean())
    mean_image = float(ssim(to_unit_range(test.x[100:600].mean(dim=0, keepdim=True), low, high).expand_as(truth),
                            truth).mean())
    assert found[False] > mean_image + 0.1 and found[True] < mean_image, (found, mean_image)
