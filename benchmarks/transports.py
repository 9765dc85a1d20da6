"""The transport candidates under httpx's API, as ``transport_factory(endpoint)`` callables.

* ``httpx_default``: httpx's own async pool (httpcore), retries off, limits sized to the
  endpoint: what outbox used before ``aiohttp_outbox`` was chosen.
* ``aiohttp_stock``: httpx-aiohttp's ``AiohttpTransport()`` as it comes.
* ``aiohttp_safe``: the same transport over an aiohttp session built for the outbox: a
  connector sized to the endpoint, and aiohttp's silent one-shot resend of PUT/DELETE on a
  dropped keep-alive connection switched off (the outbox's rule: the transport never
  retries on its own; every resend is a recorded attempt with a fresh request ID).
* ``aiohttp_outbox``: ``outbox.wire.transport.AiohttpTransport``, the default the library ships
  (chosen by these measurements): a small transport over an aiohttp session built the same
  way as ``aiohttp_safe``, without httpx-aiohttp's two other surprises: its exception
  mapping names a refused connection ``ConnectTimeout`` and a dropped one
  ``ConnectTimeout`` too (the attempt log's error class would mislead an operator), and
  it hands aiohttp the URL as a string, which yarl re-quotes (``/x%27`` goes on the wire
  as ``/x'``). This one maps each aiohttp error to the httpx class httpx's own transport
  raises (the aiohttp exception stays the ``__cause__``, which classification reads) and
  sends the URL exactly as httpx built it.
* ``threads``: a pool of threads, each sending with httpx's sync transport.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

TransportFactory = Callable[[Any], httpx.AsyncBaseTransport | None]


def _limits(endpoint: Any) -> httpx.Limits:
    n = int(getattr(endpoint, "max_connections", 100))
    return httpx.Limits(max_connections=n, max_keepalive_connections=n)


def httpx_default(endpoint: Any) -> httpx.AsyncBaseTransport:
    return httpx.AsyncHTTPTransport(retries=0, limits=_limits(endpoint))


def aiohttp_stock(endpoint: Any) -> httpx.AsyncBaseTransport:
    from httpx_aiohttp import AiohttpTransport

    return AiohttpTransport(limits=_limits(endpoint))


def _safe_session(max_connections: int) -> Any:
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=max_connections,
        limit_per_host=max_connections,
        keepalive_timeout=5.0,
        enable_cleanup_closed=False,
    )
    session = aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        auto_decompress=False,
        cookie_jar=aiohttp.DummyCookieJar(),
    )
    # aiohttp resends a PUT or DELETE once, silently, when a reused keep-alive connection
    # turns out dead (ServerDisconnectedError / ClientOSError). The request may have
    # arrived; a resend must be a new attempt with a new request ID, in the log.
    session._retry_connection = False
    return session


def aiohttp_safe(endpoint: Any) -> httpx.AsyncBaseTransport:
    from httpx_aiohttp import AiohttpTransport

    n = int(getattr(endpoint, "max_connections", 100))
    return AiohttpTransport(limits=_limits(endpoint), client=lambda: _safe_session(n))


def aiohttp_outbox(endpoint: Any) -> httpx.AsyncBaseTransport:
    """The transport outbox ships (measured here as a candidate before it was chosen)."""
    from outbox.wire.transport import AiohttpTransport

    return AiohttpTransport(int(getattr(endpoint, "max_connections", 100)))


class ThreadPoolTransport(httpx.AsyncBaseTransport):
    """Sends each request with httpx's sync transport on a pool of threads.

    The whole response is read in the thread. Cancelling the awaiting task does not
    stop the thread (the request runs to its own timeout): a benchmark candidate only.
    """

    def __init__(self, limits: httpx.Limits, workers: int) -> None:
        self._transport = httpx.HTTPTransport(retries=0, limits=limits)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="httpx-sync")
        self._lock = threading.Lock()

    def _send(self, request: httpx.Request) -> httpx.Response:
        response = self._transport.handle_request(request)
        try:
            content = response.read()
        finally:
            response.close()
        return httpx.Response(
            status_code=response.status_code,
            headers=response.headers,
            content=content,
            request=request,
            extensions=response.extensions,
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        sync_request = httpx.Request(
            request.method,
            request.url,
            headers=request.headers,
            content=body,
            extensions=request.extensions,
        )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._send, sync_request)

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False)
        self._transport.close()


def threads(endpoint: Any) -> httpx.AsyncBaseTransport:
    n = int(getattr(endpoint, "max_connections", 100))
    return ThreadPoolTransport(_limits(endpoint), workers=n)


CANDIDATES: dict[str, TransportFactory] = {
    "httpx_default": httpx_default,
    "aiohttp_stock": aiohttp_stock,
    "aiohttp_safe": aiohttp_safe,
    "aiohttp_outbox": aiohttp_outbox,
    "threads": threads,
}

#: The modules each candidate needs beyond httpx.
NEEDS: dict[str, tuple[str, ...]] = {
    "aiohttp_stock": ("aiohttp", "httpx_aiohttp"),
    "aiohttp_safe": ("aiohttp", "httpx_aiohttp"),
    "aiohttp_outbox": ("aiohttp",),
}


def missing(name: str) -> str | None:
    """Why a candidate cannot run here, or None."""
    import importlib.util

    for module in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed"
    return None


#: The transport these benchmarks run the dispatcher on, and recommend shipping.
RECOMMENDED = "aiohttp_outbox"
