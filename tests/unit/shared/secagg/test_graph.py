"""SecAgg+'s sparse graph: every device has exactly its k neighbours and itself, the relation is
symmetric (so pairwise masks cancel), the ring's order is random, and null or a k as large as the
roster gives the complete graph."""
import random

import pytest

from shared.secagg.graph import neighbourhoods

ROSTER = [f"d{i:02d}" for i in range(12)]


@pytest.mark.parametrize("k", [2, 4, 6])
def test_each_device_has_k_neighbours_symmetrically(k):
    graph = neighbourhoods(ROSTER, k, random.Random(1))
    assert sorted(graph) == ROSTER
    for device, hood in graph.items():
        assert hood == sorted(hood) and device in hood and len(set(hood)) == k + 1
        assert all(device in graph[other] for other in hood)


def test_the_ring_order_is_drawn_afresh():
    drawn = {tuple(tuple(h) for h in neighbourhoods(ROSTER, 2, random.Random(seed)).values()) for seed in range(5)}
    assert len(drawn) == 5


@pytest.mark.parametrize("k", [None, 12, 20])
def test_null_or_a_k_of_the_roster_less_one_is_the_complete_graph(k):
    assert neighbourhoods(ROSTER, k, random.Random(1)) == {d: ROSTER for d in ROSTER}


@pytest.mark.parametrize("k", [3, -2])
def test_an_odd_or_negative_count_is_refused(k):
    with pytest.raises(ValueError, match="even"):
        neighbourhoods(ROSTER, k, random.Random(1))
