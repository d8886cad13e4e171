"""The Gaussian noise has the stated scale (a statistical test with a fixed seed), and leaves integer
entries alone."""
import math

import torch
from scipy import stats

from shared.privacy.noise import add_noise


def test_the_noise_has_the_stated_standard_deviation():
    std = 0.37
    values = {"w": torch.zeros(400, 500), "steps": torch.tensor(3)}
    noised = add_noise(values, std, torch.Generator().manual_seed(12345))
    sample = noised["w"].flatten()
    n = sample.numel()
    assert noised["steps"] is values["steps"]
    # The sample variance's 99.9 % interval under N(0, std^2): (n - 1) s^2 / std^2 is chi-square(n - 1).
    variance = float(sample.var())
    low, high = (stats.chi2.ppf(p, n - 1) * std ** 2 / (n - 1) for p in (0.0005, 0.9995))
    assert low <= variance <= high
    assert abs(float(sample.mean())) < 3.3 * std / math.sqrt(n)
    # And it is Gaussian: a Kolmogorov-Smirnov test against N(0, std^2).
    assert stats.kstest(sample[:20000].numpy(), "norm", args=(0, std)).pvalue > 0.001


def test_a_wrong_scale_fails_the_same_test():
    """The test above can fail: noise 2 % off the stated scale is outside its interval."""
    sample = add_noise({"w": torch.zeros(200000)}, 0.37 * 1.02, torch.Generator().manual_seed(12345))["w"]
    n = sample.numel()
    high = stats.chi2.ppf(0.9995, n - 1) * 0.37 ** 2 / (n - 1)
    assert float(sample.var()) > high
