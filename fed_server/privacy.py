"""The run's differential privacy at the Fed Server (``privacy.*``; docs/privacy.md): each round's
terms for the devices (the clip bound), the noise the Fed Server adds to the sum of their clipped
updates (central noise), what an aggregated round spends (the ledger, over Opacus's accountant), the
adaptive clip bound's next value, and the budget's stop.

The noise multiplier ``z`` is the configured one, or the one that spends ``target_epsilon`` in
exactly ``rounds`` rounds at the sampling rate ``devices_per_round / num_devices``; it is kept in the
checkpoint, so a resumed run that changes ``rounds`` keeps its noise. That rate is a ceiling: a
round selects from the devices it may select (registered, not sitting out), and with fewer of them
than ``num_devices`` it selects fewer than ``devices_per_round`` (:meth:`RunPrivacy.devices_for`),
so that its own rate, which the ledger spends, is never above it.
"""
from __future__ import annotations

import logging
from typing import Any

from fed_server.run_dir import RunDirectory
from shared.config import RunConfig
from shared.privacy.accountant import PrivacyLedger
from shared.privacy.budget import count_stddev, run_noise_multiplier
from shared.privacy.clipping import AdaptiveClip
from shared.schemas import PrivacyTerms

log = logging.getLogger("fed_server")


