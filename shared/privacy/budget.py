"""A private run's noise from its configuration: the noise multiplier (configured, or calibrated
to spend ``target_epsilon`` in the planned rounds) and adaptive clipping's count noise. Shared by the
configuration check (``shared/run_config.py``) and the Fed Server (``fed_server/privacy.py``)."""
from __future__ import annotations

from shared.config import RunConfig
from shared.privacy.accountant import calibrated_noise_multiplier


def run_noise_multiplier(config: RunConfig) -> float | None:
    """The run's noise multiplier: the configured one, or the one that spends ``target_epsilon`` in
    ``rounds`` rounds (None: no noise)."""
    privacy = config.privacy
    if privacy.noise is None:
        return None
    if privacy.noise_multiplier is not None:
        return privacy.noise_multiplier
    assert privacy.target_epsilon is not None   # PrivacyConfig: noise needs one of the two
    return calibrated_noise_multiplier(privacy.target_epsilon, privacy.delta, config.per_round / config.data.num_devices,
                                       config.rounds, privacy.accountant)


def count_stddev(config: RunConfig, noise_multiplier: float | None) -> float:
    """Adaptive clipping's noise on the count of unclipped devices: ``privacy.clipped_count_stddev``,
    or Andrew et al.'s devices per round / 20, raised to the noise multiplier where that is larger
    (with fewer than about 40 devices a round, a twentieth would take most of the budget: the
    updates' multiplier grows without bound as the count's nears half of it)."""
    configured = config.privacy.clipped_count_stddev
    if configured is not None:
        return configured
    return max(config.per_round / 20, noise_multiplier or 0.0)
