"""S2FL / SFL name their grouping plug-in: label_balance (the ablation switch) or grouping.method."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from shared.algorithms.registry import GROUP_LOSSES, GROUPINGS, build_algorithm
from shared.config import RunConfig
from shared.run_config import load_run_config


def _grouping(algorithm: str, **grouping) -> str:
    return build_algorithm(RunConfig(algorithm=algorithm, grouping=grouping)).grouping()


@pytest.mark.parametrize("algorithm, default", [("s2fl", "balanced"), ("sfl", "singleton"), ("fedavg", "singleton")])
def test_defaults_are_registered_names(algorithm, default):
    assert _grouping(algorithm) == default
    assert default in GROUPINGS


@pytest.mark.parametrize("algorithm", ["s2fl", "sfl"])
def test_label_balance_switch(algorithm):
    assert _grouping(algorithm, label_balance=True) == "balanced"
    assert _grouping(algorithm, label_balance=False) == "singleton"


@pytest.mark.parametrize("algorithm", ["s2fl", "sfl"])
@pytest.mark.parametrize("method", sorted(GROUPINGS))
def test_method_names_any_registered_grouping(algorithm, method):
    assert _grouping(algorithm, method=method) == method


def test_unknown_names_and_both_switches_are_rejected():
    with pytest.raises(ValueError, match="unknown grouping 'psychic'"):
        load_run_config({"grouping": {"method": "psychic"}})
    with pytest.raises(ValueError, match="unknown group_loss 'sum'"):
        load_run_config({"grouping": {"group_loss": "sum"}})
    with pytest.raises(ValidationError, match="not both"):
        RunConfig(grouping={"method": "random", "label_balance": True})


@pytest.mark.parametrize("name", sorted(GROUP_LOSSES))
def test_documented_group_losses_still_accepted(name):
    assert load_run_config({"grouping": {"group_loss": name}}).grouping.group_loss == name
