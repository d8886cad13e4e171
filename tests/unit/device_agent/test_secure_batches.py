"""An agent's devices' secure aggregation calls, combined: calls made while a request is in flight
go together in the next one, each device gets its own answer or its own refusal, and a request
that fails fails each of its callers."""
from __future__ import annotations

import threading

import pytest

from device_agent.api import Unreachable
from device_agent.secure_batches import Combined, SecureBatches
from shared.errors import Conflict, Failed, NotAllowed
from shared.schemas import (
    Refusal, SecAggAnswers, SecAggBatch, SecAggBatchAck, SecAggInbox, SecAggKeys, SecAggQuestion, SecAggRoster,
    SecAggShares,
)

WAIT = 5.0


def _threads(count: int, target) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.parametrize("limit, sizes", [(1000, [1, 4]), (3, [1, 3, 1])])
def test_calls_made_while_a_request_is_in_flight_go_together_in_the_next_ones(limit, sizes):
    sent: list[list[str]] = []
    first_in_flight, release = threading.Event(), threading.Event()

    def send(items: dict[str, int]) -> dict[str, int | Exception]:
        sent.append(sorted(items))
        if len(sent) == 1:
            first_in_flight.set()
            assert release.wait(WAIT)
        return {key: item * 10 if key != "d3" else Conflict("taken out") for key, item in items.items()}

    combined: Combined[int, int] = Combined(send, limit)
    results: dict[str, object] = {}

    def call(i: int) -> None:
        try:
            results[f"d{i}"] = combined.call(f"d{i}", i)
        except Conflict as exc:
            results[f"d{i}"] = exc

    first = _threads(1, call)
    assert first_in_flight.wait(WAIT)
    rest = [threading.Thread(target=call, args=(i,)) for i in range(1, 5)]
    for thread in rest:
        thread.start()
    # The four wait for the first request; only then are they sent, as many at once as the limit allows.
    while sum(len(batch.items) for batch in combined._pending) < 4:
        threading.Event().wait(0.01)
    release.set()
    for thread in first + rest:
        thread.join(WAIT)
    # The four went in the order they came, which their threads decide.
    assert sent[0] == ["d0"] and [len(r) for r in sent] == sizes and sorted(sum(sent, [])) == [f"d{i}" for i in range(5)]
    assert {k: v for k, v in results.items() if k != "d3"} == {"d0": 0, "d1": 10, "d2": 20, "d4": 40}
    assert isinstance(results["d3"], Conflict)


def test_a_request_that_fails_fails_each_of_its_callers_and_the_next_one_is_sent_again():
    answers: list[Exception | None] = [Unreachable("connection refused"), None]

    def send(items: dict[str, int]) -> dict[str, int | Exception]:
        error = answers.pop(0)
        if error is not None:
            raise error
        return dict(items)

    combined: Combined[int, int] = Combined(send)
    with pytest.raises(Unreachable):
        combined.call("d0", 1)
    assert combined.call("d0", 1) == 1
    with pytest.raises(Failed, match="left out 'd1'"):
        Combined(lambda items: {}).call("d1", 1)


class FakeAgentApi:
    def __init__(self) -> None:
        self.batches: list[tuple[int, SecAggBatch]] = []
        self.questions: list[tuple[int, str, SecAggQuestion]] = []
        self.answers = SecAggAnswers()

    def secagg_batch(self, round_id: int, req: SecAggBatch) -> SecAggBatchAck:
        self.batches.append((round_id, req))
        return SecAggBatchAck(refused={"d1": Refusal(status=403, detail="not its current token")})

    def secagg_ask_batch(self, round_id: int, stage: str, req: SecAggQuestion) -> SecAggAnswers:
        self.questions.append((round_id, stage, req))
        return self.answers


class FakeDevice:
    def __init__(self, device_id: str, token: str | None) -> None:
        self.device_id = device_id
        self.token = token


def _keys(device: str) -> SecAggKeys:
    return SecAggKeys(device_id=device, round_id=4, mask_key=bytes(32), share_key=bytes(32))


def test_a_devices_messages_and_questions_travel_with_its_token_and_its_refusal_is_its_domain_error():
    api = FakeAgentApi()
    batches = SecureBatches(api)   # type: ignore[arg-type]
    d0, d1 = batches.channel(FakeDevice("d0", "t0")), batches.channel(FakeDevice("d1", "t1"))
    d0.secagg_send(4, "keys", _keys("d0"))
    with pytest.raises(NotAllowed, match="not its current token"):
        d1.secagg_send(4, "shares", SecAggShares(device_id="d1", round_id=4, shares={"d0": b"x"}, seed_commitment=bytes(16),
                                                  own_commitments=bytes(32)))
    assert [(r, [(d.device_id, d.token) for d in b.devices], len(b.keys), len(b.shares)) for r, b in api.batches] == [
        (4, [("d0", "t0")], 1, 0), (4, [("d1", "t1")], 0, 1)]
    with pytest.raises(ValueError, match="its own stage messages"):
        d0.secagg_send(4, "keys", _keys("d1"))

    roster = SecAggRoster(ready=True, threshold=2, keys={"d0": _keys("d0")})
    api.answers = SecAggAnswers(rosters={"d0": roster}, refused={"d1": Refusal(status=409, detail="taken out")})
    assert d0.secagg_ask(4, "roster", "d0", 12.0, SecAggRoster) == roster
    with pytest.raises(Conflict, match="taken out"):
        d1.secagg_ask(4, "roster", "d1", 3.0, SecAggRoster)
    with pytest.raises(Failed, match="answered the roster stage with a SecAggRoster"):
        d0.secagg_ask(4, "roster", "d0", 12.0, SecAggInbox)
    assert [(r, s, [d.device_id for d in q.devices], q.wait_s) for r, s, q in api.questions][:2] == [
        (4, "roster", ["d0"], 12.0), (4, "roster", ["d1"], 3.0)]
