"""The global model's portions that tasks name, packed once and served by id.

A task names its weights (``TaskResponse.weights_id``) instead of carrying them. Every device of
an attempt with the same split point is named the same weights, so an agent hosting many
virtual devices fetches them once (``device_agent/weights_cache.py``), and the Fed Server packs
each portion once and sends that same body to every fetch, instead of one copy of the model per
device in flight.

An id is the content's digest: the same weights published twice (a FedAvg round's whole-model
portion and the federated evaluation of the model it starts from) are one entry, and an agent's
cache can never mistake other weights for them, whatever restarts happen in between.
"""
from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping

import torch

from shared.errors import NotFound
from shared.schemas import WeightsId
from shared.wire import Body, encode_state, pack_body


class WeightsStore:
    """Published portions by id, each kept while some holder (an attempt, an evaluation phase, the
    final answer) still names it."""

    def __init__(self) -> None:
        self._bodies: dict[WeightsId, Body] = {}
        self._holders: Counter[WeightsId] = Counter()

    def publish(self, state: Mapping[str, torch.Tensor]) -> WeightsId:
        """Pack ``state`` (a snapshot: later changes to the tensors do not reach it) and return its
        id. Every call is one hold on the id, ended by one :meth:`release`."""
        body = pack_body({"weights": encode_state(state)})
        digest = hashlib.blake2b(digest_size=16)
        for piece in body:
            digest.update(piece)
        weights_id = digest.hexdigest()
        self._bodies.setdefault(weights_id, body)
        self._holders[weights_id] += 1
        return weights_id

    def release(self, weights_id: WeightsId) -> None:
        """End one hold on ``weights_id``; the body goes with the last one."""
        self._holders[weights_id] -= 1
        if self._holders[weights_id] <= 0:
            del self._holders[weights_id]
            self._bodies.pop(weights_id, None)

    def body(self, weights_id: WeightsId) -> Body:
        """The packed :class:`shared.schemas.WeightsResponse` of ``weights_id`` (NotFound once no
        task names it any more: its attempt or evaluation phase has ended)."""
        try:
            return self._bodies[weights_id]
        except KeyError:
            raise NotFound(f"weights {weights_id} are not served (any more): the task that named them "
                           f"has ended") from None

    def size(self, weights_id: WeightsId) -> int:
        """The body's length in bytes (counted in the round's bytes down once per task naming it)."""
        return len(self.body(weights_id))

    def __len__(self) -> int:
        return len(self._bodies)
