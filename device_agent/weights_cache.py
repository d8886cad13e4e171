"""The weights an agent's devices were named, fetched once for all of them.

A task names its weights by id (``TaskResponse.weights_id``; the Fed Server's
``fed_server/weights_store.py``). When a round opens, every device of an agent that trains the
same split point is named the same weights at about the same time: the first device to ask
fetches them, the others wait for that fetch, and all of them use the one received body until the
last one is done with it. An agent hosting ten virtual devices thus receives and holds the global
model once a round instead of ten times, and a device waiting for a compute thread holds no
weights of its own (it copies them into its model when its training starts).

Nothing is kept once no device uses it: a real device (one per agent) holds no second copy of its
model between rounds, and a device that asks later for weights nobody holds fetches them again.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from shared.schemas import WeightsId, WeightsResponse, WireState


@dataclass(frozen=True)
class FetchedWeights:
    """A fetched :class:`WeightsResponse`'s weights and the size of its body in bytes (what each
    device that uses them counts as received, for its emulated transfer time)."""

    weights: WireState
    size: int


#: Fetches named weights for one device: (the answer, its body's size in bytes).
Fetch = Callable[[], tuple[WeightsResponse, int]]


@dataclass
class _Entry:
    users: int = 0
    fetched: threading.Event = field(default_factory=threading.Event)
    value: FetchedWeights | None = None      # None once fetched: the fetch failed


class WeightsCache:
    """Named weights shared by an agent's devices while any of them uses them (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[WeightsId, _Entry] = {}
        #: Weights received over the network (each fetch), for tests and logs.
        self.fetches = 0

    @contextmanager
    def use(self, weights_id: WeightsId, fetch: Fetch) -> Iterator[FetchedWeights]:
        """The weights ``weights_id`` names, held until the ``with`` block ends.

        The first user fetches them with its ``fetch``; users that come while that fetch runs wait
        for it. If it fails, its error reaches its own device, and each waiting one fetches for
        itself (its own token, its own error)."""
        with self._lock:
            entry = self._entries.get(weights_id)
            first = entry is None
            if entry is None:
                entry = self._entries[weights_id] = _Entry()
            entry.users += 1
        try:
            if first:
                try:
                    entry.value = self._fetch(fetch)
                finally:
                    entry.fetched.set()
            else:
                entry.fetched.wait()
            yield entry.value if entry.value is not None else self._fetch(fetch)
        finally:
            with self._lock:
                entry.users -= 1
                if entry.users == 0 and self._entries.get(weights_id) is entry:
                    del self._entries[weights_id]

    def _fetch(self, fetch: Fetch) -> FetchedWeights:
        answer, size = fetch()
        with self._lock:
            self.fetches += 1
        return FetchedWeights(answer.weights, size)

    def __len__(self) -> int:
        """Entries held now (weights some device uses)."""
        with self._lock:
            return len(self._entries)
