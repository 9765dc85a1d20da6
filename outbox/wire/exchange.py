"""One HTTP exchange: send one request, read its answer in bounded memory, under a deadline.

Attempts (:func:`outbox.wire.transport.send_attempt`), status lookups
(:func:`outbox.wire.lookup.lookup_status`) and the conformance checker's probes all send
through :func:`exchange`, so they share one way of

* building and sending the request (:mod:`outbox.wire._httpx_fast`: straight to the client's
  transport when the client has no auth, hooks or cookies, else ``client.send``);
* reading the body (:func:`outbox.wire.body.read_body`: decoded, bounded, hashed);
* bounding the time (one ``asyncio.timeout`` around build, send and read, so a receiver
  dripping one byte at a time still hits the deadline);
* naming what went wrong (:attr:`Exchange.error_class`) and what it proves about
  delivery (:func:`classify_exception`: only a provable connect failure is "not sent").

It never raises for what the network or the receiver does: the error is part of the
:class:`Exchange`. What the answer *means* is the caller's business.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass

import httpx

from outbox.canonical import leaves_base
from outbox.classify import Classification
from outbox.model import Delivery, ErrorClass, Verdict
from outbox.wire import _httpx_fast as sending
from outbox.wire.body import Body, read_body

__all__ = ["Exchange", "classify_exception", "clean_message", "exchange"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
#: Response headers that describe the body's framing, not its content.
_FRAMING = ("content-encoding", "content-length", "transfer-encoding")


def clean_message(text: str, limit: int = 500) -> str:
    """An error message safe to store and log: no control characters, bounded."""
    return _CONTROL.sub("?", text.replace("\n", " ").replace("\r", " "))[:limit]


def _causes(exc: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _connect_failed(exc: BaseException) -> bool:
    """True only when the request provably never left: no connection was made."""
    for cause in _causes(exc):
        name = type(cause).__name__
        module = type(cause).__module__
        if module.startswith("aiohttp"):
            # aiohttp's connection errors cover both "could not connect" and "server
            # disconnected after the request was sent"; httpx-aiohttp maps both to one
            # httpx class. Only the connector's own error proves nothing was sent.
            return name in (
                "ClientConnectorError",
                "ClientConnectorDNSError",
                "ClientConnectorCertificateError",
                "ClientConnectorSSLError",
            )
    return isinstance(
        exc,
        httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | httpx.UnsupportedProtocol,
    )


def classify_exception(exc: BaseException) -> Classification:
    """What an exchange that raised ``exc`` proves: "not sent" only for a connect failure."""
    if _connect_failed(exc):
        return Classification(Verdict.RETRY, Delivery.NOT_SENT)
    return Classification(Verdict.RETRY, Delivery.UNKNOWN, maybe_applied=True)


def _stays_home(client: httpx.AsyncClient, request: httpx.Request, path: str) -> bool:
    """The request goes to the client's scheme and host, under its base path (checked
    again at send: a tampered row must not climb out with ``..`` or ``%2e%2e``)."""
    base = client.base_url
    base_path = base.raw_path.split(b"?", 1)[0].rstrip(b"/") + b"/"
    return (
        path.startswith("/")
        and not path.startswith("//")
        and "\\" not in path
        and not leaves_base(path)
        and (request.url.scheme, request.url.netloc) == (base.scheme, base.netloc)
        and request.url.raw_path.startswith(base_path)
    )


@dataclass(frozen=True, slots=True)
class Exchange:
    """What one request observed. Exactly one of ``body`` and ``error`` is set, unless
    the request was ``refused`` (then neither: nothing was sent)."""

    #: The request as built (and sent, unless refused); None if it could not be built.
    request: httpx.Request | None
    #: The status line and headers, when they arrived (also when the body then failed).
    #: Its body is read and the response closed: use :attr:`body`.
    response: httpx.Response | None
    #: The body as read (decoded, bounded), when reading finished.
    body: Body | None
    #: What stopped the exchange: the transport's error, a corrupt encoding, or
    #: ``TimeoutError`` when the deadline fired.
    error: Exception | None
    #: The deadline the exchange ran under, in seconds.
    deadline_seconds: float
    #: Milliseconds from building the request to the end of the read (or the error).
    elapsed_ms: int
    #: Not sent: the path would leave the client's base URL (``home_only``).
    refused: bool = False
    #: Not sent: the request failed before its first byte could be written (building
    #: it raised: an auth callable, a header the transport cannot encode, ...).
    unsent: bool = False

    @property
    def status(self) -> int | None:
        return self.response.status_code if self.response is not None else None

    @property
    def headers(self) -> httpx.Headers | None:
        return self.response.headers if self.response is not None else None

    @property
    def timed_out(self) -> bool:
        """The deadline fired before the body was read to its end (or to the limit)."""
        return isinstance(self.error, TimeoutError)

    @property
    def error_class(self) -> str | None:
        """The error class an attempt records: the library's own for a refused path and
        a missed deadline, else the exception's class name."""
        if self.refused:
            return ErrorClass.UNSAFE_PATH.value
        if self.error is None:
            return None
        if self.timed_out:
            return ErrorClass.ATTEMPT_DEADLINE_EXCEEDED.value
        return type(self.error).__name__

    def error_text(self) -> str:
        """``"<ExceptionClass>: <message>"``, safe to store."""
        return clean_message(f"{type(self.error).__name__}: {self.error}")

    def error_classification(self, override: Classification | None = None) -> Classification:
        """What the error proves about delivery. ``override``: an endpoint classifier's
        answer for the exception. A deadline that fired after the status line arrived
        is "unknown" whatever anyone says: the request was sent."""
        assert self.error is not None
        if self.unsent:
            return Classification(Verdict.RETRY, Delivery.NOT_SENT)
        classification = override or classify_exception(self.error)
        if self.timed_out and self.response is not None:
            return Classification(Verdict.RETRY, Delivery.UNKNOWN, maybe_applied=True)
        return classification

    def readable(self, content: bytes) -> httpx.Response:
        """A response holding ``content`` (the bounded body, already decoded) for a
        classifier: same status, headers (less the framing ones), request, extensions."""
        assert self.response is not None
        response = self.response
        headers = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in _FRAMING]
        return httpx.Response(
            response.status_code,
            headers=headers,
            content=content,
            request=response.request,
            extensions=response.extensions,
        )


