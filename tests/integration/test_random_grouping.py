"""A split-learning variant added as one plug-in: S2FL with random groups through the real services."""
from __future__ import annotations

from fed_server.run_dir import RunDirectory
from integration_support import small_config
from shared.algorithms.grouping import candidates_from_counts, grouping_rng
from shared.algorithms.random_grouping import RandomGrouping
from shared.models import build_model


def test_s2fl_with_random_groups_completes_rounds(run_testbed):
    config = small_config(rounds=3, **{"grouping.method": "random"})
    status, metrics, run_dir = run_testbed(config)
    assert status["state"] == "finished"
    assert [m["round"] for m in metrics] == [1, 2, 3]
    assert all(m["status"] == "ok" for m in metrics)
    for m in metrics:
        # The Main Server drew each round's groups from the round's generator (run seed, round):
        # the same draw here gives the same groups, in group-id order (members as uploaded: sorted).
        joined = candidates_from_counts({d: [0] * 10 for d in m["selected"]})  # all joined; the draw reads only the ids
        expected = RandomGrouping().form(joined, config.grouping.group_size, grouping_rng(config.seed, m["round"]))
        assert [g["members"] for g in m["groups"]] == [sorted(g) for g in expected], m["groups"]
        assert all(len(g["members"]) == 2 for g in m["groups"])
        assert m["bytes_server"] > 0
    _, state, _ = RunDirectory(run_dir).read_checkpoint()
    initial = build_model(config.model, 10, (1, 28, 28), seed=config.seed).state_dict()
    assert any(not (state[k] == initial[k]).all() for k in initial)
