"""The run's privacy ledger: every aggregated round's noise multiplier and sampling rate, and the
epsilon they spend at the run's delta, computed by Opacus's accountants (its Renyi-DP accountant,
or its privacy-random-variable one), never by hand.

Opacus is imported when a ledger first computes an epsilon: it takes seconds to import, and only a
run with ``privacy.noise`` needs it (the Fed Server, and the configuration check of such a run).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

#: One run of rounds with the same terms, as Opacus keeps them: (noise multiplier, sampling rate, rounds).
Entry = tuple[float, float, int]
AccountantName = Literal["rdp", "prv"]


def require_opacus(what: str = "privacy.noise needs Opacus's accountant") -> None:
    """ValueError in one line, starting with ``what``, where Opacus is not installed (it is an
    optional dependency)."""
    try:
        import opacus  # noqa: F401   (seconds to import: only where a run adds noise)
    except ImportError:
        raise ValueError(f"{what}: pip install 's2fl-testbed[privacy]'") from None


def epsilon_of(accountant: AccountantName, history: list[Entry], delta: float) -> float:
    """Opacus's epsilon at ``delta`` for ``history`` (0 before any round)."""
    if not history:
        return 0.0
    require_opacus()
    from opacus.accountants import create_accountant

    ledger = create_accountant(mechanism=accountant)
    ledger.history = [tuple(entry) for entry in history]
    return float(ledger.get_epsilon(delta=delta))


def calibrated_noise_multiplier(target_epsilon: float, delta: float, sample_rate: float, rounds: int,
                                accountant: AccountantName) -> float:
    """The smallest noise multiplier (within Opacus's tolerance of 0.01 in epsilon) that spends at
    most ``target_epsilon`` in ``rounds`` rounds at ``sample_rate`` (Opacus's ``get_noise_multiplier``)."""
    require_opacus()
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta, sample_rate=sample_rate,
                                      steps=rounds, accountant=accountant))


@dataclass
class PrivacyLedger:
    """What the run has spent: ``history`` in Opacus's form, merged as Opacus merges its steps (a
    round with the terms of the last entry adds to it). Checkpointed with the run."""

    accountant: AccountantName
    delta: float
    history: list[Entry] = field(default_factory=list)

    def epsilon(self) -> float:
        """The epsilon spent so far, at :attr:`delta`."""
        return epsilon_of(self.accountant, self.history, self.delta)

    def epsilon_after(self, noise_multiplier: float, sample_rate: float) -> float:
        """The epsilon one more round with these terms would bring the run to."""
        return epsilon_of(self.accountant, _merged(self.history, noise_multiplier, sample_rate), self.delta)

    def spend(self, noise_multiplier: float, sample_rate: float) -> None:
        """Count one aggregated round released with these terms."""
        self.history = _merged(self.history, noise_multiplier, sample_rate)

    @property
    def rounds(self) -> int:
        return sum(steps for _, _, steps in self.history)

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint (msgpack: lists, not tuples)."""
        return {"accountant": self.accountant, "delta": self.delta, "history": [list(e) for e in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ledger."""
        self.history = [(float(z), float(q), int(steps)) for z, q, steps in state["history"]]


def _merged(history: list[Entry], noise_multiplier: float, sample_rate: float) -> list[Entry]:
    """``history`` with one more round of these terms (as Opacus's ``step`` adds one)."""
    if history and history[-1][:2] == (noise_multiplier, sample_rate):
        return [*history[:-1], (noise_multiplier, sample_rate, history[-1][2] + 1)]
    return [*history, (noise_multiplier, sample_rate, 1)]
