"""Reading a response body from a receiver that may be hostile, in bounded memory.

One reader for attempts, status lookups and the conformance checker. It reads the raw
bytes and decodes ``Content-Encoding`` itself, incrementally: every decompression step
produces at most :data:`_STEP` bytes, so a 2 KB gzip bomb (stacked ``gzip, gzip`` or
not) can never expand in one piece, and reading stops the moment the *decoded* size
passes the read limit. The body is hashed as it streams; only the first ``keep`` bytes
are held in memory. A body that was not read to the end is reported as such
(``complete=False``, no hash): its size is a lower bound, not the size.

The caller bounds the time (the attempt deadline); the reader yields to the event loop
after every decoded step and after every :data:`_STEP` bytes of an unencoded body, so the
deadline can fire even while a bomb is being inflated or a large body hashed. A small
unencoded body (most answers) is read without a needless trip through the loop.

A transport's stream may offer its raw chunks directly (:class:`RawStream`, as the shipped
``AiohttpTransport``'s does): read without httpx's iterator around it, to the same
``httpx.Response`` state. Any other stream is read through ``Response.aiter_raw``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from outbox.wire import _httpx_fast

if TYPE_CHECKING:
    import httpx

#: The most output one decompression step may produce.
_STEP = 64 * 1024
#: More stacked content codings than this is not a real server.
_MAX_CODINGS = 3
#: What we tell receivers we can decode (never br or zstd, which we do not decode).
ACCEPT_ENCODING = "gzip, deflate"


@dataclass(frozen=True, slots=True)
class Body:
    """What was read of a response body (decoded)."""

    #: The first bytes of the body, at most the ``keep`` asked for.
    head: bytes
    #: Decoded bytes read: the body's size if ``complete``, else a lower bound.
    size: int
    #: SHA-256 of the whole decoded body, or None when it was not read to the end.
    sha256: str | None
    #: Read to the end (False: stopped at the read limit).
    complete: bool

    @property
    def truncated(self) -> bool:
        """Less of the body is held than there was (or may have been)."""
        return not self.complete or len(self.head) < self.size


def _decoding_error(message: str) -> Exception:
    """httpx's own error for an undecodable body (what httpx itself would raise)."""
    import httpx

    return httpx.DecodingError(message)


class _Inflate:
    """One content coding, undone in steps of at most ``_STEP`` output bytes."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._raw_fallback = coding == "deflate"
        wbits = zlib.MAX_WBITS | 16 if coding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self._d = zlib.decompressobj(wbits)
        self._started = False

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            try:
                out = self._d.decompress(data, _STEP)
            except zlib.error as exc:
                if self._raw_fallback and not self._started:
                    # "deflate" as many servers send it: raw, without the zlib header.
                    self._raw_fallback = False
                    self._d = zlib.decompressobj(-zlib.MAX_WBITS)
                    continue
                raise _decoding_error(f"the {self.coding} body is corrupt: {exc}") from exc
            self._started = True
            if self._d.eof and self._d.unused_data and self.coding in ("gzip", "x-gzip"):
                # Concatenated gzip members are one gzip stream (RFC 1952).
                data = self._d.unused_data
                self._d = zlib.decompressobj(zlib.MAX_WBITS | 16)
            else:
                data = self._d.unconsumed_tail
            if out:
                yield out
            if not out and not data:
                break


def _decoders(response: httpx.Response) -> list[_Inflate]:
    codings = [
        c.strip().lower()
        for c in response.headers.get_list("content-encoding", split_commas=True)
        if c.strip() and c.strip().lower() != "identity"
    ]
    if len(codings) > _MAX_CODINGS:
        raise _decoding_error(f"{len(codings)} stacked content codings: refused")
    if any(coding not in ("gzip", "x-gzip", "deflate") for coding in codings):
        # We never offer br or zstd; like httpx, take an unknown coding's bytes as they
        # are (still bounded by the limit) rather than fail the attempt over evidence.
        return []
    # Applied in the order listed, so undone in reverse.
    return [_Inflate(c) for c in reversed(codings)]


def _decode(decoders: list[_Inflate], data: bytes, level: int = 0) -> Iterator[bytes]:
    if level == len(decoders):
        yield data
        return
    for piece in decoders[level].feed(data):
        yield from _decode(decoders, piece, level + 1)


class RawStream:
    """A response stream that hands over its raw body one chunk at a time.

    :func:`read_body` reads such a stream (when the transport's response reaches it
    unwrapped) without ``Response.aiter_raw`` and the stream's own iterator around it.
    """

    __slots__ = ()

    async def read_raw(self) -> bytes:
        """The next raw chunk, ``b""`` at the end; a broken body raises httpx's error."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


