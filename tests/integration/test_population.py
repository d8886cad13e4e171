"""A population far larger than a round starts and trains: 1,000 devices on one agent process
(the population benchmark's FedAvg run, ``benchmarks/population.py``, part (h) of
benchmarks/README.md), with the Fed Server, through the testbed.
"""
from __future__ import annotations

from benchmarks.population import default_memory_limit_mib, fedavg_config, run_population

DEVICES = 1000
TIME_LIMIT_S = 300.0


def test_a_thousand_devices_register_on_one_agent_and_train_two_rounds():
    config = fedavg_config(DEVICES, TIME_LIMIT_S, rounds=2)
    assert config.devices_per_round == 100
    population = run_population(config, agents=1, time_limit_s=TIME_LIMIT_S,
                                memory_limit_mib=default_memory_limit_mib(), log=print)
    assert population.error is None, population.error
    assert population.registered == DEVICES and population.register_s is not None
    assert population.rounds_done == 2
