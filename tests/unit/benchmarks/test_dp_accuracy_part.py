"""Part (m)'s pure parts (benchmarks/dp_accuracy.py): its cases load as private runs of the stated
shape, the table sets each private case against its population's run without DP, and the command
line refuses what it cannot run."""
from __future__ import annotations

import argparse

import pytest

from benchmarks import dp_accuracy as part
from benchmarks.run import DEFAULT_PARTS, PARTS


def test_each_population_runs_without_dp_and_at_each_epsilon_then_s2fl_the_same():
    cases = part.cases((100, 1000), (1.0, 8.0), s2fl=True)
    assert [c.label for c in cases] == [
        "fedavg-100-none", "fedavg-100-eps1", "fedavg-100-eps8", "fedavg-1000-none", "fedavg-1000-eps1",
        "fedavg-1000-eps8", "s2fl-10-none", "s2fl-10-eps1", "s2fl-10-eps8"]
    for case in cases:
        config = part.bench_config(case, rounds=30)
        assert config.privacy.enabled == (case.epsilon is not None)
        if case.epsilon is not None:
            # Central noise, adaptive clipping, the multiplier left to the target epsilon.
            privacy = config.privacy
            assert (privacy.noise, privacy.clipping, privacy.target_epsilon) == ("central", "adaptive", case.epsilon)
            assert privacy.delta == 0.1 / case.population < 1 / config.data.num_devices
        if case.algorithm == "fedavg":
            assert config.model == "logreg" and config.rounds == 30 and config.data.num_devices == case.population
            assert config.per_round == case.population // 10
        else:
            assert config.rounds == 20 and config.data.num_devices == config.per_round == 10


def _row(algorithm: str, population: int, epsilon: float | None, accuracy: float) -> dict:
    return {"algorithm": algorithm, "population": population, "per_round": population // 10, "target_epsilon": epsilon,
            "delta": None if epsilon is None else 0.1 / population, "rounds": 30, "rounds_ok": 30,
            "final_accuracy": accuracy, "best_accuracy": accuracy, "epsilon": epsilon,
            "noise_multiplier": None if epsilon is None else 1.25}


def test_the_table_sets_each_private_case_against_its_populations_run_without_dp():
    rows = [_row("fedavg", 100, None, 0.85), _row("fedavg", 100, 3.0, 0.80), _row("fedavg", 1000, None, 0.84),
            _row("fedavg", 1000, 3.0, 0.831)]
    lines = part.table({"rows": rows})
    assert len(lines) == 6
    assert lines[3] == ("| fedavg | 100 (10) | client-level | 3 | 3.00 | 0.001 | 1.250 | 30/30 | - | 80.0 % | 80.0 % "
                        "| -5.0 points |")
    assert lines[5].endswith("| 83.1 % | 83.1 % | -0.9 points |") and lines[2].endswith("| - |")
    stopped = part.table({"rows": [rows[0], {**rows[1], "rounds_ok": 3, "stop_reason": "10 failed attempts in a row"}]})
    assert "| 3/30 | 10 failed attempts in a row | 80.0 % |" in stopped[3]


def test_dp_sgd_runs_at_s2fl_s_default_run_at_each_noise_multiplier_against_the_same_run_without_dp():
    cases = part.cases((), (3.0,), s2fl=True, sample_noise=(0.5, 2.0))
    assert [c.label for c in cases] == ["s2fl-10-none", "s2fl-10-eps3", "s2fl-10-dpsgd0.5", "s2fl-10-dpsgd2"]
    config = part.bench_config(cases[2], rounds=30)
    assert not config.privacy.enabled and config.algorithm == "s2fl" and config.rounds == 20
    assert config.train.dp_sgd is not None
    assert (config.train.dp_sgd.noise_multiplier, config.train.dp_sgd.max_grad_norm, config.train.dp_sgd.delta) == \
        (0.5, part.SAMPLE_CLIP, part.SAMPLE_DELTA)
    plain = {**_row("s2fl", 10, None, 0.90), "per_round": 10, "dp": "none"}
    sample = {**_row("s2fl", 10, None, 0.85), "per_round": 10, "dp": "sample", "epsilon": 7.5,
              "delta": part.SAMPLE_DELTA, "noise_multiplier": 0.5}
    lines = part.table({"rows": [plain, sample]})
    assert lines[3] == ("| s2fl | 10 (10) | DP-SGD (worst device) | - | 7.50 | 1e-05 | 0.500 | 30/30 | - | 85.0 % | "
                        "85.0 % | -5.0 points |")


def test_the_part_runs_only_when_named():
    assert "m" in PARTS and "m" not in DEFAULT_PARTS


@pytest.mark.parametrize("parse, text", [(part.parse_counts, "5"), (part.parse_counts, "100,x"),
                                         (part.parse_epsilons, "0"), (part.parse_epsilons, ""),
                                         (part.parse_noise, "0"), (part.parse_noise, "-1")])
def test_what_the_command_cannot_run_is_refused(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)
