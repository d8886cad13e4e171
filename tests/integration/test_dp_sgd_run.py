"""Sample-level DP-SGD end to end through the real services (``train.dp_sgd``; docs/privacy.md): the
devices train with Opacus's per-sample clipping and noise (in S2FL's split rounds through the Main
Server's dfx), the model still learns, and every round record, the round line, summary.json and
the Prometheus gauge carry the worst device's epsilon as Opacus's accountant computes it for the
tasks the run handed out."""
from __future__ import annotations

import json
import math

import httpx
import pytest
from opacus.accountants import RDPAccountant

from integration_support import read_metrics, small_config
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

NOISE, CLIP, DELTA = 1.0, 1.0, 1e-4
SAMPLES, BATCH = 300, 64   # 1,200 images over 4 devices, iid
#: What each run must gain over the initial model in 3 rounds. FedAvg's device trains the whole
#: CNN, whose noise per step (NOISE x CLIP / BATCH on each of its 1.7 million weights, about 20 in
#: norm) swamps the clipped gradients far more than on S2FL's front blocks (a few thousand to
#: 52,000 weights): measured here 0.106 -> 0.214 and 0.194 (FedAvg), 0.106 -> 0.625 (S2FL).
GAIN = {"s2fl": 0.2, "fedavg": 0.04}


def _opacus_epsilon(tasks: int) -> float:
    accountant = RDPAccountant()
    for _ in range(tasks * math.ceil(SAMPLES / BATCH)):
        accountant.step(noise_multiplier=NOISE, sample_rate=BATCH / SAMPLES)
    return accountant.get_epsilon(delta=DELTA)


@pytest.mark.parametrize("algorithm", ["s2fl", "fedavg"])
def test_a_dp_sgd_run_learns_and_reports_each_round_s_worst_device_epsilon(tmp_path, algorithm):
    config = small_config(algorithm=algorithm, rounds=3, **{
        "data.partition": "iid", "train.batch_size": BATCH, "devices.profiles": [],
        "train.dp_sgd": {"noise_multiplier": NOISE, "max_grad_norm": CLIP, "delta": DELTA}})
    with Testbed(config, tmp_path, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
        gauge = [line for line in httpx.get(f"{testbed.fed_url}/metrics").text.splitlines()
                 if line.startswith("sfl_fed_sample_epsilon ")]
    assert status["state"] == "finished"
    records = read_metrics(tmp_path)
    tasks: dict[str, int] = {}
    for record in records:   # every attempt's tasks count, aggregated or not
        for device in record["selected"]:
            tasks[device] = tasks.get(device, 0) + 1
        spent = record["sample_privacy"]
        assert spent["epsilon"] == pytest.approx(_opacus_epsilon(max(tasks.values())), rel=1e-9)
        assert spent["delta"] == DELTA and spent["noise_multiplier"] == NOISE and spent["max_grad_norm"] == CLIP
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sample_epsilon"] == records[-1]["sample_privacy"]["epsilon"] > 0
    assert summary["sample_delta"] == DELTA
    assert summary["final_accuracy"] > summary["initial_accuracy"] + GAIN[algorithm]
    assert gauge and float(gauge[0].split()[1]) == pytest.approx(summary["sample_epsilon"])
    log = (tmp_path / "logs" / "fed_server.log").read_text()
    assert f"sample-level epsilon {summary['sample_epsilon']:.4g} at delta {DELTA:g} (worst device)" in log
