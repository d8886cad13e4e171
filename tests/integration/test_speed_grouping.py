"""The second split example of docs/extending.md through the real services: S2FL with groups by cut
and speed, formed by the Main Server from the times the Fed Server's round plan carries."""
from __future__ import annotations

import numpy as np

from integration_support import small_config
from shared.algorithms.grouping import GroupCandidate
from shared.algorithms.speed_grouping import SpeedGrouping


def test_s2fl_groups_by_cut_and_by_the_fed_servers_time_table(run_testbed):
    # Two kinds (Mid, Low) of IID shards, so the devices' times differ by kind; the paper's warm-up's
    # three rounds, one cut each, all devices at the same cut.
    config = small_config(rounds=3, **{"grouping.method": "speed", "devices.profiles": ["mid", "low"],
                                       "data.partition": "iid", "deadlines.patience": None, "split.warm_up": "every_split"})
    status, metrics, _ = run_testbed(config)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok"] * 3
    # The time table before each round, rebuilt from the times the rounds before recorded (each
    # warm-up round measures one cut, so every cell is one measurement, stored as is).
    table: dict[str, dict[int, float]] = {}
    orders = []
    for m in metrics:
        splits = m["split_points"]
        members = {d: GroupCandidate(np.zeros(10, dtype=np.int64), splits[d], 1, None, dict(table.get(d, {})), None)
                   for d in m["selected"]}
        expected = SpeedGrouping().form(members, config.grouping.group_size, np.random.default_rng(0))
        assert [g["members"] for g in m["groups"]] == [sorted(g) for g in expected], (m["round"], table, m["groups"])
        orders.append(expected)
        for d, seconds in m["table_times"].items():
            table.setdefault(d, {})[splits[d]] = seconds
    # Not the id order once times are known: from round 2 on the Mid devices (even shards) are
    # grouped together, apart from the Low ones.
    kinds = metrics[1]["device_kinds"]
    for groups in orders[1:]:
        assert all(len({kinds[d] for d in g}) == 1 for g in groups), (groups, kinds)
