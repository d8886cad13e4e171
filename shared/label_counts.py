"""What a device tells the servers of its samples per class (``split_privacy.label_counts``).

S2FL's data-balance grouping (Eq. 2) needs each device's label counts, and they give its label
distribution away. A run chooses (docs/split-privacy.md, "Label counts"):

* ``exact``: the counts as they are (the paper);
* ``local_dp``: each count plus two-sided geometric noise (the discrete Laplace mechanism,
  ``P(k) ~ exp(-epsilon |k|)``), then clamped at zero. Adding or removing one sample changes one
  count by one, so the noisy counts are ``epsilon``-differentially private for each sample's label
  (under replacing one sample, ``2 epsilon``). The noise is drawn once per device, from the
  operating system's entropy, and the same counts are sent at every join: fresh noise each round
  would let the servers average it away. The device's total, ``num_samples``, is sent exactly
  (Algorithm 1 weighs by it);
* ``withheld``: no counts; the run must group without them (``Grouping.uses_label_counts``).
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Sequence

import numpy as np

from shared.config import SplitPrivacyConfig


def geometric_noise(size: int, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """``size`` draws of the two-sided geometric distribution, ``P(k) = (1-a)/(1+a) a^|k|`` with
    ``a = exp(-epsilon)``: the difference of two geometric counts of failures."""
    success = 1.0 - math.exp(-epsilon)
    return (rng.geometric(success, size) - rng.geometric(success, size)).astype(np.int64)


def reported_label_counts(counts: Sequence[int], split_privacy: SplitPrivacyConfig,
                          rng: np.random.Generator | None = None) -> list[int]:
    """The label counts a device reports, as ``split_privacy.label_counts`` says (empty: withheld).
    ``rng``: the noise's generator (None: one seeded from the operating system's entropy)."""
    if split_privacy.label_counts == "withheld":
        return []
    if split_privacy.label_counts == "exact":
        return [int(c) for c in counts]
    rng = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    noisy = np.asarray(counts, dtype=np.int64) + geometric_noise(len(counts), split_privacy.label_counts_epsilon, rng)
    reported = np.clip(noisy, 0, None)
    if reported.sum() == 0:   # a join must count something: the largest noisy count, as one sample
        reported[int(np.argmax(noisy))] = 1
    return [int(c) for c in reported]
