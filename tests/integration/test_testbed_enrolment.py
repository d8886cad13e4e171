"""The testbed's per-device enrolment credentials (``python -m testbed --enrolment credentials``):
a run whose agents each enrol with their own credential, under the Fed Server's enrolment key
and no shared enrolment secret, completes."""
from __future__ import annotations

from integration_support import read_metrics, small_config
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def test_a_run_whose_agents_enrol_with_their_own_credentials_completes(tmp_path):
    config = small_config(algorithm="fedavg", rounds=1, **{"data.num_devices": 2, "data.max_samples": 600,
                                                           "deadlines.round_s": 60})
    run_dir = tmp_path / "run"
    with Testbed(config, run_dir, agents=2, enrolment="credentials", warm=shared_starter()) as testbed:
        assert "enrolment-secret" not in testbed.secrets
        status = testbed.follow(timeout=120)
    assert status["state"] == "finished"
    assert [(r["round"], r["status"], r["aggregated"]) for r in read_metrics(run_dir)] == [
        (1, "ok", ["dev-000", "dev-001"])]
