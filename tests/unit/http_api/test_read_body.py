"""``read_body``: one buffer of the declared Content-Length (allocated up front only up to a
mebibyte: a client cannot make the server hold a large declared body it does not send), limits
before and while reading, and a body whose length contradicts its Content-Length refused (a server
that did not stop the body at its length, or ended it early, cannot hand the handler a padded or
truncated message)."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from http_api.server import ApiError, read_body


def read(chunks: list[bytes], declared: str | None, max_bytes: int = 100) -> bytearray:
    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
    return asyncio.run(read_body(stream(), declared, max_bytes))


@pytest.mark.parametrize("declared", ["10", None])
def test_the_chunks_are_the_body(declared):
    assert read([b"abc", b"", b"defg", b"hij"], declared) == bytearray(b"abcdefghij")


def test_a_declared_length_past_the_limit_is_refused_before_reading():
    consumed = []

    async def stream() -> AsyncIterator[bytes]:
        consumed.append(True)
        yield b"x"

    with pytest.raises(ApiError) as err:
        asyncio.run(read_body(stream(), "101", 100))
    assert err.value.status == 413 and not consumed


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    with pytest.raises(ApiError) as err:
        read([b"x" * 60, b"x" * 41, b"never read"], None)
    assert err.value.status == 413


@pytest.mark.parametrize("chunks, declared, status, words", [
    ([], None, 400, "empty"),
    ([b""], "0", 400, "empty"),
    ([b"abcdef"], "5", 400, "longer"),
    ([b"abc"], "5", 400, "shorter"),
])
def test_an_empty_or_mislabelled_body_is_refused(chunks, declared, status, words):
    with pytest.raises(ApiError) as err:
        read(chunks, declared)
    assert err.value.status == status and words in err.value.detail


def test_a_declared_length_is_allocated_only_up_to_a_mebibyte_before_its_bytes_arrive(monkeypatch):
    import http_api.server as server

    monkeypatch.setattr(server, "PREALLOCATED_MAX_BYTES", 8)
    sizes = []

    async def stream() -> AsyncIterator[bytes]:
        for chunk in (b"abcde", b"fghij", b"klmnop"):
            yield chunk

    real = server.bytearray if hasattr(server, "bytearray") else bytearray
    monkeypatch.setattr(server, "bytearray", lambda n=0: sizes.append(n) or real(n), raising=False)
    body = asyncio.run(server.read_body(stream(), "16", 100))
    assert body == bytearray(b"abcdefghijklmnop") and sizes == [8]
    assert read([b"abc"], "3") == bytearray(b"abc")    # a small body: allocated at its size at once
