"""The floor benchmark's bare app reads a whole body, however it is chunked, and answers a step
answer's size."""
from __future__ import annotations

import asyncio

import httpx

from benchmarks.http_floor import ANSWER_BYTES, bare_app


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

