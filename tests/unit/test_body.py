"""The bounded body reader: decoding every coding incrementally, honest sizes."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest

from outbox.wire.body import Body, RawStream, read_body

TEXT = b'{"hello": "world", "n": 12345}' * 100


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), self.size):
            yield self.data[i : i + self.size]


class _Raw(httpx.AsyncByteStream, RawStream):
    """A transport stream read directly (as the shipped transport's is), never suspending."""

    def __init__(self, data: bytes, size: int) -> None:
        self.chunks = [data[i : i + size] for i in range(0, len(data), size)]
        self.closed = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read_raw():
            yield chunk

    async def read_raw(self) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""

    async def aclose(self) -> None:
        self.closed += 1


def _read(data: bytes, encoding: str | None, *, chunk: int = 7, keep: int = 10**6,
          limit: int = 10**6, raw: bool = False) -> Body:  # fmt: skip
    headers = {"content-encoding": encoding} if encoding else {}
    stream = _Raw(data, chunk) if raw else _Chunks(data, chunk)
    response = httpx.Response(200, headers=headers, stream=stream)
    return asyncio.run(read_body(response, keep=keep, limit=limit))


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


@pytest.mark.parametrize(
    ("encoded", "encoding"),
    [
        (TEXT, None),
        (TEXT, "identity"),
        (gzip.compress(TEXT), "gzip"),
        (gzip.compress(TEXT), "x-gzip"),
        (zlib.compress(TEXT), "deflate"),
        (_raw_deflate(TEXT), "deflate"),
        (gzip.compress(gzip.compress(TEXT)), "gzip, gzip"),
        (gzip.compress(zlib.compress(TEXT)), "deflate, gzip"),
        (gzip.compress(TEXT[:100]) + gzip.compress(TEXT[100:]), "gzip"),  # two members
    ],
)
@pytest.mark.parametrize("raw", [False, True], ids=["aiter_raw", "raw_stream"])
def test_decodes_in_small_steps_to_the_exact_body(
    encoded: bytes, encoding: str | None, raw: bool
) -> None:
    body = _read(encoded, encoding, raw=raw)
    assert body.head == TEXT
    assert (body.size, body.complete, body.truncated) == (len(TEXT), True, False)
    assert body.sha256 == hashlib.sha256(TEXT).hexdigest()


def test_keeps_only_the_head_but_hashes_everything() -> None:
    body = _read(gzip.compress(TEXT), "gzip", keep=10)
    assert body.head == TEXT[:10]
    assert body.sha256 == hashlib.sha256(TEXT).hexdigest()
    assert body.complete and body.truncated


@pytest.mark.parametrize("raw", [False, True], ids=["aiter_raw", "raw_stream"])
def test_stops_at_the_limit_and_says_at_least(raw: bool) -> None:
    bomb = gzip.compress(bytes(50 * 1024 * 1024))
    body = _read(gzip.compress(bomb), "gzip, gzip", chunk=65536, keep=100, limit=1000, raw=raw)
    assert (body.complete, body.sha256, body.size) == (False, None, 1001)
    assert body.head == bytes(100)


@pytest.mark.parametrize("raw", [False, True], ids=["aiter_raw", "raw_stream"])
def test_corrupt_encoding_is_a_decoding_error(raw: bool) -> None:
    with pytest.raises(httpx.DecodingError):
        _read(b"not gzip at all", "gzip", raw=raw)


def test_more_than_three_stacked_codings_are_refused() -> None:
    data = TEXT
    for _ in range(4):
        data = gzip.compress(data)
    with pytest.raises(httpx.DecodingError, match="stacked"):
        _read(data, "gzip, gzip, gzip, gzip")


def test_a_coding_we_never_offered_is_taken_as_bytes() -> None:
    body = _read(b"\x1b\x00brotli?", "br")
    assert body.head == b"\x1b\x00brotli?" and body.complete


def _state(response: httpx.Response) -> tuple[bool, bool, int]:
    return (response.is_stream_consumed, response.is_closed, response.num_bytes_downloaded)


@pytest.mark.parametrize(("limit", "complete"), [(10**6, True), (1000, False)])
def test_a_raw_stream_leaves_the_response_as_aiter_raw_does(limit: int, complete: bool) -> None:
    data = gzip.compress(TEXT)

    async def read(stream: httpx.AsyncByteStream) -> tuple[Body, httpx.Response]:
        response = httpx.Response(200, headers={"content-encoding": "gzip"}, stream=stream)
        return await read_body(response, keep=100, limit=limit), response

    via_httpx, plain = asyncio.run(read(_Chunks(data, 50)))
    raw = _Raw(data, 50)
    direct, response = asyncio.run(read(raw))
    assert direct == via_httpx and direct.complete is complete
    assert _state(response) == _state(plain)
    # Read to the end: closed (the connection goes back to the pool) exactly once. Stopped
    # early: left open for the caller's close (which never reuses the connection).
    assert (response.is_closed, raw.closed) == ((True, 1) if complete else (False, 0))
    for read_twice in (plain, response):  # as httpx says of a second read
        with pytest.raises(httpx.StreamConsumed):
            asyncio.run(read_body(read_twice, keep=1, limit=1))


def _ticks_while_reading(stream: httpx.AsyncByteStream, encoding: str | None = None) -> int:
    """How often another task ran while ``stream`` was read (the loop not hogged)."""

    async def go() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        started = ticks
        headers = {"content-encoding": encoding} if encoding else {}
        response = httpx.Response(200, headers=headers, stream=stream)
        await read_body(response, keep=10, limit=10**9)
        task.cancel()
        return ticks - started

    return asyncio.run(go())


def test_the_reader_yields_to_the_loop_where_there_is_work_to_interrupt() -> None:
    # 64 chunks of 64 KiB already there (never suspending): hashed 64 KiB at a time.
    assert _ticks_while_reading(_Raw(bytes(64 * 65536), 65536)) >= 64
    assert _ticks_while_reading(_Chunks(bytes(64 * 65536), 65536)) >= 64
    # Each inflating step of a bomb, however small its chunks on the wire.
    bomb = gzip.compress(bytes(8 * 1024 * 1024))
    assert _ticks_while_reading(_Raw(bomb, 1024), "gzip") >= 8 * 1024 * 1024 // 65536
    # A small plain body: no needless trip through the loop per piece.
    assert _ticks_while_reading(_Raw(TEXT, 100)) == 0
