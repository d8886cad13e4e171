"""The benchmarks' bare responder, on a real loopback socket: it reads each body however it is
sent and answers every request on a kept-alive connection; as (c)'s Fed Server stand-in its
answer is an Ack the Main Server's upload accepts."""
from __future__ import annotations

import asyncio

import httpx

from benchmarks.bare_http import BareProtocol, http_answer
from shared.http_client import decode_response
from shared.schemas import Ack
from shared.wire import packb


async def _exchange(answer: tuple[bytes, bytes]) -> tuple[list[httpx.Response], bytes, bytes]:
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: BareProtocol(answer), "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            answers = [await client.post("/v1/rounds/1/step", content=bytes(401 << 10)) for _ in range(3)]
            answers.append(await client.post("/v1/rounds/1/server-portions", content=bytes(7 << 20)))
            answers.append(await client.get("/healthz"))
        # the head and the first half of the body in one write, the rest later
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nhost: bare\r\ncontent-length: 10\r\n\r\n12345")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"67890")
        head = await reader.readuntil(b"\r\n\r\n")
        body = await reader.readexactly(len(answer[1]))
        writer.close()
        return answers, head, body
    finally:
        listener.close()


def test_every_request_is_answered_on_a_kept_alive_connection_however_its_body_arrives() -> None:
    answer = http_answer(bytes(401 << 10))
    answers, head, body = asyncio.run(_exchange(answer))
    for resp in answers:
        assert resp.status_code == 200 and resp.content == answer[1]
        assert resp.headers["content-type"] == "application/msgpack"
    assert head == answer[0] and body == answer[1]


def test_the_fed_server_stand_in_s_answer_is_an_ack_the_main_server_accepts() -> None:
    answers, _, _ = asyncio.run(_exchange(http_answer(packb(Ack(detail="received").model_dump()))))
    assert all(decode_response(resp, Ack).ok for resp in answers)
