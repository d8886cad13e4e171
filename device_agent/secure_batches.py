"""An agent's devices' secure aggregation stages, sent together (docs/privacy.md, "Many devices on
one agent").

Each device of an agent runs its secure stages on its own thread, as a lone device does (keys,
the roster, shares, the inbox, and after its upload the unmasking question and answer). Sent one
device at a time, an agent hosting a thousand devices makes thousands of requests and holds a
thousand long polls a stage. Here a device's calls go to its agent's :class:`SecureBatches`
instead: every call made while the previous request of its kind is in flight goes in the next
request, which whichever of those devices' threads comes first sends (no timer: a batch is what
gathered meanwhile). Messages of one attempt go in one ``POST .../secagg/batch``; a stage's
question for many devices is one held ``POST .../secagg/{stage}/batch``, which a stage's close
answers for all of them at once. Each device still gets exactly its own answer, or its own
refusal as the domain error its own request would have raised.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pydantic import BaseModel

from device_agent.api import SecureBatchApi, StageAnswer
from device_agent.clients import error_for_status
from shared.errors import Failed
from shared.schemas import (
    MAX_AGENT_DEVICES, AgentDevice, Refusal, SecAggAnswers, SecAggBatch, SecAggKeys, SecAggQuestion, SecAggShares, SecAggUnmask,
)

Item = TypeVar("Item")
Result = TypeVar("Result")
#: What a device sends into a stage.
StageMessage = SecAggKeys | SecAggShares | SecAggUnmask


@dataclass
class _Batch(Generic[Item, Result]):
    items: dict[str, Item] = field(default_factory=dict)
    done: bool = False
    results: Mapping[str, Result | Exception] | Exception = field(default_factory=dict)

    def result(self, key: str) -> Result:
        """``key``'s result, raising its error (or the whole request's)."""
        outcome = self.results if isinstance(self.results, Exception) else self.results.get(key)
        if outcome is None:
            raise Failed(f"the Fed Server's answer to a batch left out {key!r}")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


class Combined(Generic[Item, Result]):
    """Calls from many threads, each keyed by its caller, sent ``send``'s way together: a call made
    while a request is in flight waits for the next one, which the first of its callers to find
    none in flight sends for all of them. A request carries at most ``limit`` calls (a message's
    most devices); the calls past it wait for the requests after it, in turn."""

    def __init__(self, send: Callable[[dict[str, Item]], Mapping[str, Result | Exception]],
                 limit: int = MAX_AGENT_DEVICES) -> None:
        self._send = send
        self._limit = limit
        self._changed = threading.Condition()
        self._pending: deque[_Batch[Item, Result]] = deque()
        self._busy = False

    def call(self, key: str, item: Item) -> Result:
        """``key``'s result of the request that carried ``item``."""
        with self._changed:
            if not self._pending or len(self._pending[-1].items) >= self._limit:
                self._pending.append(_Batch())
            batch = self._pending[-1]
            batch.items[key] = item
            while not batch.done and (self._busy or self._pending[0] is not batch):
                self._changed.wait()
            if batch.done:
                return batch.result(key)
            self._busy = True
            self._pending.popleft()
        results: Mapping[str, Result | Exception] | Exception = Failed("the batch's request was interrupted")
        try:
            results = self._send(batch.items)
        except Exception as exc:   # the whole request failed (unreachable, refused): every caller's error
            results = exc
        finally:   # even when interrupted, the callers waiting on it are answered and the next may lead
            with self._changed:
                batch.results, batch.done, self._busy = results, True, False
                self._changed.notify_all()
        return batch.result(key)


