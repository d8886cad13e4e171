"""The registry's tables: every line names a class of the table's kind, found on first lookup."""
from __future__ import annotations

import pytest

from shared.algorithms import registry
from shared.algorithms.base import Algorithm
from shared.algorithms.group_loss import GroupLoss
from shared.algorithms.grouping import Grouping
from shared.algorithms.plugin_table import PluginTable
from shared.algorithms.robust_aggregation import AggregationRule
from shared.algorithms.selection import DeviceSelector

TABLES = {"ALGORITHMS": Algorithm, "SELECTORS": DeviceSelector, "AGGREGATION_RULES": AggregationRule,
          "GROUPINGS": Grouping, "GROUP_LOSSES": GroupLoss}


@pytest.mark.parametrize("table", sorted(TABLES))
def test_every_line_names_a_class_of_its_tables_kind(table):
    plug_ins = getattr(registry, table)
    assert len(plug_ins) > 1
    for name in plug_ins:
        assert issubclass(plug_ins[name], TABLES[table]), name


def test_a_line_naming_a_class_of_another_kind_is_refused_when_looked_up():
    table: PluginTable[Grouping] = PluginTable("grouping", "shared.algorithms.grouping:Grouping",
                                               {"balanced": "shared.algorithms.grouping:BalancedGrouping",
                                                "fedavg": "shared.algorithms.fedavg:FedAvg"})
    assert table["balanced"].__name__ == "BalancedGrouping"
    with pytest.raises(TypeError, match="grouping 'fedavg': shared.algorithms.fedavg:FedAvg is not a subclass of "
                                        "shared.algorithms.grouping:Grouping"):
        table["fedavg"]


def test_an_unknown_name_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"unknown grouping 'fastest'; choose one of \['balanced', 'random', "
                                         r"'singleton', 'speed', 'split_point'\]"):
        registry.build_grouping("fastest")
    assert "fastest" not in registry.GROUPINGS and registry.GROUPINGS.get("fastest") is None
