"""The floor benchmark's bare servers read a whole body, however it is chunked, and answer a step
answer's size."""
from __future__ import annotations

import asyncio

import httpx

from benchmarks.http_floor import ANSWER_BYTES, BareProtocol, bare_app


def test_the_bare_app_reads_the_body_and_answers_a_step_answer_s_size() -> None:
    async def chunks():
        for _ in range(7):
            yield bytes(64 << 10)

    async def call(content) -> httpx.Response:
        transport = httpx.ASGITransport(app=bare_app)
        async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
            return await client.post("/v1/rounds/1/step", content=content)

    for content in (bytes(401 << 10), chunks()):
        resp = asyncio.run(call(content))
        assert resp.status_code == 200 and resp.headers["content-type"] == "application/msgpack"
        assert len(resp.content) == int(resp.headers["content-length"]) == ANSWER_BYTES


def test_the_bare_asyncio_server_answers_each_request_on_a_kept_alive_connection() -> None:
    """BareProtocol, on a real loopback socket: a body however it is sent (one piece, chunks that
    split the head from the body), several requests on one connection, a GET without a body."""
    async def exchange() -> list[httpx.Response]:
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(BareProtocol, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                answers = [await client.post("/v1/rounds/1/step", content=bytes(401 << 10)) for _ in range(3)]
                answers.append(await client.get("/healthz"))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /x HTTP/1.1\r\nhost: floor\r\ncontent-length: 10\r\n\r\n12345")
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"67890")
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(ANSWER_BYTES)
            writer.close()
            assert head.startswith(b"HTTP/1.1 200 OK") and len(body) == ANSWER_BYTES
            return answers
        finally:
            listener.close()

    for resp in asyncio.run(exchange()):
        assert resp.status_code == 200 and len(resp.content) == ANSWER_BYTES
