"""Sending one attempt over httpx and classifying what came back.

Classification decides two things: the verdict (success, retry, failed, ...) and what
is known about delivery (sent, not sent, unknown). Getting the second one wrong in the
unsafe direction, calling "not sent" what may have arrived, is how duplicates happen,
so every doubt resolves to "unknown".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx

from outbox import sending
from outbox.config import Endpoint
from outbox.model import Delivery, Verdict
from outbox.policy import parse_retry_after
from outbox.store.records import StoredResult

#: Retry, spending an attempt: the receiver refused before doing work.
REFUSAL_STATUSES = frozenset({408, 425, 429, 503})
#: Retry, spending an attempt: the receiver (or a gateway) may have done the work.
MAYBE_APPLIED_STATUSES = frozenset({500, 502, 504})
#: The IETF Idempotency-Key draft's "a request with this key is still being processed".
IN_PROGRESS_STATUS = 409
#: Bytes hashed at most from one response body; the rest is not read.
_MAX_BODY_READ = 64 * 1024 * 1024
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict on one attempt, and what it says about delivery."""

    verdict: Verdict
    delivery: Delivery
    #: The receiver may have applied the operation (feeds the reconciliation reason).
    maybe_applied: bool = False
    #: The receiver refused before doing any work (503, 429, ...).
    refused: bool = False
    retry_after_seconds: float | None = None


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """Everything observed about one attempt."""

    classification: Classification
    status_code: int | None
    receiver_request_id: str | None
    error_class: str | None
    error_message: str | None
    duration_ms: int
    result: StoredResult | None


def is_key_mismatch(response: httpx.Response, body: bytes) -> bool:
    """Does a 422 say the key is bound to a different payload?

    Recognised: an ``error``, ``code`` or ``type`` field mentioning the idempotency key
    (``idempotency_key_reused``, ``idempotency_key_mismatch``, ...).
    """
    try:
        data = json.loads(body)
    except ValueError:
        return False
    if not isinstance(data, dict):
        return False
    for field in ("error", "code", "type"):
        value = data.get(field)
        if isinstance(value, dict):
            value = value.get("code") or value.get("type")
        if isinstance(value, str) and "idempotency" in value.lower():
            return True
    return False


def classify_response(response: httpx.Response, body: bytes, now_ms: int) -> Classification:
    status = response.status_code
    if 200 <= status < 300:
        return Classification(Verdict.SUCCESS, Delivery.SENT, maybe_applied=True)
    retry_after = parse_retry_after(response.headers.get("retry-after"), now_ms)
    if status == IN_PROGRESS_STATUS:
        # The receiver holds the key: an earlier attempt reached it.
        return Classification(
            Verdict.IN_PROGRESS, Delivery.SENT, maybe_applied=True, retry_after_seconds=retry_after
        )
    if status in REFUSAL_STATUSES:
        return Classification(
            Verdict.RETRY, Delivery.SENT, refused=True, retry_after_seconds=retry_after
        )
    if status in MAYBE_APPLIED_STATUSES:
        return Classification(
            Verdict.RETRY, Delivery.SENT, maybe_applied=True, retry_after_seconds=retry_after
        )
    if status == 422 and is_key_mismatch(response, body):
        return Classification(Verdict.KEY_CONFLICT, Delivery.SENT)
    if status >= 500:
        return Classification(
            Verdict.RETRY, Delivery.SENT, maybe_applied=True, retry_after_seconds=retry_after
        )
    # Other 4xx, and 1xx/3xx (redirects are never followed): definitive.
    return Classification(Verdict.FAILED, Delivery.SENT)


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
    if _connect_failed(exc):
        return Classification(Verdict.RETRY, Delivery.NOT_SENT)
    return Classification(Verdict.RETRY, Delivery.UNKNOWN, maybe_applied=True)


def clean_message(text: str, limit: int = 500) -> str:
    """An error message safe to store and log: no control characters, bounded."""
    return _CONTROL.sub("?", text.replace("\n", " ").replace("\r", " "))[:limit]


def _evidence_headers(endpoint: Endpoint, response: httpx.Response) -> dict[str, str]:
    return {
        name: clean_message(response.headers[name], 200)
        for name in endpoint.evidence_headers
        if name in response.headers
    }


def _receiver_request_id(response: httpx.Response) -> str | None:
    for name in ("request-id", "x-receiver-request-id", "x-amzn-requestid", "x-request-id"):
        value = response.headers.get(name)
        if value:
            return clean_message(value, 255)
    return None


