"""FedIPG end to end through the real services: rotated domains, one excluded device (exit strategy)."""
from __future__ import annotations

import time

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.models import build_model


def test_fedipg_with_static_exit_and_ood_evaluation(run_testbed, monkeypatch):
    # Devices that keep their model fetch the final one (an agent hosting several devices would
    # otherwise skip it to save memory, --keep-models): the exited device must get it too.
    monkeypatch.setenv("SFL_KEEP_MODELS", "yes")
    # 600 samples: a device's steps cost several times a plain one's (the invariance penalty), and
    # what is checked holds after any amount of training.
    config = small_config(algorithm="fedipg", **{
        "data.partition": "iid", "data.max_samples": 600,
        "data.device_transform": "rotation",
        "data.device_transform_params": {"angles": [0, 30, 60, 180]},
        "algorithm_params": {"lam": 1e-3, "exit_policy": "static", "excluded": ["dev-003"], "ood_angle": 90},
    })
    final_seen: list[bool] = []

    def wait_for_final_model(testbed):
        # Every device, the exited one included, receives the final global model with its "done"
        # task. The fixture stops the agents as soon as the run is finished, so wait here (inside
        # the testbed) until the excluded device has logged it.
        testbed.follow(timeout=200)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not final_seen:
            logs = "\n".join(p.read_text(errors="replace") for p in (testbed.run_dir / "logs").glob("*agent*.log"))
            if "dev-003: run finished; this device trained 0 task(s); final global model received" in logs:
                final_seen.append(True)
            time.sleep(0.2)

    status, metrics, run_dir = run_testbed(config, during=wait_for_final_model)
    assert final_seen, "the excluded device never received the final global model"
    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2] and all(m["status"] == "ok" for m in metrics)

    _, state, meta = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(config.model, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert any(not (state[k] == initial[k]).all() for k in initial)
    assert status["summary"]["final_accuracy"] > status["summary"]["initial_accuracy"]

    for m in metrics:
        # Exit strategy: the excluded device is never selected nor aggregated.
        assert m["selected"] == ["dev-000", "dev-001", "dev-002"] == m["aggregated"]
        am = m["algorithm_metrics"]
        assert am["exited"] == ["dev-003"]
        assert abs(sum(am["aggregation_weights"].values()) - 1.0) < 1e-9 and "dev-003" not in am["aggregation_weights"]
        # Invariance penalty diagnostics arrived from the devices.
        assert am["risk"] > 0 and am["penalty_s2"] >= 0 and am["penalty_abs_s"] >= 0
        # In- and out-of-distribution accuracy of the global model every round.
        assert set(am["domain_accuracy"]) == {"rot0", "rot30", "rot60", "rot180", "ood:rot90"}
        assert 0.0 <= am["id_accuracy"] <= 1.0 and 0.0 <= am["ood_accuracy"] <= 1.0
    assert meta["algorithm_state"]["exited"] == {"dev-003": {"round": 0, "reason": "static"}}
