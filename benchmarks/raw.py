"""Raw HTTP clients on the same job as the dispatcher: N POSTs with fresh keys, C at once.

Each request carries what the dispatcher sends (Idempotency-Key, X-Request-ID, a JSON
body) to the same receiver, so every one of them is a new receipt and a new effect.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from benchmarks.common import endpoint, payload

Sender = Callable[[int], Awaitable[int]]


async def _drive(n: int, concurrency: int, send: Sender) -> tuple[float, int]:
    """Run ``send(i)`` for i in 0..n-1 with ``concurrency`` workers; (seconds, non-2xx)."""
    next_i = 0
    bad = 0

    async def worker() -> None:
        nonlocal next_i, bad
        while next_i < n:
            i = next_i
            next_i += 1
            status = await send(i)
            if not 200 <= status < 300:
                bad += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return time.perf_counter() - start, bad


def _headers(prefix: str, i: int) -> dict[str, str]:
    return {
        "Idempotency-Key": f"{prefix}{i}",
        "X-Request-ID": str(uuid.uuid4()),
        "Content-Type": "application/json",
    }


async def raw_aiohttp(url: str, n: int, concurrency: int, prefix: str) -> tuple[float, int]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def send(i: int) -> int:
            body = json.dumps(payload(i), separators=(",", ":")).encode()
            async with session.post("/orders", data=body, headers=_headers(prefix, i)) as resp:
                await resp.read()
                return resp.status

        return await _drive(n, concurrency, send)


async def raw_httpx(
    url: str,
    n: int,
    concurrency: int,
    prefix: str,
    transport_factory: Callable[[Any], httpx.AsyncBaseTransport | None] | None,
) -> tuple[float, int]:
    """httpx.AsyncClient built exactly as the dispatcher builds it, on the given transport."""
    from outbox.wire.transport import build_client

    ep = endpoint(url, concurrency=concurrency)
    transport = transport_factory(ep) if transport_factory is not None else None
    client = build_client(ep, transport)
    async with client:

        async def send(i: int) -> int:
            body = json.dumps(payload(i), separators=(",", ":")).encode()
            resp = await client.post("/orders", content=body, headers=_headers(prefix, i))
            return resp.status_code

        return await _drive(n, concurrency, send)


def run_raw(kind: str, url: str, n: int, concurrency: int, transport: Any = None) -> float:
    """ops/s of one raw client run (fresh keys every time)."""
    prefix = f"raw-{kind}-{uuid.uuid4().hex[:8]}-"
    if kind == "aiohttp":
        seconds, bad = asyncio.run(raw_aiohttp(url, n, concurrency, prefix))
    else:
        seconds, bad = asyncio.run(raw_httpx(url, n, concurrency, prefix, transport))
    if bad:
        raise RuntimeError(f"{kind}: {bad} of {n} requests were not 2xx")
    return n / seconds
