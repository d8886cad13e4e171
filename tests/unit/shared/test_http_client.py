"""The blocking client sends a message body as its pieces, with its length, and the server gets it whole.

A real uvicorn server on a loopback port answers what it received: its Content-Length and
Transfer-Encoding headers and the raw body bytes, read the way every route reads them.
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import msgpack
import pytest
import torch
import uvicorn
from fastapi import FastAPI, Request

from http_api.server import msgpack_response
from shared.http_client import SyncClient
from shared.schemas import Message, StepRequest, WireTensor
from shared.wire import encode_tensor, pack_body

pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")


class Received(Message):
    """What the echo route saw of one request."""

    content_length: str | None
    transfer_encoding: str | None
    body: bytes


def _echo_app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = b"".join([chunk async for chunk in request.stream()])
        return msgpack_response(Received(content_length=request.headers.get("content-length"),
                                         transfer_encoding=request.headers.get("transfer-encoding"), body=body))

    return app


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    # The socket listens before the server thread starts: a connection made at once waits in the
    # backlog until uvicorn accepts it, so nothing has to wait for the start-up.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    server = uvicorn.Server(uvicorn.Config(_echo_app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


def test_a_body_goes_out_in_pieces_with_its_length_and_arrives_whole(echo_url):
    gen = torch.Generator().manual_seed(0)
    req = StepRequest(device_id="dev-000", step=0, fx=WireTensor(**encode_tensor(torch.randn(64, 32, 14, 14, generator=gen))),
                      labels=WireTensor(**encode_tensor(torch.randint(0, 10, (64,), generator=gen))))
    assert len(pack_body(req.model_dump()).pieces) == 3  # the activation's bytes are a piece of their own
    client = SyncClient(echo_url, retries=0)
    try:
        got = client.call("POST", "/echo", Received, req)
    finally:
        client.close()
    expected = msgpack.packb(req.model_dump(), use_bin_type=True)
    assert got.body == expected
    # Sized, not chunked: chunked framing would make h11 join every piece with its frame (a copy).
    assert got.content_length == str(len(expected)) and got.transfer_encoding is None
    assert client.bytes.up == len(expected)
