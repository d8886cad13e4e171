"""Each device's sample-level epsilon under DP-SGD (fed_server/sample_privacy.py)."""
from __future__ import annotations

import pytest
from opacus.accountants import RDPAccountant

from fed_server.sample_privacy import SampleLedger
from shared.config import DpSgdConfig, TrainConfig

TERMS = DpSgdConfig(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5)
TRAIN = TrainConfig(batch_size=32, local_epochs=2)


def _opacus(samples: int, tasks: int) -> float:
    """What Opacus's own accountant says after the same DP-SGD steps, one at a time."""
    accountant = RDPAccountant()
    for _ in range(tasks * 2 * -(-samples // 32)):   # epochs x batches per task
        accountant.step(noise_multiplier=1.1, sample_rate=32 / samples)
    return accountant.get_epsilon(delta=1e-5)


def test_each_device_s_epsilon_is_opacus_s_over_its_steps():
    ledger = SampleLedger(TERMS, TRAIN)
    assert ledger.worst() is None and ledger.epsilon("a") == 0.0
    ledger.count({"a": 200, "b": 600})
    ledger.count({"a": 200})
    ledger.count({"a": 200})
    assert ledger.steps(200) == 2 * 7
    assert ledger.epsilon("a") == pytest.approx(_opacus(200, 3), rel=1e-9)
    assert ledger.epsilon("b") == pytest.approx(_opacus(600, 1), rel=1e-9)
    # The worst device: more tasks at a higher sampling rate.
    device, epsilon = ledger.worst()
    assert device == "a" and epsilon == ledger.epsilon("a") > ledger.epsilon("b")
    record = ledger.record()
    assert record["epsilon"] == epsilon and record["device"] == "a" and record["delta"] == 1e-5


def test_a_resumed_ledger_continues_each_device_s_epsilon():
    ledger = SampleLedger(TERMS, TRAIN)
    ledger.count({"a": 100, "b": 100})
    ledger.count({"b": 100})
    resumed = SampleLedger(TERMS, TRAIN)
    resumed.load_state_dict(ledger.state_dict())
    assert resumed.worst() == ledger.worst()
    resumed.count({"a": 100})
    ledger.count({"a": 100})
    assert resumed.epsilon("a") == ledger.epsilon("a") == pytest.approx(_opacus(100, 2), rel=1e-9)


def test_a_device_smaller_than_a_batch_is_sampled_whole():
    ledger = SampleLedger(TERMS, TRAIN)
    ledger.count({"tiny": 10})
    assert ledger.steps(10) == 2
    accountant = RDPAccountant()
    for _ in range(2):
        accountant.step(noise_multiplier=1.1, sample_rate=1.0)
    assert ledger.epsilon("tiny") == pytest.approx(accountant.get_epsilon(delta=1e-5), rel=1e-9)


def test_the_tasks_of_an_attempt_in_flight_when_the_fed_server_stopped_count_on_resume(tmp_path):
    from fed_server.run_dir import RunDirectory

    ledger = SampleLedger(TERMS, TRAIN, RunDirectory(tmp_path))
    ledger.count({"a": 100, "b": 50})
    checkpoint = ledger.state_dict()          # the checkpoint of that attempt
    ledger.count({"a": 100})                  # the next attempt's tasks go out; then the Fed Server stops
    resumed = SampleLedger(TERMS, TRAIN, RunDirectory(tmp_path))
    resumed.load_state_dict(checkpoint)
    assert resumed.state_dict() == ledger.state_dict() and resumed.worst() == ledger.worst()
    plain = SampleLedger(TERMS, TRAIN, RunDirectory(tmp_path / "other"))   # nothing noted: the checkpoint's
    plain.load_state_dict(checkpoint)
    assert plain.state_dict() == checkpoint