class RunPrivacy:
    """The privacy terms and spending of one run (built only when ``privacy.clipping`` is set)."""

    def __init__(self, config: RunConfig, run_dir: RunDirectory | None = None) -> None:
        privacy = self.config = config.privacy
        #: Where each spend is noted before the round's model leaves (None: nowhere, in tests).
        self.run_dir = run_dir
        self.sample_rate = config.per_round / config.data.num_devices
        self.clip_norm = privacy.clip_norm
        self.ledger = PrivacyLedger(privacy.accountant, privacy.delta) if privacy.noise is not None else None
        self.noise_multiplier = run_noise_multiplier(config)
        self.adaptive = (AdaptiveClip(privacy.clip_norm, privacy.target_quantile, privacy.clip_learning_rate,
                                      count_stddev(config, self.noise_multiplier))
                         if privacy.clipping == "adaptive" else None)
        if self.adaptive is not None and self.noise_multiplier is not None:
            self.adaptive.update_noise_multiplier(self.noise_multiplier)   # ValueError: a count noise too small
        if privacy.noise is not None:
            log.info("privacy: noise multiplier %.4g (%s), clip bound %.4g (%s), sampling rate %.4g, delta %g",
                     self.noise_multiplier, "configured" if privacy.noise_multiplier else
                     f"spends epsilon {privacy.target_epsilon:g} in {config.rounds} rounds", self.clip_norm,
                     privacy.clipping, self.sample_rate, privacy.delta)

    # --- the round's terms --------------------------------------------------------------------
    def _update_multiplier(self) -> float:
        """The updates' noise multiplier: ``z``, less what adaptive clipping's count takes."""
        assert self.noise_multiplier is not None
        if self.adaptive is None:
            return self.noise_multiplier
        return self.adaptive.update_noise_multiplier(self.noise_multiplier)

    @property
    def distributed(self) -> bool:
        """Whether the devices add the noise (``privacy.noise: distributed``), not the Fed Server."""
        return self.config.noise == "distributed"

    def task_terms(self) -> PrivacyTerms:
        """What a training task tells its device: clip its update to the round's bound, and with
        distributed noise, the multiplier its share of the noise is drawn with."""
        return PrivacyTerms(clip_norm=self.clip_norm, noise_multiplier=self.noise_multiplier if self.distributed else None)

    def central_stds(self) -> tuple[float, float]:
        """The standard deviations of the noise the Fed Server adds to the sum of updates and to
        the count of unclipped devices (adaptive clipping); (0, 0) without noise or when the
        devices add it."""
        if self.noise_multiplier is None or self.distributed:
            return 0.0, 0.0
        count = self.adaptive.count_stddev if self.adaptive is not None else 0.0
        return self._update_multiplier() * self.clip_norm, count

    # --- what a round spends ------------------------------------------------------------------
    def devices_for(self, pool: int, per_round: int, population: int) -> int:
        """How many of a ``pool`` of selectable devices a round selects: ``per_round``, or fewer
        where that would sample them at a higher rate than ``per_round / population`` (the rate the
        noise and the budget are set for: an epsilon accounted at it would be too low)."""
        count = min(per_round, pool)
        if self.ledger is None:
            return count
        return min(count, per_round * pool // population)

    def release(self, aggregated: int, unclipped: float | None, sample_rate: float) -> dict[str, Any]:
        """Count an aggregated round of ``aggregated`` devices, ``unclipped`` of which (noised,
        adaptive clipping) had their update inside the bound, selected at ``sample_rate`` (those
        selected over those it selected from): spend its privacy, move the adaptive bound. Returns
        the round record's ``privacy`` fields (the epsilon after the round)."""
        record: dict[str, Any] = {"clip_norm": self.clip_norm}
        if self.ledger is not None:
            assert self.noise_multiplier is not None
            if sample_rate > self.sample_rate * (1 + 1e-12):
                raise RuntimeError(f"a round sampled at {sample_rate:.4g}, above the run's {self.sample_rate:.4g}")
            self.ledger.spend(self.noise_multiplier, sample_rate)
            if self.run_dir is not None:
                self.run_dir.write_released("privacy", self.ledger.state_dict())
            record.update(epsilon=self.ledger.epsilon(), delta=self.ledger.delta, noise_multiplier=self.noise_multiplier,
                          sample_rate=sample_rate)
        if self.adaptive is not None and unclipped is not None:
            fraction = unclipped / aggregated
            record["unclipped_fraction"] = fraction
            self.adaptive.observe(fraction)
            self.clip_norm = self.adaptive.clip_norm
        return record

    def exhausted(self) -> str | None:
        """Why the run stops here: one more round would raise epsilon past ``target_epsilon``
        (None: it may go on)."""
        target = self.config.target_epsilon
        if self.ledger is None or target is None:
            return None
        assert self.noise_multiplier is not None
        spent, after = self.ledger.epsilon(), self.ledger.epsilon_after(self.noise_multiplier, self.sample_rate)
        if after <= target:
            return None
        return (f"privacy budget: another round would raise epsilon from {spent:.4g} to {after:.4g}, past "
                f"privacy.target_epsilon {target:g} (delta {self.ledger.delta:g})")

    def epsilon(self) -> float | None:
        """The epsilon spent so far (None: the run adds no noise)."""
        return self.ledger.epsilon() if self.ledger is not None else None

    # --- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "clip_norm": self.clip_norm,
                "ledger": self.ledger.state_dict() if self.ledger is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: its multiplier, clip bound and ledger, and the rounds spent
        after it. A round's model leaves the Fed Server (the next round's tasks, federated
        evaluation) before the checkpoint that counts the round is written; a Fed Server stopped in
        between resumes before that round and runs it again, releasing a second model of it. So
        every spend is noted at once (:meth:`RunDirectory.write_released`), and a noted
        ledger with more rounds than the checkpoint's is the one continued: the round run again is
        counted again."""
        self.noise_multiplier = state["noise_multiplier"]
        self.clip_norm = float(state["clip_norm"])
        if self.adaptive is not None:
            self.adaptive.clip_norm = self.clip_norm
        if self.ledger is not None and state["ledger"] is not None:
            self.ledger.load_state_dict(state["ledger"])
            checkpointed = self.ledger.rounds
            released = self.run_dir.read_released("privacy") if self.run_dir is not None else None
            noted = PrivacyLedger(self.ledger.accountant, self.ledger.delta)
            noted.load_state_dict(released or {"history": []})
            if noted.rounds > checkpointed:
                self.ledger.history = noted.history
                log.warning("privacy: %d round(s) released after the last checkpoint, whose models left the Fed "
                            "Server before it stopped, are counted: epsilon %.4g", self.ledger.rounds - checkpointed,
                            self.ledger.epsilon())
