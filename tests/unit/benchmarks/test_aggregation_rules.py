"""The aggregation-rule benchmark times every rule on the same seeded round and writes one row per
rule; an unknown rule is refused before anything runs."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.aggregation_rules import main, round_inputs


def test_the_round_is_seeded_and_its_uploads_differ_from_the_global_state() -> None:
    global_state, uploads = round_inputs("logreg", 3)
    again, uploads_again = round_inputs("logreg", 3)
    assert [c.weight for c in uploads.values()] == [150.0, 160.0, 170.0]
    for device, contribution in uploads.items():
        for key, value in contribution.client_state.items():
            assert torch.equal(value, uploads_again[device].client_state[key])
            assert not torch.equal(value, global_state[key]) or not value.is_floating_point()


def test_every_rule_gets_a_row_with_its_timings(tmp_path, capsys) -> None:
    out = tmp_path / "rules.json"
    assert main(["--model", "logreg", "--devices", "4", "--repeats", "2", "--rules", "median,mean", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rules"]
    assert [r["rule"] for r in rows] == ["median", "mean"]
    assert all(len(r["seconds"]) == 2 and 0 < r["min_s"] <= r["mean_s"] for r in rows)
    assert "median: fastest" in capsys.readouterr().out


def test_an_unknown_rule_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--rules", "median,avarage"])
    assert "--rules: unknown avarage" in capsys.readouterr().err
