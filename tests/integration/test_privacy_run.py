"""Client-level differential privacy end to end through the real services (docs/privacy.md).

- A FedAvg round clipped to a small bound moves the global model by at most that bound: the mean
  of clipped updates stays in the ball, whatever the devices trained.
- An S2FL run with central noise and adaptive clipping, whose Fed Server is stopped after two
  rounds and started again: every round reports Opacus's epsilon for the run's history (the
  resumed rounds continue it, a round whose model left before the stop counted twice), the adaptive bound follows its rule across the restart, and
  ``privacy.target_epsilon`` stops the run before a round would pass it, with the reason in
  summary.json.
- With half the configured devices registered, a private round selects half as many devices as
  configured, so it samples at the run's rate, and the record's epsilon is Opacus's for that rate.
"""
from __future__ import annotations

import json
import math
import re

import torch
from opacus.accountants import RDPAccountant

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config, wait_for
from shared.models import build_model
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


def test_a_clipped_fedavg_round_moves_the_model_by_at_most_the_bound(tmp_path):
    bound = 0.02   # a round at lr 0.05 moves the model by far more (the check below fails without clipping)
    config = small_config(algorithm="fedavg", rounds=1,
                          **{"privacy.clipping": "fixed", "privacy.clip_norm": bound, "aggregation.rule": "mean",
                             "devices.profiles": []})
    with Testbed(config, tmp_path, warm=shared_starter()) as testbed:
        status = testbed.follow(timeout=240)
    (record,) = read_metrics(tmp_path)
    assert status["state"] == "finished" and record["status"] == "ok"
    assert record["privacy"]["clip_norm"] == bound and record["privacy"]["epsilon"] is None
    _, state, _ = RunDirectory(tmp_path).read_checkpoint()
    initial = build_model("cnn", 10, (1, 28, 28), seed=config.seed).state_dict()
    moved = math.sqrt(sum(float((state[k].double() - initial[k].double()).pow(2).sum())
                          for k in initial if initial[k].is_floating_point()))
    assert 0.5 * bound < moved <= bound * (1 + 1e-5), moved


def _checkpointed_rounds(run_dir) -> int:
    path = RunDirectory(run_dir).checkpoint_path
    return RunDirectory(run_dir).read_checkpoint()[0] if path.exists() else 0


def _opacus_epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    accountant = RDPAccountant()
    for _ in range(rounds):
        accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
    return accountant.get_epsilon(delta=delta)


def test_a_noised_split_run_reports_opacus_epsilon_across_a_restart_and_stops_at_its_budget(tmp_path):
    z, q, delta = 1.5, 0.5, 1e-3
    # Opacus's epsilon after 1..5 rounds at z 1.5, q 0.5: about 1.48, 2.06, 2.50, 2.89, 3.24.
    target = (_opacus_epsilon(z, q, 4, delta) + _opacus_epsilon(z, q, 5, delta)) / 2   # room for 4 rounds
    # A small bound: the noise on each entry of the mean is z C / 2 with two devices a round, which a
    # bound of 1 would make larger than the CNN's weights (its activations then pass the Main
    # Server's bound, and every attempt fails).
    privacy = {"clipping": "adaptive", "clip_norm": 1e-3, "target_quantile": 0.5, "clip_learning_rate": 0.2,
               "noise": "central", "noise_multiplier": z, "target_epsilon": target, "delta": delta}
    config = small_config(rounds=20, devices_per_round=2, privacy=privacy,
                          **{"aggregation.rule": "mean", "devices.profiles": []})
    run_dir = tmp_path / "run"
    testbed = Testbed(config, run_dir, warm=shared_starter())
    try:
        testbed.start()
        wait_for(lambda: _checkpointed_rounds(run_dir) >= 2, 300, "round 2")
    finally:
        testbed.stop(interrupted=True)
    with Testbed(config, run_dir, warm=shared_starter()) as testbed:   # the Fed Server resumes
        status = testbed.follow(timeout=300)
    log = (run_dir / "logs" / "fed_server.log").read_text()
    assert "resumed run" in log

    # A round whose model left the Fed Server before the checkpoint counting it (the stop can land
    # there) is run again after the resume and counted twice: the log says how many.
    resumed_after = int(re.search(r"resumed run \S+ after round (\d+)", log).group(1))
    twice = sum(int(n) for n in re.findall(r"privacy: (\d+) round\(s\) released after the last checkpoint", log))
    records = [r for r in read_metrics(run_dir) if r["status"] == "ok"]
    assert status["state"] == "finished" and [r["round"] for r in records] == list(range(1, 5 - twice))
    for done, record in enumerate(records, start=1):
        spent = record["privacy"]
        spends = done + (twice if done > resumed_after else 0)
        assert spent["noise_multiplier"] == z and spent["delta"] == delta
        assert math.isclose(spent["epsilon"], _opacus_epsilon(z, q, spends, delta), rel_tol=1e-9), (done, spent)
    last = records[-1]   # the round line (the first process may have stopped before logging its last round's)
    assert any(f"round {last['round']} (attempt {last['round_id']}) ok: " in line
               and line.endswith(f"epsilon {last['privacy']['epsilon']:.4g} at delta {delta:g}") for line in log.splitlines())
    for before, after in zip(records, records[1:]):   # Andrew et al.'s geometric step, across the restart too
        step = math.exp(-0.2 * (before["privacy"]["unclipped_fraction"] - 0.5))
        assert math.isclose(after["privacy"]["clip_norm"], before["privacy"]["clip_norm"] * step, rel_tol=1e-9)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["epsilon"] == records[-1]["privacy"]["epsilon"] <= target
    assert summary["stop_reason"].startswith("privacy budget: another round would raise epsilon")
    assert all(torch.isfinite(torch.tensor(r["test_accuracy"])) for r in records)


class _HalfPopulation(Testbed):
    """A testbed whose agent hosts the devices of the first half of the shards only."""

    def agent_chunks(self, shards):
        return [shards[: len(shards) // 2]]


def test_with_half_the_devices_registered_a_private_round_selects_half_as_many_and_spends_that_rate(tmp_path):
    # 4 a round of 8 configured: rate 0.5. Only 4 register (the registration deadline passes with
    # the quorum of 2): selecting all 4 would sample at 1 and Opacus's epsilon at 0.5 would be too low.
    privacy = {"clipping": "fixed", "clip_norm": 0.01, "noise": "central", "noise_multiplier": 1.0, "delta": 1e-3}
    config = small_config(algorithm="fedavg", rounds=2, devices_per_round=4, privacy=privacy, **{
        "data.num_devices": 8, "deadlines.min_participants": 2, "deadlines.registration_s": 3,
        "aggregation.rule": "mean", "devices.profiles": []})
    with _HalfPopulation(config, tmp_path, warm=shared_starter()) as testbed:
        assert testbed.follow(timeout=300)["state"] == "finished"
    rounds = read_metrics(tmp_path)
    assert [r["status"] for r in rounds] == ["ok", "ok"] and all(len(r["selected"]) == 2 for r in rounds), rounds
    assert [r["privacy"]["sample_rate"] for r in rounds] == [0.5, 0.5]
    opacus = RDPAccountant()
    opacus.step(noise_multiplier=1.0, sample_rate=0.5)
    opacus.step(noise_multiplier=1.0, sample_rate=0.5)
    assert rounds[-1]["privacy"]["epsilon"] == opacus.get_epsilon(1e-3)
