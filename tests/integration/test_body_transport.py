"""Response bodies read through the shipped transport over 127.0.0.1, as httpx would read them.

``outbox.wire.body.read_body`` reads the shipped ``AiohttpTransport``'s stream directly
(without ``Response.aiter_raw``) when the response reaches it unwrapped. Whatever the
path, the outcome is httpx's: the same error class with the aiohttp error as its cause
for a body cut mid-stream, the same ``Response`` state, the connection back to the pool
only after a body read to its end, a bomb bounded, and the deadline firing mid-inflate.
The httpx path is taken by a client with an event hook (``client.send``).
"""

from __future__ import annotations

import asyncio
import gzip
import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import httpx
import pytest

from outbox.config import Endpoint
from outbox.model import Delivery
from outbox.wire.exchange import Exchange, exchange
from outbox.wire.transport import build_client
from tests.faults.hostile import hostile_receiver

SMALL = b'{"ok": true, "n": 1}'
GZIPPED = gzip.compress(SMALL * 100)
BIG = b"z" * (256 * 1024)


class _Handler(socketserver.BaseRequestHandler):
    """Keep-alive HTTP/1.1: ``/ok``, ``/gzip``, ``/big`` (256 KiB), ``/cut`` (100 of the
    1000 bytes announced, then the connection closes). Counts connections."""

    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        with self.server.lock:
            self.server.connections += 1
        data = b""
        with suppress(OSError):
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = sock.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                path = head.split(b" ")[1].decode()
                if path == "/cut":
                    sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"c" * 100)
                    return
                body, extra = {
                    "/ok": (SMALL, b""),
                    "/gzip": (GZIPPED, b"Content-Encoding: gzip\r\n"),
                    "/big": (BIG, b""),
                }[path]
                sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra)
                             + body)  # fmt: skip


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.lock = threading.Lock()


@pytest.fixture
def server() -> Iterator[tuple[str, _Server]]:
    srv = _Server()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", srv
    finally:
        srv.shutdown()
        srv.server_close()


async def _noop_hook(response: httpx.Response) -> None:
    pass


def _client(url: str, via_httpx: bool) -> httpx.AsyncClient:
    client = build_client(Endpoint(name="rx", base_url=url, timeout=5.0), None)
    if via_httpx:
        client.event_hooks = {"request": [], "response": [_noop_hook]}
    return client


async def _get(client: httpx.AsyncClient, path: str, **options: Any) -> Exchange:
    kwargs: dict[str, Any] = {"deadline_seconds": 5.0, "keep": 64, "limit": 1024, **options}
    return await exchange(client, "GET", path, headers={}, content=None, **kwargs)


def _state(ex: Exchange) -> tuple[bool, bool, int]:
    assert ex.response is not None
    r = ex.response
    return (r.is_stream_consumed, r.is_closed, r.num_bytes_downloaded)


@pytest.mark.parametrize("via_httpx", [False, True], ids=["direct", "httpx"])
def test_a_body_read_to_its_end_returns_the_connection_and_one_cut_short_does_not(
    server: tuple[str, _Server], via_httpx: bool
) -> None:
    url, srv = server

    async def go() -> list[tuple[Exchange, int]]:
        async with _client(url, via_httpx) as client:
            return [(await _get(client, path), srv.connections)
                    for path in ("/ok", "/ok", "/big", "/ok", "/ok")]  # fmt: skip

    (ok, _), (again, _), (big, before), (after, _), (_, last) = asyncio.run(go())
    assert ok.body is not None and (ok.body.head, ok.body.complete) == (SMALL, True)
    assert _state(ok) == _state(again) == (True, True, len(SMALL))
    assert big.body is not None and (big.body.complete, big.body.size) == (False, 1024 + 1)
    assert after.body is not None and after.body.complete
    # A connection whose body was read to its end is reused; one left with unread body
    # (stopped at the limit) is closed, never reused.
    assert (before, last) == (1, 2)


def test_both_paths_leave_the_same_response_state(server: tuple[str, _Server]) -> None:
    url, _ = server

    async def go(via_httpx: bool) -> list[tuple[bool, bool, int]]:
        async with _client(url, via_httpx) as client:
            paths = ("/ok", "/gzip", "/big")
            return [_state(await _get(client, path, limit=10**6)) for path in paths]

    direct, through_httpx = asyncio.run(go(False)), asyncio.run(go(True))
    assert direct == through_httpx
    assert direct == [(True, True, len(SMALL)), (True, True, len(GZIPPED)), (True, True, len(BIG))]


def test_a_body_cut_mid_stream_is_httpx_error_with_the_aiohttp_cause(
    server: tuple[str, _Server],
) -> None:
    import aiohttp

    url, _ = server

    async def go(via_httpx: bool) -> Exchange:
        async with _client(url, via_httpx) as client:
            return await _get(client, "/cut")

    seen = []
    for via_httpx in (False, True):
        ex = asyncio.run(go(via_httpx))
        assert ex.status == 200 and ex.body is None and not ex.timed_out
        assert isinstance(ex.error, httpx.RemoteProtocolError), ex.error
        assert isinstance(ex.error.__cause__, aiohttp.ClientPayloadError)
        assert ex.error_classification().delivery is Delivery.UNKNOWN
        assert _state(ex)[:2] == (True, True)
        seen.append((ex.error_class, str(ex.error), type(ex.error.__cause__)))
    assert seen[0] == seen[1]


def test_a_bomb_through_the_shipped_transport_is_bounded_and_the_deadline_fires() -> None:
    async def go(url: str, limit: int, deadline: float) -> tuple[Exchange, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        async with _client(url, False) as client:
            task = asyncio.create_task(ticker())
            ex = await _get(client, "/bomb", limit=limit, deadline_seconds=deadline)
            task.cancel()
        return ex, ticks

    with hostile_receiver() as (url, _):
        bounded, _ = asyncio.run(go(url, 1024 * 1024, 5.0))
        # 256 MiB of zeros, never inflated past the limit.
        assert bounded.body is not None and bounded.body.size == 1024 * 1024 + 1
        assert not bounded.body.complete
        # Allowed to inflate all of it: the deadline stops it, the loop was never hogged.
        stopped, ticks = asyncio.run(go(url, 10**9, 0.2))
        assert stopped.timed_out and stopped.status == 200 and stopped.body is None
        assert ticks >= 10
