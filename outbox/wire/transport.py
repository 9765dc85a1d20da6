"""Sending one attempt over httpx and classifying what came back.

Classification decides two things: the verdict (success, retry, failed, ...) and what
is known about delivery (sent, not sent, unknown). Getting the second one wrong in the
unsafe direction, calling "not sent" what may have arrived, is how duplicates happen,
so every doubt resolves to "unknown".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx

from outbox.canonical import canonical_json_text
from outbox.classify import (
    IN_PROGRESS_STATUS,
    MAYBE_APPLIED_STATUSES,
    REFUSAL_STATUSES,
    Classification,
    classify_response,
    declared_retention,
    is_key_mismatch,
    replay_marker,
)
from outbox.config import Endpoint
from outbox.model import Delivery, ErrorClass, Verdict
from outbox.store.records import StoredResult
from outbox.wire import _aiohttp
from outbox.wire.body import ACCEPT_ENCODING, Body, RawStream
from outbox.wire.exchange import classify_exception, clean_message, exchange
from outbox.wire.redact import Redactor, request_redactor

#: Bytes of a non-success body kept in the attempt's error message.
_MESSAGE_BYTES = 300


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
    #: The key retention the answer declares (``classify.RETENTION_HEADER``), in ms.
    declared_retention_ms: int | None = None


class _ResponseHeaders:
    """``response.headers[name]`` (case-insensitive, repeated headers joined with ", ")
    for many names, from one pass over the headers instead of one per name."""

    __slots__ = ("_headers", "_joined")

    def __init__(self, headers: httpx.Headers) -> None:
        self._headers = headers
        # Headers.items(): the names lower-cased, the values of each joined, exactly
        # what Headers.__getitem__ gives for a name.
        self._joined = dict(headers.items())

    def get(self, name: str) -> str | None:
        if name.isascii():
            return self._joined.get(name.lower())
        value: str | None = self._headers.get(name)  # httpx's answer (or error) for the rest
        return value


def _evidence_headers(
    endpoint: Endpoint, headers: _ResponseHeaders, redactor: Redactor
) -> dict[str, str]:
    found = {}
    for name in endpoint.evidence_headers:
        value = headers.get(name)
        if value is not None:
            found[name] = clean_message(redactor.text(value), 200)
    return found


#: Response headers where receivers put their own request ID, in order of preference.
RECEIVER_REQUEST_ID_HEADERS = (
    "request-id",
    "x-receiver-request-id",
    "x-amzn-requestid",
    "x-amz-request-id",
    "x-request-id",
    "x-correlation-id",
)


def _receiver_request_id(
    headers: _ResponseHeaders, sent_request_id: str | None, redactor: Redactor
) -> str | None:
    """The receiver's own request ID as ``"header: value"``, or None.

    A header that only echoes the request ID we sent is ours, not the receiver's; one
    that echoes a credential is redacted.
    """
    for name in RECEIVER_REQUEST_ID_HEADERS:
        value = headers.get(name)
        if value and value != sent_request_id:
            return clean_message(f"{name}: {redactor.text(value)}", 255)
    return None


def _stored_result(
    endpoint: Endpoint,
    response: httpx.Response,
    body: Body,
    kept: bytes,
    redactor: Redactor,
    *,
    headers: _ResponseHeaders,
) -> StoredResult:
    """The evidence of a response. The body has one shape whatever its size: the parsed
    JSON (or the text) when it fits ``result_body_limit``, else None and ``truncated``.
    Size and SHA-256 cover the whole body when it was read to the end; past the
    endpoint's ``read_limit`` the size is a lower bound and there is no hash.
    ``kept``: the head of the body, credentials redacted."""
    truncated = body.truncated or body.size > endpoint.result_body_limit
    stored: str | None = None
    if kept and not truncated:
        try:
            text = kept.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None:
            stored = canonical_json_text(text)
            if stored is None:
                stored = json.dumps(text)
    return StoredResult(
        status=response.status_code,
        headers=_evidence_headers(endpoint, headers, redactor),
        body=stored,
        sha256=body.sha256,
        size=body.size,
        truncated=truncated,
    )


def _classifier_failed(exc: BaseException) -> tuple[Classification, str, str]:
    return (
        Classification(Verdict.RETRY, Delivery.UNKNOWN, maybe_applied=True),
        ErrorClass.CLASSIFIER_FAILED.value,
        clean_message(f"the endpoint's classifier raised {type(exc).__name__}: {exc}"),
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


#: Raw bytes read from aiohttp at most at a time.
_CHUNK = 64 * 1024


class _AiohttpStream(httpx.AsyncByteStream, RawStream):
    """The body as aiohttp reads it, in chunks of at most ``_CHUNK`` bytes, its errors
    mapped to httpx's. :func:`outbox.wire.body.read_body` calls :meth:`read_raw` directly;
    httpx (``Response.aread``, ``aiter_bytes``, ...) iterates."""

    def __init__(self, response: Any, request: httpx.Request) -> None:
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while chunk := await self.read_raw():
            yield chunk

    async def read_raw(self) -> bytes:
        content = self._response.content
        try:
            # What aiohttp's iter_chunked(_CHUNK) awaits for each chunk.
            chunk: bytes = await content.read(_CHUNK)
        except Exception as exc:
            import aiohttp

            if isinstance(exc, aiohttp.EofStream):
                return b""  # iter_chunked's end too
            mapped = _httpx_error(exc, self._request)
            if mapped is None:
                raise
            raise mapped from exc
        return chunk

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # back to the pool
        else:
            self._response.close()  # stopped early (limit, deadline): never reuse it


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
        return _aiohttp.without_silent_resend(session)  # no silent resend of PUT/DELETE

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
    """The aiohttp-backed transport (aiohttp is a dependency, pinned to its major)."""
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
        # Only what outbox.wire.body decodes, incrementally and bounded.
        headers={"accept-encoding": ACCEPT_ENCODING},
        transport=transport,
        timeout=httpx.Timeout(endpoint.timeout),
        follow_redirects=False,
        auth=auth,
        trust_env=False,
        # No cookies, ever: a request carries only what the operation and the endpoint
        # define, whatever an earlier response set.
        cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
    )


_UNCALLED: Any = object()


def request_headers(
    endpoint: Endpoint,
    *,
    stored_headers: Mapping[str, str],
    operation_id: str,
    request_id: str,
    tenant: str,
    has_body: bool,
) -> dict[str, str]:
    """The attempt's headers, names lower-cased: the endpoint's, the stored ones, the
    credentials, a JSON content type for a body, then the identity headers.

    Case-insensitive, and the identity headers are set last: neither stored headers
    nor an auth callable can replace the key or the request ID in the attempt log.
    Plain ASCII strings in dicts (always, in practice) are merged as ``httpx.Headers``
    would merge them (see :func:`_httpx_headers`, the definition), without building one.
    """
    auth = endpoint.auth if not isinstance(endpoint.auth, httpx.Auth) else None
    layers: list[Mapping[str, str]] = [endpoint.headers, stored_headers]
    plain = _plain(endpoint.headers) and _plain(stored_headers)
    # The credentials are asked for in the same order, and only when httpx would ask.
    auth_headers = tenant_headers = _UNCALLED
    if plain and auth is not None:
        auth_headers = auth()
        layers.append(auth_headers)
        plain = _plain(auth_headers)
    if plain and endpoint.tenant_auth is not None:
        tenant_headers = endpoint.tenant_auth(tenant)
        layers.append(tenant_headers)
        plain = _plain(tenant_headers)
    identity = [
        (endpoint.idempotency_header, endpoint.wire_key(tenant, operation_id)),
        (endpoint.request_id_header, request_id),
    ]
    if endpoint.tenant_header is not None:
        identity.append((endpoint.tenant_header, tenant))
    if not (plain and _ascii(identity)):
        return _httpx_headers(
            endpoint, stored_headers, auth_headers=auth_headers, tenant_headers=tenant_headers,
            tenant=tenant, identity=identity, has_body=has_body,
        )  # fmt: skip
    merged: dict[str, str] = {}
    for i, layer in enumerate(layers):
        if i:  # Headers.update: every name it carries is dropped, then all appended
            for name in layer:
                merged.pop(name.lower(), None)
        for name, value in layer.items():
            merged[name.lower()] = value
    if has_body and "content-type" not in merged:
        merged["content-type"] = "application/json"
    for name, value in identity:  # Headers.__setitem__: in place, or appended
        merged[name.lower()] = value
    return merged


def _plain(headers: Mapping[str, str]) -> bool:
    """A dict of ASCII strings (anything else goes through ``httpx.Headers``)."""
    return type(headers) is dict and _ascii(headers.items())


def _ascii(items: Iterable[tuple[str, str]]) -> bool:
    return all(
        type(name) is str and type(value) is str and name.isascii() and value.isascii()
        for name, value in items
    )


def _httpx_headers(
    endpoint: Endpoint,
    stored_headers: Mapping[str, str],
    *,
    auth_headers: Any,
    tenant_headers: Any,
    tenant: str,
    identity: list[tuple[str, str]],
    has_body: bool,
) -> dict[str, str]:
    """:func:`request_headers` by ``httpx.Headers``. ``auth_headers`` and
    ``tenant_headers``: the credentials already asked for, else ``_UNCALLED``."""
    headers = httpx.Headers(endpoint.headers)
    headers.update(stored_headers)
    if endpoint.auth is not None and not isinstance(endpoint.auth, httpx.Auth):
        headers.update(endpoint.auth() if auth_headers is _UNCALLED else auth_headers)
    if endpoint.tenant_auth is not None:
        headers.update(
            endpoint.tenant_auth(tenant) if tenant_headers is _UNCALLED else tenant_headers
        )
    if has_body:
        headers.setdefault("content-type", "application/json")
    for name, value in identity:
        headers[name] = value
    return dict(headers.multi_items())


def unbuilt_attempt(exc: Exception) -> AttemptResult:
    """The attempt whose request could not be built (an auth callable raised, a stored
    value the transport cannot encode): nothing left, so it is ``not_sent``."""
    return AttemptResult(
        classification=Classification(Verdict.RETRY, Delivery.NOT_SENT),
        status_code=None,
        receiver_request_id=None,
        error_class=type(exc).__name__,
        error_message=clean_message(f"not sent: the request could not be built: {exc}"),
        duration_ms=0,
        result=None,
    )


async def send_attempt(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    *,
    method: str,
    path: str,
    headers: dict[str, str],
    body: bytes | None,
    now_ms: Any,
    public_headers: Iterable[str] = (),
    secret_headers: Iterable[str] = (),
) -> AttemptResult:
    """Send one attempt under a total deadline and classify the result.

    ``now_ms`` is a callable giving the clock's time (for Retry-After dates). An
    endpoint classifier that raises never stops the operation: the attempt is recorded
    as ``unknown`` with the exception named, and retried under the policy.
    ``public_headers`` names sent headers whose values are not secret (the persisted
    ones); every other value sent is redacted wherever the receiver echoes it, and so
    is every header named in ``secret_headers``.
    """
    ex = await exchange(
        client,
        method,
        path,
        headers=headers,
        content=body,
        deadline_seconds=endpoint.timeout,
        keep=min(max(endpoint.result_body_limit, _MESSAGE_BYTES), endpoint.read_limit),
        limit=endpoint.read_limit,
        home_only=True,
    )
    if ex.refused:
        return AttemptResult(
            classification=Classification(Verdict.FAILED, Delivery.NOT_SENT),
            status_code=None,
            receiver_request_id=None,
            error_class=ex.error_class,
            error_message="not sent: the stored path leaves the endpoint's base URL",
            duration_ms=0,
            result=None,
        )
    # A receiver may echo request headers: never keep the credentials it echoes. Those
    # of the request that went out: an httpx.Auth may have sent one of its own making.
    # One redactor for the body, the headers and the error text alike.
    sent = ex.request
    if sent is not None and ex.response is not None:
        sent = _sent_request(sent, ex.response)
    redactor = request_redactor(endpoint, headers, sent, public=public_headers,
                                secret_names=secret_headers)  # fmt: skip
    if ex.error is not None:
        exc = ex.error
        error_class = ex.error_class
        error_message = (
            f"no complete response within the attempt deadline of {endpoint.timeout}s"
            if ex.timed_out
            else clean_message(redactor.text(str(exc) or repr(exc)))
        )
        try:
            override = endpoint.classify(exc) if endpoint.classify else None
        except Exception as failure:
            classification, error_class, error_message = _classifier_failed(failure)
            classification = ex.error_classification(classification)
            error_message = redactor.text(error_message)
        else:
            classification = ex.error_classification(override)
        return AttemptResult(
            classification=classification,
            status_code=ex.status,
            receiver_request_id=None,
            error_class=error_class,
            error_message=error_message,
            duration_ms=ex.elapsed_ms,
            result=None,
        )
    assert ex.request is not None and ex.response is not None and ex.body is not None
    response, received = ex.response, ex.body
    raw = redactor.bytes(received.head, cut_off=received.truncated)
    kept = redactor.bytes(
        received.head[: endpoint.result_body_limit],
        cut_off=received.truncated or len(received.head) > endpoint.result_body_limit,
    )
    failed_class: str | None = None
    failed_message: str | None = None
    try:
        override = (
            endpoint.classify(ex.readable(raw[: endpoint.result_body_limit]))
            if endpoint.classify
            else None
        )
    except Exception as failure:
        classification, failed_class, failed_message = _classifier_failed(failure)
        failed_message = redactor.text(failed_message)
    else:
        classification = override or classify_response(
            response, raw, now_ms(), replay_status=endpoint.replay_status
        )
    keep = classification.verdict in (Verdict.SUCCESS, Verdict.FAILED, Verdict.KEY_CONFLICT)
    if failed_message is None and classification.verdict is not Verdict.SUCCESS:
        message_head = redactor.bytes(received.head[:_MESSAGE_BYTES], cut_off=received.truncated)
        failed_message = clean_message(message_head.decode("utf-8", errors="replace"))
        if classification.replayed_failure and failed_class is None:
            marker = replay_marker(response.headers) or "a replay, by the endpoint's classify"
            # The evidence says why no retry follows: the marker, then the stored body.
            failed_class = ErrorClass.STORED_FAILURE_REPLAYED.value
            failed_message = clean_message(f"{marker}; {failed_message}")
    answered = _ResponseHeaders(response.headers)
    return AttemptResult(
        classification=classification,
        status_code=response.status_code,
        receiver_request_id=_receiver_request_id(
            answered, response.request.headers.get(endpoint.request_id_header), redactor
        ),
        error_class=failed_class,
        error_message=failed_message,
        duration_ms=ex.elapsed_ms,
        result=_stored_result(endpoint, response, received, kept, redactor, headers=answered)
        if keep
        else None,
        declared_retention_ms=_declared_ms(response.headers),
    )


def _declared_ms(headers: httpx.Headers) -> int | None:
    declared = declared_retention(headers)
    return None if declared is None else int(declared.total_seconds() * 1000)


__all__ = [
    "IN_PROGRESS_STATUS",
    "MAYBE_APPLIED_STATUSES",
    "REFUSAL_STATUSES",
    "AiohttpTransport",
    "AttemptResult",
    "Classification",
    "build_client",
    "classify_exception",
    "classify_response",
    "clean_message",
    "is_key_mismatch",
    "request_headers",
    "send_attempt",
    "unbuilt_attempt",
]


def _sent_request(built: httpx.Request, response: httpx.Response) -> httpx.Request:
    """The request that went out: the response's, when httpx recorded it (an auth flow
    may replace the request it was given), else the one built."""
    try:
        return response.request
    except RuntimeError:  # sent straight through the transport: the built one went out
        return built
