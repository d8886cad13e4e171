"""The worked example of docs/extending.md through the real services: S2FL with groups by split point."""
from __future__ import annotations

from integration_support import small_config


def test_s2fl_with_groups_by_split_point_keeps_every_group_on_one_cut(run_testbed):
    config = small_config(rounds=4, **{"grouping.method": "split_point"})
    status, metrics, _ = run_testbed(config)
    assert status["state"] == "finished" and [m["status"] for m in metrics] == ["ok"] * 4
    for m in metrics:
        for group in m["groups"]:
            assert len({m["split_points"][d] for d in group["members"]}) == 1, (m["split_points"], m["groups"])
