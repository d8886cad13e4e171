"""Label counts as a device reports them (``split_privacy.label_counts``): exact, withheld, or with
two-sided geometric noise for local differential privacy."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared.config import SplitPrivacyConfig
from shared.label_counts import geometric_noise, reported_label_counts

COUNTS = [40, 0, 12, 300, 7, 0, 0, 55, 1, 90]


def test_exact_and_withheld():
    assert reported_label_counts(COUNTS, SplitPrivacyConfig()) == COUNTS
    assert reported_label_counts(COUNTS, SplitPrivacyConfig(label_counts="withheld")) == []


@pytest.mark.parametrize("epsilon", [0.5, 2.0])
def test_geometric_noise_is_the_discrete_laplace_distribution(epsilon):
    draws = geometric_noise(200_000, epsilon, np.random.default_rng(0))
    a = math.exp(-epsilon)
    # P(k) = (1-a)/(1+a) a^|k|: symmetric, P(0) and the variance 2a/(1-a)^2 as the mechanism's.
    assert abs(draws.mean()) < 0.05
    assert np.mean(draws == 0) == pytest.approx((1 - a) / (1 + a), abs=0.01)
    assert draws.var() == pytest.approx(2 * a / (1 - a) ** 2, rel=0.05)


def test_local_dp_counts_are_noised_non_negative_and_need_no_seed():
    privacy = SplitPrivacyConfig(label_counts="local_dp", label_counts_epsilon=0.5)
    reported = reported_label_counts(COUNTS, privacy, np.random.default_rng(1))
    assert len(reported) == len(COUNTS) and min(reported) >= 0 and reported != COUNTS
    # Without a generator each call draws from the system's entropy: two devices' noise differs.
    draws = {tuple(reported_label_counts(COUNTS, privacy)) for _ in range(5)}
    assert len(draws) > 1


def test_local_dp_counts_of_an_almost_empty_device_still_count_something():
    privacy = SplitPrivacyConfig(label_counts="local_dp", label_counts_epsilon=0.1)
    for seed in range(50):
        assert sum(reported_label_counts([0, 1, 0], privacy, np.random.default_rng(seed))) >= 1
