"""The bounded body reader: decoding every coding incrementally, honest sizes."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import zlib
from collections.abc import AsyncIterator

import httpx
import pytest

from outbox.body import Body, read_body

TEXT = b'{"hello": "world", "n": 12345}' * 100


class _Chunks(httpx.AsyncByteStream):
    def __init__(self, data: bytes, size: int) -> None:
        self.data, self.size = data, size

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), self.size):
            yield self.data[i : i + self.size]


def _read(data: bytes, encoding: str | None, *, chunk: int = 7, keep: int = 10**6,
          limit: int = 10**6) -> Body:  # fmt: skip
    headers = {"content-encoding": encoding} if encoding else {}
    response = httpx.Response(200, headers=headers, stream=_Chunks(data, chunk))
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
def test_decodes_in_small_steps_to_the_exact_body(encoded: bytes, encoding: str | None) -> None:
    body = _read(encoded, encoding)
    assert body.head == TEXT
    assert (body.size, body.complete, body.truncated) == (len(TEXT), True, False)
    assert body.sha256 == hashlib.sha256(TEXT).hexdigest()


def test_keeps_only_the_head_but_hashes_everything() -> None:
    body = _read(gzip.compress(TEXT), "gzip", keep=10)
    assert body.head == TEXT[:10]
    assert body.sha256 == hashlib.sha256(TEXT).hexdigest()
    assert body.complete and body.truncated


def test_stops_at_the_limit_and_says_at_least() -> None:
    bomb = gzip.compress(bytes(50 * 1024 * 1024))
    body = _read(gzip.compress(bomb), "gzip, gzip", chunk=65536, keep=100, limit=1000)
    assert (body.complete, body.sha256, body.size) == (False, None, 1001)
    assert body.head == bytes(100)


def test_corrupt_encoding_is_a_decoding_error() -> None:
    with pytest.raises(httpx.DecodingError):
        _read(b"not gzip at all", "gzip")


def test_more_than_three_stacked_codings_are_refused() -> None:
    data = TEXT
    for _ in range(4):
        data = gzip.compress(data)
    with pytest.raises(httpx.DecodingError, match="stacked"):
        _read(data, "gzip, gzip, gzip, gzip")


def test_a_coding_we_never_offered_is_taken_as_bytes() -> None:
    body = _read(b"\x1b\x00brotli?", "br")
    assert body.head == b"\x1b\x00brotli?" and body.complete
