"""A population over several agent processes (``--slice INDEX/COUNT``, as the Kubernetes testbed's
pods run) records the same rounds and trains the same model as the same run in one agent."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from fed_server.run_dir import RunDirectory
from integration_support import read_metrics, small_config
from testbed.processes import Service
from testbed.runner import Testbed
from testbed.warm_start import shared_starter


class SlicedTestbed(Testbed):
    """The testbed whose agents are each given every shard and ``--slice <i>/<agents>``, so the
    agents cut the shards themselves, as the StatefulSet's pods do, instead of being handed their
    block."""

    __test__ = False

    def start_agent(self, name: str, shards: list[int] | None = None, data: str | None = None, index: int = 0,
                    module: str = "device_agent", extra: Sequence[str] = ()) -> Service:
        ordinal = int(name.rpartition("-")[2])   # the testbed names its agents agent-<i>
        return super().start_agent(name, list(range(self.config.data.num_devices)), data, index, module,
                                   [*extra, "--slice", f"{ordinal}/{self.agents}"])


def _rounds(metrics: list[dict]) -> list[tuple]:
    """What a round record says that does not depend on timing or on the order uploads arrived in."""
    return [(m["round"], m["status"], m["selected"], sorted(m["aggregated"]), m["dropped"], m["device_kinds"],
             m["test_accuracy"], m["test_loss"], m["bytes_up"], m["bytes_down"]) for m in metrics]


def test_two_sliced_agents_record_the_rounds_and_train_the_model_of_one_agent(tmp_path):
    # FedAvg: every step is deterministic given the seed (each device's batch order comes from
    # the run's seed, its shard and the round, device_agent.trainer.round_seed; the Fed Server
    # aggregates in device order), whichever process hosts a device. Random selection of 3 of 4
    # devices (seed 2: a different three each round) and two kinds (round-robin by shard) show that
    # selection and kinds follow the shards.
    # 400 samples: what is compared does not depend on how much each device trains on.
    config = small_config(algorithm="fedavg", devices_per_round=3, seed=2, **{"devices.profiles": ["high", "low"],
                                                                              "data.max_samples": 400})
    runs = {}
    for agents, testbed_class in ((1, Testbed), (2, SlicedTestbed)):
        run_dir = tmp_path / f"agents-{agents}"
        with testbed_class(config, run_dir, agents=agents, warm=shared_starter()) as testbed:
            status = testbed.follow(timeout=240)
        assert status["state"] == "finished", status
        runs[agents] = read_metrics(run_dir), RunDirectory(run_dir).read_checkpoint()[1], run_dir
    (one, one_state, _), (two, two_state, two_dir) = runs[1], runs[2]

    logs = two_dir / "logs"
    assert "--slice 0/2: hosting shards 0,1\n" in (logs / "agent-0.log").read_text()
    assert "--slice 1/2: hosting shards 2,3\n" in (logs / "agent-1.log").read_text()
    assert [(m["round"], m["status"]) for m in two] == [(1, "ok"), (2, "ok")]
    assert len(two[0]["selected"]) == 3 and two[0]["selected"] != two[1]["selected"]
    assert _rounds(two) == _rounds(one)
    # The mean training loss sums the devices' losses in the order their uploads arrived.
    assert [m["train_loss"] for m in two] == pytest.approx([m["train_loss"] for m in one], rel=1e-6)
    assert one_state.keys() == two_state.keys()
    different = [k for k in one_state if not torch.equal(one_state[k], two_state[k])]
    assert different == [], f"weights differ: {different}"
