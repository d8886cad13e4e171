"""The privacy ledger: its epsilon is Opacus's own computation for the same history (RDP and
PRV), rounds merge as Opacus merges steps, a checkpointed ledger continues where it stopped, and
the calibrated multiplier spends the target in the planned rounds."""
import pytest
from opacus.accountants import PRVAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

from shared.privacy.accountant import PrivacyLedger, calibrated_noise_multiplier

HISTORY = [(1.1, 0.1, 1), (1.1, 0.1, 1), (0.9, 0.1, 1), (1.1, 0.01, 1)] + [(1.1, 0.1, 1)] * 20


def _ledger(accountant: str) -> PrivacyLedger:
    ledger = PrivacyLedger(accountant, 1e-5)
    for z, q, _ in HISTORY:
        ledger.spend(z, q)
    return ledger


def test_rdp_epsilon_is_opacus_own_computation_for_the_same_history():
    ledger = _ledger("rdp")
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = sum(compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders) for z, q, steps in HISTORY)
    expected, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-5)
    assert ledger.epsilon() == pytest.approx(float(expected), rel=1e-12)
    assert ledger.history == [(1.1, 0.1, 2), (0.9, 0.1, 1), (1.1, 0.01, 1), (1.1, 0.1, 20)]
    assert ledger.rounds == len(HISTORY)


def test_prv_epsilon_is_opacus_own_computation_for_the_same_history():
    ledger = _ledger("prv")
    opacus = PRVAccountant()
    for z, q, _ in HISTORY:
        opacus.step(noise_multiplier=z, sample_rate=q)
    assert ledger.epsilon() == pytest.approx(opacus.get_epsilon(delta=1e-5), rel=1e-9)


def test_a_resumed_ledger_continues_the_epsilon():
    whole = _ledger("rdp")
    first = PrivacyLedger("rdp", 1e-5)
    for z, q, _ in HISTORY[:10]:
        first.spend(z, q)
    resumed = PrivacyLedger("rdp", 1e-5)
    resumed.load_state_dict(first.state_dict())
    assert resumed.epsilon() == pytest.approx(first.epsilon(), rel=1e-12)
    for z, q, _ in HISTORY[10:]:
        resumed.spend(z, q)
    assert resumed.epsilon() == pytest.approx(whole.epsilon(), rel=1e-12)


def test_epsilon_after_one_more_round_is_that_of_spending_it():
    ledger = _ledger("rdp")
    after = ledger.epsilon_after(1.1, 0.1)
    ledger.spend(1.1, 0.1)
    assert after == ledger.epsilon() > _ledger("rdp").epsilon()
    assert PrivacyLedger("rdp", 1e-5).epsilon() == 0.0


def test_the_calibrated_multiplier_spends_the_target_in_the_planned_rounds():
    z = calibrated_noise_multiplier(3.0, 1e-5, 0.1, 50, "rdp")
    ledger = PrivacyLedger("rdp", 1e-5, [(z, 0.1, 50)])
    assert 2.95 <= ledger.epsilon() <= 3.0