async def read_body(response: httpx.Response, *, keep: int, limit: int) -> Body:
    """Read ``response`` (opened with ``stream=True``) up to ``limit`` decoded bytes.

    Raises ``httpx.DecodingError`` for a corrupt encoding (as httpx does), and the
    transport's errors for a connection that breaks mid-body, as httpx would. A body read
    to its end leaves the response closed, as ``Response.aiter_raw`` does.
    """
    stream = response.stream
    direct: RawStream | None = (
        stream if isinstance(stream, RawStream) and not response.is_stream_consumed
        and not response.is_closed else None
    )  # fmt: skip
    if direct is not None:
        # What aiter_raw does around the stream: consumed, bytes counted, closed at the end.
        _httpx_fast.start_raw_read(response)
        loaded = None
        next_raw: Callable[[], Awaitable[bytes]] = direct.read_raw
    else:
        loaded = _loaded(response)
        chunks = _raw_chunks(response, loaded)
        next_raw = _next_or_empty(chunks)
    decoders = _decoders(response) if loaded is None else []
    digest = hashlib.sha256()
    head = bytearray()
    size = 0
    unyielded = 0
    while raw := await next_raw():
        if direct is not None:
            _httpx_fast.count_downloaded(response, len(raw))
        for piece in _decode(decoders, raw) if decoders else (raw,):
            take = piece[: limit - size + 1] if size + len(piece) > limit else piece
            size += len(take)
            if len(head) < keep:
                head += take[: keep - len(head)]
            if size > limit:
                # Stop: the body is over the limit; ``size`` is a lower bound of it.
                return Body(head=bytes(head), size=size, sha256=None, complete=False)
            digest.update(take)
            unyielded += len(take)
            if decoders or unyielded >= _STEP:
                # Inflating and hashing are CPU work on the event loop: let the deadline
                # and others run.
                unyielded = 0
                await asyncio.sleep(0)
    if direct is not None:
        # Response.aclose without its request context (the stream raises no httpx error
        # there): at the end, the connection goes back to the pool.
        response.is_closed = True
        await direct.aclose()
    return Body(head=bytes(head), size=size, sha256=digest.hexdigest(), complete=True)


def _loaded(response: httpx.Response) -> bytes | None:
    """The body already in memory (a transport that builds responses from bytes, such as
    httpx.MockTransport: httpx decoded it), else None."""
    import httpx  # off the command line's start-up path (config imports this module)

    try:
        return response.content
    except httpx.ResponseNotRead:
        return None


def _next_or_empty(chunks: AsyncIterator[bytes]) -> Callable[[], Awaitable[bytes]]:
    """``chunks``' next chunk, ``b""`` at its end (it yields no empty chunk)."""
    return functools.partial(anext, chunks, b"")


async def _raw_chunks(response: httpx.Response, loaded: bytes | None) -> AsyncIterator[bytes]:
    if loaded is None:
        async for raw in response.aiter_raw():
            if raw:
                yield raw
        return
    for i in range(0, len(loaded), _STEP):
        yield loaded[i : i + _STEP]