def _stored_result(endpoint: Endpoint, response: httpx.Response, body: bytes) -> StoredResult:
    digest = hashlib.sha256(body).hexdigest()
    kept = body[: endpoint.result_body_limit]
    truncated = len(kept) < len(body)
    stored: str | None = None
    if kept and not truncated:
        try:
            text = kept.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None:
            try:
                stored = json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
            except ValueError:
                stored = json.dumps(text)
    elif kept:
        stored = json.dumps(kept.decode("utf-8", errors="replace"))
    return StoredResult(
        status=response.status_code,
        headers_json=json.dumps(_evidence_headers(endpoint, response), sort_keys=True),
        body=stored,
        sha256=digest,
        size=len(body),
        truncated=truncated,
    )


async def _read_body(response: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > _MAX_BODY_READ:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _redact_credentials(body: bytes, sent: httpx.Headers) -> bytes:
    """A receiver may echo request headers: never keep the credentials it echoes."""
    from outbox.canonical import CREDENTIAL_HEADERS

    for name, value in sent.items():
        if name.lower() not in CREDENTIAL_HEADERS:
            continue
        for secret in {value, value.partition(" ")[2]}:
            if len(secret) >= 8:
                body = body.replace(secret.encode(), b"[REDACTED]")
    return body


def _stays_home(client: httpx.AsyncClient, request: httpx.Request, path: str) -> bool:
    base = client.base_url
    return (
        path.startswith("/")
        and not path.startswith("//")
        and "\\" not in path
        and (request.url.scheme, request.url.netloc) == (base.scheme, base.netloc)
    )


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError | None:
    """The httpx error httpx's own transport raises for this aiohttp error, if any.

    The aiohttp exception stays the ``__cause__``: classification reads the cause chain.
    """
    import aiohttp

    message = str(exc) or type(exc).__name__
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)  # nothing was sent
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.SocketTimeoutError | aiohttp.ServerTimeoutError):
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    if isinstance(exc, aiohttp.ClientError | OSError):
        return httpx.ReadError(message, request=request)
    return None