class SecureBatches:
    """One agent's secure aggregation requests for all its devices (:meth:`channel` for each)."""

    def __init__(self, api: SecureBatchApi) -> None:
        self.api = api
        self._lock = threading.Lock()
        self._combined: dict[tuple[int, str], Combined] = {}
        self._newest = -1

    def channel(self, device: TokenHolder) -> "DeviceChannel":
        """What ``device``'s stages go through, each call with its current token."""
        return DeviceChannel(self, device)

    def _of(self, round_id: int, kind: str, send: Callable[[dict], Mapping]) -> Combined:
        """The attempt's combined calls of ``kind`` (sends, or one stage's questions); those of
        earlier attempts are let go once a later attempt's arrive."""
        with self._lock:
            if round_id > self._newest:
                self._newest = round_id
                self._combined = {k: c for k, c in self._combined.items() if k[0] >= round_id}
            combined = self._combined.get((round_id, kind))
            if combined is None:
                combined = self._combined[(round_id, kind)] = Combined(send)
            return combined

    def send(self, round_id: int, message: StageMessage, token: str | None) -> None:
        """``message`` (its device's) into attempt ``round_id``'s stages; its refusal raised."""
        def send(items: dict[str, tuple[StageMessage, str | None]]) -> dict[str, bool | Exception]:
            batch = SecAggBatch(devices=[AgentDevice(device_id=d, token=t) for d, (_, t) in items.items()],
                                keys=[m for m, _ in items.values() if isinstance(m, SecAggKeys)],
                                shares=[m for m, _ in items.values() if isinstance(m, SecAggShares)],
                                unmask=[m for m, _ in items.values() if isinstance(m, SecAggUnmask)])
            refused = self.api.secagg_batch(round_id, batch).refused
            return {d: _error(refused[d]) if d in refused else True for d in items}
        self._of(round_id, "send", send).call(message.device_id, (message, token))

    def ask(self, round_id: int, stage: str, device_id: str, token: str | None, wait_s: float,
            model: type[StageAnswer]) -> StageAnswer:
        """``stage``'s answer for ``device_id``, held up to ``wait_s`` (the shortest wait of the
        devices asking together); its refusal raised."""
        def ask(items: dict[str, tuple[str | None, float]]) -> dict[str, BaseModel | Exception]:
            question = SecAggQuestion(devices=[AgentDevice(device_id=d, token=t) for d, (t, _) in items.items()],
                                      wait_s=min(w for _, w in items.values()))
            answers = _stage_answers(self.api.secagg_ask_batch(round_id, stage, question), stage)
            return {d: answers[d] for d in items if d in answers}
        answer = self._of(round_id, stage, ask).call(device_id, (token, wait_s))
        if not isinstance(answer, model):
            raise Failed(f"the Fed Server answered the {stage} stage with a {type(answer).__name__}")
        return answer


class TokenHolder(Protocol):
    """A device as its channel sees it: its id and its current token (None before it registers,
    or on a server without authentication)."""

    @property
    def device_id(self) -> str: ...

    @property
    def token(self) -> str | None: ...


class DeviceChannel:
    """One device's :class:`device_agent.api.SecureChannel` through its agent's batches."""

    def __init__(self, batches: SecureBatches, device: TokenHolder) -> None:
        self.batches = batches
        self.device = device

    def secagg_send(self, round_id: int, stage: str, req: BaseModel) -> None:
        if not isinstance(req, (SecAggKeys, SecAggShares, SecAggUnmask)) or req.device_id != self.device.device_id:
            raise ValueError(f"{self.device.device_id} sends only its own stage messages, not {type(req).__name__}")
        self.batches.send(round_id, req, self.device.token)

    def secagg_ask(self, round_id: int, stage: str, device_id: str, wait_s: float,
                   model: type[StageAnswer]) -> StageAnswer:
        return self.batches.ask(round_id, stage, device_id, self.device.token, wait_s, model)


def _error(refusal: Refusal) -> Exception:
    return error_for_status(refusal.status, refusal.detail, refusal.retry_after_s)


def _stage_answers(answers: SecAggAnswers, stage: str) -> dict[str, BaseModel | Exception]:
    """Each device's answer (in ``stage``'s field) or refusal."""
    field_of: dict[str, Mapping[str, BaseModel]] = {"roster": answers.rosters, "inbox": answers.inboxes,
                                                     "unmask": answers.plans}
    out: dict[str, BaseModel | Exception] = {**field_of[stage]}
    out.update({d: _error(r) for d, r in answers.refused.items()})
    return out
