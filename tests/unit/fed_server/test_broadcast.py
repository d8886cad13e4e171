"""The Fed Server's broadcast: an answer held for a change is recomputed at every post, returned
once it is ready, or as it stands when the wait is over; no post is missed."""
from __future__ import annotations

import asyncio
import time

from fed_server.broadcast import Broadcast


def test_a_ready_answer_is_returned_at_once():
    async def main() -> tuple[str, float]:
        started = time.monotonic()
        answer = await Broadcast().hold(lambda: "ready", lambda value: value == "ready", 5.0)
        return answer, time.monotonic() - started
    answer, took = asyncio.run(main())
    assert answer == "ready" and took < 1.0


def test_an_answer_that_never_becomes_ready_is_returned_as_it_stands_after_the_wait():
    async def main() -> tuple[int, float, list[int]]:
        computed: list[int] = []
        started = time.monotonic()
        answer = await Broadcast().hold(lambda: computed.append(len(computed)) or len(computed), lambda _: False, 0.2)
        return answer, time.monotonic() - started, computed
    answer, took, computed = asyncio.run(main())
    assert took >= 0.2 and answer == 2 and computed == [0, 1]   # at first, and as it stands at the end


def test_every_waiter_wakes_at_a_post_and_sees_the_new_state():
    async def main() -> tuple[list[int], float]:
        broadcast, state = Broadcast(), {"records": 0}
        waiters = [asyncio.create_task(broadcast.hold(lambda: state["records"], lambda n: n > 0, 10.0)) for _ in range(3)]
        await asyncio.sleep(0.05)   # all three are waiting
        started = time.monotonic()
        state["records"] = 1
        broadcast.post()
        answers = await asyncio.gather(*waiters)
        return answers, time.monotonic() - started
    answers, took = asyncio.run(main())
    assert answers == [1, 1, 1] and took < 1.0


def test_a_post_that_does_not_make_the_answer_ready_keeps_the_waiter_waiting():
    async def main() -> tuple[int, int]:
        broadcast, state, computed = Broadcast(), {"records": 0}, []

        def answer() -> int:
            computed.append(state["records"])
            return state["records"]
        waiter = asyncio.create_task(broadcast.hold(answer, lambda n: n >= 2, 10.0))
        for _ in range(2):
            await asyncio.sleep(0.02)
            state["records"] += 1
            broadcast.post()
        return await waiter, len(computed)
    answer, computed = asyncio.run(main())
    assert answer == 2 and computed == 3   # once at first, once after each post


def test_a_post_while_the_answer_is_computed_is_not_missed():
    # The state changes and is posted from inside the first computation (as a record written
    # between the check and the wait would be): the waiter must wake for it, not sleep 10 s.
    async def main() -> tuple[int, float]:
        broadcast, state = Broadcast(), {"records": 0, "calls": 0}

        def answer() -> int:
            state["calls"] += 1
            if state["calls"] == 1:
                value = state["records"]
                state["records"] = 1
                broadcast.post()
                return value
            return state["records"]
        started = time.monotonic()
        value = await broadcast.hold(answer, lambda n: n > 0, 10.0)
        return value, time.monotonic() - started
    value, took = asyncio.run(main())
    assert value == 1 and took < 1.0


def test_closing_answers_every_held_request_as_it_stands_and_every_later_one_at_once():
    # The server is stopping: a long-poll is let go instead of holding the shutdown.
    async def main() -> tuple[list[int], int, bool]:
        broadcast = Broadcast()
        waiters = [asyncio.create_task(broadcast.hold(lambda: 0, lambda n: n > 0, 60.0)) for _ in range(2)]
        await asyncio.sleep(0.05)   # both are held
        assert not any(w.done() for w in waiters)
        broadcast.close()
        answers = await asyncio.wait_for(asyncio.gather(*waiters), 5.0)
        later = await asyncio.wait_for(broadcast.hold(lambda: 7, lambda n: False, 60.0), 5.0)
        return answers, later, True
    answers, later, _ = asyncio.run(main())
    assert answers == [0, 0] and later == 7
