"""The Fed Server's published weights: packed once, named by content, served while held."""
from __future__ import annotations

import pytest
import torch

from fed_server.weights_store import WeightsStore
from shared.errors import NotFound
from shared.schemas import WeightsResponse
from shared.wire import decode_state, unpackb


def _served(store: WeightsStore, weights_id: str) -> dict[str, torch.Tensor]:
    return decode_state(WeightsResponse.model_validate(unpackb(b"".join(store.body(weights_id)))).weights)


def test_the_same_weights_published_twice_are_one_body_served_until_the_last_hold_ends():
    store = WeightsStore()
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    first = store.publish(state)
    again = store.publish({k: v.clone() for k, v in state.items()})
    assert first == again and len(store) == 1 and len(first) == 32
    assert store.size(first) == len(b"".join(store.body(first)))
    store.release(first)
    assert all(torch.equal(_served(store, first)[k], v) for k, v in state.items())   # still held once
    store.release(first)
    with pytest.raises(NotFound, match="not served"):
        store.body(first)
    assert len(store) == 0


def test_a_published_body_is_a_snapshot_and_other_weights_get_another_id():
    store = WeightsStore()
    w = torch.zeros(4)
    first = store.publish({"w": w})
    w += 1   # the global model changes after publishing (the next aggregation)
    assert torch.equal(_served(store, first)["w"], torch.zeros(4))
    second = store.publish({"w": w})
    assert second != first and torch.equal(_served(store, second)["w"], torch.ones(4))
