"""A device whose shaped link drops tenfold mid-run is given a cheaper split and uploads again within
two rounds, instead of being cut at the same split for the rest of the run (docs/s2fl.md, "A fleet
that changes")."""
from __future__ import annotations

import math
import os
import signal
import subprocess

import pytest

from integration_support import read_metrics, small_config
from shared.models import build_model, profile_model
from testbed.links import problem_here
from testbed.runner import Testbed
from testbed.warm_start import shared_starter

_PROBLEM = problem_here()
pytestmark = pytest.mark.skipif(_PROBLEM is not None, reason=f"real links cannot be made here: {_PROBLEM}")

DROP_AFTER = 4    # the warm-up's round, then three decided by the median rule before the drop
ROUNDS = DROP_AFTER + 3   # the round the drop lands in and the two after it: all the test judges
HIGH = "dev-002"  # devices.profiles go round-robin: device 2 is the High one, on agent link 2


def _link_bytes(split: int, samples: int) -> float:
    """Eq. 1's bytes on a device's link in one round at ``split`` (``2|Wc| + 2pq``)."""
    cost = profile_model(build_model("cnn"), "cnn").cost(split)
    return 2.0 * cost.client_param_bytes + 2.0 * samples * cost.activation_bytes


def test_a_device_whose_link_drops_tenfold_uploads_again_within_two_rounds_at_a_cheaper_split(tmp_path):
    # The shaped-links claims' fleet (docs/real-links.md): Low, Mid and High on 1.5, 3 and 7.5 MB/s,
    # 100 samples each. High's link drops to 0.75 MB/s while round DROP_AFTER + 1 runs, at the split
    # the table chose before the drop: split 1 or 2 (the bottleneck cap counts split 3's 6.6 MB
    # portion, which would hold up the group's steps). The drop's round takes High about 1.6 times
    # its peers' time, within its own deadline (twice the slowest of them plus a second,
    # deadlines.patience's default), and the measured change moves its link level; had it been
    # cut, its censored entry would move it (tests/unit/fed_server/test_coordinator.py). The
    # default patience, not the scenario benchmark's 1.2: at split 2 after the drop High takes
    # about 1.4 times its peers' time (about 4.3 s against about 3 s), within about 0.3 s of a 1.2
    # deadline and 1.3 s of a 1.5 one, margins a loaded CI round has taken.
    # Without dominated splits left out (split.undominated false): with them, High holds split 2
    # before the drop already (its split 1 reads slower), the split of fewest bytes, and the drop
    # would leave nothing cheaper to move to; here its split 1 is what the drop finds, so the move
    # the test checks happens. The default rule on this fleet: the scenario benchmark's link_drop.
    config = small_config(rounds=ROUNDS, **{"data.num_devices": 3, "data.partition": "iid", "data.max_samples": 300,
                                            "grouping.group_size": 3, "devices.profiles": ["low", "mid", "high"],
                                            "devices.time_scale": 1.5, "deadlines.patience": 2.0,
                                            "split.undominated": False})
    dropped: list[int] = []
    evidence: list[str] = []
    with Testbed(config, tmp_path, real_links=True, rtt_ms=2.0, warm=shared_starter()) as testbed:
        assert testbed.network is not None

        def drop(record, status) -> None:
            network = testbed.network
            assert network is not None and network.plan is not None
            if record.round == DROP_AFTER and not dropped:
                network.set_rate(2, network.plan.agents[2].rate / 10)
                dropped.append(record.round)
            elif dropped and HIGH in record.split_points and HIGH not in record.aggregated and not evidence:
                # High was cut after the drop: where its connections and its agent's threads stand
                # now, for the failure message (its stacks go to its log, shared/service.py).
                sockets = subprocess.run(["ip", "netns", "exec", network.plan.agents[2].namespace, "ss", "-tin"],
                                         capture_output=True, text=True, timeout=30).stdout
                evidence.append(f"round {record.round}: High cut; its sockets:\n{sockets}")
                os.kill(testbed.agent_services[2].process.pid, signal.SIGUSR2)

        assert testbed.follow(on_round=drop, timeout=400)["state"] == "finished"
    metrics = read_metrics(tmp_path)
    # High's rounds, printed whole (a string: pytest shortens a list): (round, split, seconds or why it left).
    summary = "; ".join(str(r) for r in [(m["round"], m["split_points"].get(HIGH),
                round(m["table_times"].get(HIGH, math.nan), 2) if HIGH in m["aggregated"] else m["left"].get(HIGH, "not selected"))
               for m in metrics])
    if evidence:
        stacks = (tmp_path / "logs" / "agent-2.log").read_text(errors="replace").partition("Thread 0x")
        summary += "\n" + "\n".join(evidence) + "\nHigh's agent's threads:\n" + "".join(stacks[1:])
    assert dropped == [DROP_AFTER] and [m["status"] for m in metrics] == ["ok"] * ROUNDS, summary
    at_drop = metrics[DROP_AFTER]["split_points"].get(HIGH)
    assert at_drop is not None, summary
    # Within the round the drop landed in and the two after it, High uploads at a split that puts
    # fewer bytes on its link than the split it had when the link dropped (or, had it the fewest
    # already, at that one).
    splits = build_model("cnn").split_points
    fewest = min(_link_bytes(k, 100) for k in splits)
    uploads = [m["split_points"][HIGH] for m in metrics[DROP_AFTER:DROP_AFTER + 3] if HIGH in m["aggregated"]]
    assert any(_link_bytes(k, 100) < _link_bytes(at_drop, 100) or _link_bytes(k, 100) == fewest for k in uploads), \
        summary