class _AiohttpStream(httpx.AsyncByteStream):
    def __init__(self, response: Any, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_chunked(64 * 1024):
                yield chunk
        except Exception as exc:
            mapped = _httpx_error(exc, self._request)
            if mapped is None:
                raise
            raise mapped from exc

    async def aclose(self) -> None:
        self._response.release()


class AiohttpTransport(httpx.AsyncBaseTransport):
    """httpx's API over one pooled aiohttp session: the default transport.

    At 64 concurrent requests it moves several times the requests per second of httpx's
    own async pool, whose cost per request grows with the number of connections (see
    benchmarks/). It never resends on its own (aiohttp repeats a PUT or DELETE once when
    a connection drops; that is switched off), sends the URL exactly as httpx built it
    (no re-quoting), and raises the httpx error httpx's own transport would, with the
    aiohttp error as its cause.
    """

    def __init__(self, max_connections: int = 100, *, ssl: Any = True) -> None:
        self._max = max_connections
        self._ssl = ssl
        self._session: Any = None

    def _new_session(self) -> Any:
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max, limit_per_host=self._max),
            trust_env=False,
            auto_decompress=False,  # httpx decodes the body
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        session._retry_connection = False  # no silent resend of PUT/DELETE
        return session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        import aiohttp
        from yarl import URL

        if self._session is None:
            self._session = self._new_session()
        timeout = request.extensions.get("timeout", {})
        body = await request.aread()
        try:
            response = await self._session.request(
                request.method,
                URL(str(request.url), encoded=True),
                headers=request.headers,
                data=body or None,
                allow_redirects=False,
                compress=None,
                ssl=self._ssl,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    sock_connect=timeout.get("connect"),
                    sock_read=timeout.get("read"),
                ),
            )
        except Exception as exc:
            mapped = _httpx_error(exc, request)
            if mapped is None:
                raise
            raise mapped from exc
        return httpx.Response(
            status_code=response.status,
            headers=response.raw_headers,
            stream=_AiohttpStream(response, request),
            request=request,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (response.reason or "").encode(),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def aiohttp_transport(endpoint: Endpoint) -> httpx.AsyncBaseTransport:
    return AiohttpTransport(endpoint.max_connections)


def default_transport(endpoint: Endpoint) -> httpx.AsyncBaseTransport:
    """The aiohttp-backed transport when aiohttp is installed, else httpx's own."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        n = endpoint.max_connections
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        return httpx.AsyncHTTPTransport(retries=0, limits=limits)
    return aiohttp_transport(endpoint)


def build_client(
    endpoint: Endpoint, transport: httpx.AsyncBaseTransport | None
) -> httpx.AsyncClient:
    """One pooled client per endpoint. The transport never retries on its own."""
    if transport is None:
        transport = default_transport(endpoint)
    auth = endpoint.auth if isinstance(endpoint.auth, httpx.Auth) else None
    return httpx.AsyncClient(
        base_url=endpoint.base_url,
        transport=transport,
        timeout=httpx.Timeout(endpoint.timeout),
        follow_redirects=False,
        auth=auth,
        trust_env=False,
        # No cookies, ever: a request carries only what the operation and the endpoint
        # define, whatever an earlier response set.
        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
    )


def request_headers(
    endpoint: Endpoint,
    *,
    stored_headers: Mapping[str, str],
    operation_id: str,
    request_id: str,
    tenant: str,
    has_body: bool,
) -> dict[str, str]:
    # Case-insensitive, and the identity headers are set last: neither stored headers
    # nor an auth callable can replace the key or the request ID in the attempt log.
    headers = httpx.Headers(endpoint.headers)
    headers.update(stored_headers)
    if endpoint.auth is not None and not isinstance(endpoint.auth, httpx.Auth):
        headers.update(endpoint.auth())
    if has_body:
        headers.setdefault("content-type", "application/json")
    headers[endpoint.idempotency_header] = operation_id
    headers[endpoint.request_id_header] = request_id
    if endpoint.tenant_header is not None:
        headers[endpoint.tenant_header] = tenant
    return dict(headers.multi_items())


async def send_attempt(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    *,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None,
    now_ms: Any,
) -> AttemptResult:
    """Send one attempt under a total deadline and classify the result.

    ``now_ms`` is a callable giving the clock's time (for Retry-After dates).
    """
    started = time.monotonic()
    response: httpx.Response | None = None
    try:
        async with asyncio.timeout(endpoint.timeout):
            request = sending.build_request(client, method, path, headers=headers, content=body)
            if not _stays_home(client, request, path):
                # A stored path is relative to the registered base URL, always: a tampered
                # row must not aim the dispatcher, and the endpoint's credentials, elsewhere.
                return AttemptResult(
                    classification=Classification(Verdict.FAILED, Delivery.NOT_SENT),
                    status_code=None,
                    receiver_request_id=None,
                    error_class="UnsafePath",
                    error_message="not sent: the stored path leaves the endpoint's base URL",
                    duration_ms=0,
                    result=None,
                )
            response = await sending.send(client, request)
            try:
                raw = await _read_body(response)
            finally:
                await response.aclose()
    except Exception as exc:
        override = endpoint.classify(exc) if endpoint.classify else None
        classification = override or classify_exception(exc)
        if isinstance(exc, TimeoutError) and response is not None:
            classification = Classification(Verdict.RETRY, Delivery.UNKNOWN, maybe_applied=True)
        return AttemptResult(
            classification=classification,
            status_code=response.status_code if response is not None else None,
            receiver_request_id=None,
            error_class=type(exc).__name__
            if not isinstance(exc, TimeoutError)
            else "AttemptDeadlineExceeded",
            error_message=clean_message(str(exc) or repr(exc))
            if not isinstance(exc, TimeoutError)
            else f"no complete response within the attempt deadline of {endpoint.timeout}s",
            duration_ms=int((time.monotonic() - started) * 1000),
            result=None,
        )
    raw = _redact_credentials(raw, response.request.headers)
    override = endpoint.classify(response) if endpoint.classify else None
    classification = override or classify_response(response, raw, now_ms())
    keep = classification.verdict in (Verdict.SUCCESS, Verdict.FAILED, Verdict.KEY_CONFLICT)
    return AttemptResult(
        classification=classification,
        status_code=response.status_code,
        receiver_request_id=_receiver_request_id(response),
        error_class=None,
        error_message=None
        if classification.verdict is Verdict.SUCCESS
        else clean_message(raw[:300].decode("utf-8", errors="replace")),
        duration_ms=int((time.monotonic() - started) * 1000),
        result=_stored_result(endpoint, response, raw) if keep else None,
    )
