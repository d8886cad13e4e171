"""A bare HTTP/1.1 responder for the benchmarks: every request gets the same answer.

:class:`BareProtocol` is an asyncio ``BufferedProtocol`` (on uvloop): it receives each request's
head into a buffer and its body (Content-Length bytes) straight into a buffer of that size, then
writes the answer; any path, any method, kept-alive connections. It understands only what the
benchmarks send (a Content-Length body) and checks nothing: not a server for the services.

Two uses: benchmark (c)'s stand-in for the Fed Server (``python -m benchmarks.bare_http --port
P``), which reads each finished group's server-portion upload and acknowledges it as the Fed
Server would (an ``Ack``), so that the uploads cost the Main Server what a delivered upload costs
(one POST) rather than a connection refused and retried; and the floor's ``asyncio`` server
(``benchmarks/http_floor.py``): the least Python can do per request.
"""
from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from shared.schemas import Ack
from shared.wire import packb


def http_answer(body: bytes, content_type: bytes = b"application/msgpack") -> tuple[bytes, bytes]:
    """A 200 answer's head and body, to be written as they are."""
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n")
    return head, body


class BareProtocol(asyncio.BufferedProtocol):
    """One connection: each request's head into an 8 KB buffer, its body received straight into a
    buffer of its Content-Length, then ``answer`` (pieces written as they are)."""

    HEAD_BYTES = 8192
    transport: asyncio.Transport   # set by connection_made, before any data arrives

    def __init__(self, answer: Sequence[bytes]) -> None:
        self.answer = answer
        self.head = bytearray(self.HEAD_BYTES)
        self.head_len = 0
        self.body: bytearray | None = None
        self.body_len = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is None:
            return memoryview(self.head)[self.head_len:]
        return memoryview(self.body)[self.body_len:]

    def buffer_updated(self, nbytes: int) -> None:
        if self.body is None:
            self.head_len += nbytes
            end = self.head.find(b"\r\n\r\n", 0, self.head_len)
            if end < 0:
                return
            size = 0
            for line in bytes(self.head[:end]).split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    size = int(value)
            extra = self.head_len - end - 4   # body bytes that came with the head
            self.body = bytearray(size)
            self.body[:extra] = self.head[end + 4:self.head_len]
            self.body_len, self.head_len = extra, 0
        else:
            self.body_len += nbytes
        if self.body_len >= len(self.body):
            self.body, self.body_len = None, 0
            self.transport.writelines(self.answer)


async def serve_forever(port: int, answer: Sequence[bytes]) -> None:
    """Answer every request on 127.0.0.1:``port`` with ``answer`` until cancelled."""
    listener = await asyncio.get_running_loop().create_server(lambda: BareProtocol(answer), "127.0.0.1", port)
    await listener.serve_forever()


def run(port: int, answer: Sequence[bytes]) -> None:
    """:func:`serve_forever` on uvloop, as the services run."""
    import uvloop
    uvloop.run(serve_forever(port, answer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bare_http",
                                     description="Benchmark (c)'s Fed Server stand-in: acknowledges every request.")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    run(args.port, http_answer(packb(Ack(detail="received").model_dump())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
