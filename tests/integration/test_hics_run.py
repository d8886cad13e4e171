"""HiCS-FL client sampling under FedAvg through the real services (separate processes, real HTTP)."""
from __future__ import annotations

import math

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.models import build_model


def test_fedavg_with_hics_selection_warms_up_then_clusters(run_testbed):
    # 6 devices, 2 per round: rounds 1-3 are the warm-up and must visit 6 distinct devices;
    # round 4 is the first HiCS round (clusters over the estimates gathered in the warm-up).
    config = small_config(algorithm="fedavg", rounds=4, selection="hics", devices_per_round=2,
                          selection_params={"temperature": 0.05},
                          **{"data.num_devices": 6, "data.alpha": 0.3})
    status, metrics, run_dir = run_testbed(config)

    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["status"] == "ok" for m in metrics)
    assert all(len(m["aggregated"]) == 2 for m in metrics)
    warmup = [d for m in metrics[:3] for d in m["selected"]]
    assert len(warmup) == 6 and len(set(warmup)) == 6

    hics = [m["algorithm_metrics"] for m in metrics]
    assert [h["hics_warmup"] for h in hics] == [1, 1, 1, 0]
    assert [h["hics_forced"] for h in hics] == [2, 2, 2, 0]
    for m, h in zip(metrics, hics):  # every aggregated device got a fresh estimate in [0, ln 10]
        assert sorted(h["hics_round_entropies"]) == m["aggregated"]
        assert all(0.0 <= v <= math.log(10) + 1e-9 for v in h["hics_round_entropies"].values())
    assert hics[3]["hics_clusters"] == 2 and hics[3]["hics_observed"] == 6
    assert hics[3]["hics_gamma"] == 4.0 * (1 - 4 / 4)
    assert hics[3]["hics_selected_entropy_mean"] is not None

    _, state, extra = RunDirectory(run_dir).read_checkpoint()
    selector_state = extra["selector_state"]
    assert sorted(selector_state["estimates"]) == sorted(warmup)
    initial = build_model(config.model, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert any(not (state[k] == initial[k]).all() for k in initial)
    assert all(0.0 <= m["test_accuracy"] <= 1.0 for m in metrics)
