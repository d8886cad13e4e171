"""An agent's named weights: fetched once for the devices using them, held only while used."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from device_agent.weights_cache import WeightsCache
from shared.errors import NotFound
from shared.schemas import WeightsResponse
from shared.wire import encode_state

ANSWER = WeightsResponse(weights=encode_state({"w": torch.ones(3)}))


def test_devices_asking_at_once_share_one_fetch_and_nothing_is_held_after_the_last():
    cache = WeightsCache()
    calls: list[str] = []
    inside = threading.Barrier(8)
    got = []

    def fetch():
        calls.append(threading.current_thread().name)
        time.sleep(0.2)   # the others ask while this fetch runs
        return ANSWER, 123

    def device() -> None:
        with cache.use("a" * 32, fetch) as weights:
            got.append(weights)
            inside.wait(timeout=10)   # all eight hold the weights at once
            assert len(cache) == 1

    threads = [threading.Thread(target=device, name=f"dev-{i}") for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and cache.fetches == 1 and len(got) == 8
    assert all(w is got[0] for w in got) and got[0].size == 123 and got[0].weights is ANSWER.weights
    assert len(cache) == 0
    with cache.use("a" * 32, lambda: (ANSWER, 123)):   # asked again later: fetched again
        pass
    assert cache.fetches == 2


def test_a_failed_fetch_reaches_its_device_and_the_waiting_devices_fetch_for_themselves():
    cache = WeightsCache()
    started = threading.Event()
    outcomes: dict[str, object] = {}

    def failing():
        started.set()
        time.sleep(0.2)
        raise NotFound("weights are not served (any more)")

    def first() -> None:
        try:
            with cache.use("b" * 32, failing):
                pass
        except NotFound as exc:
            outcomes["first"] = exc

    def second() -> None:
        started.wait(timeout=10)
        with cache.use("b" * 32, lambda: (ANSWER, 7)) as weights:
            outcomes["second"] = weights.size

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(outcomes["first"], NotFound) and outcomes["second"] == 7
    assert len(cache) == 0


def test_an_error_inside_the_block_releases_the_weights():
    cache = WeightsCache()
    with pytest.raises(RuntimeError):
        with cache.use("c" * 32, lambda: (ANSWER, 1)):
            raise RuntimeError("training failed")
    assert len(cache) == 0