async def exchange(
    client: httpx.AsyncClient,
    method: str,
    path: str,
    *,
    headers: dict[str, str],
    content: bytes | None,
    deadline_seconds: float,
    keep: int,
    limit: int,
    home_only: bool = False,
) -> Exchange:
    """Send one request through ``client`` and read its answer, within ``deadline_seconds``.

    ``keep``: body bytes held in memory; ``limit``: decoded bytes read at most (past it
    the body is recorded as "at least", see :class:`outbox.wire.body.Body`). ``home_only``:
    refuse, unsent, a ``path`` that would leave the client's base URL (a stored path is
    relative to the registered base URL, always: a tampered row must not aim the
    request, and the endpoint's credentials, elsewhere). Never raises for what the
    network or the receiver does.
    """
    started = time.monotonic()
    request: httpx.Request | None = None
    response: httpx.Response | None = None
    sending_started = False
    try:
        async with asyncio.timeout(deadline_seconds):
            request = sending.build_request(client, method, path, headers=headers, content=content)
            if home_only and not _stays_home(client, request, path):
                return Exchange(request, None, None, None, deadline_seconds, 0, refused=True)
            sending_started = True
            response = await sending.send(client, request)
            try:
                body = await read_body(response, keep=keep, limit=limit)
            finally:
                await response.aclose()
    except Exception as exc:
        elapsed_ms = int((time.monotonic() - started) * 1000)
        return Exchange(request, response, None, exc, deadline_seconds, elapsed_ms,
                        unsent=not sending_started)  # fmt: skip
    elapsed_ms = int((time.monotonic() - started) * 1000)
    return Exchange(request, response, body, None, deadline_seconds, elapsed_ms)
