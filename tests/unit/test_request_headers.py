"""An attempt's headers are those ``httpx.Headers`` would merge, whatever the case,
duplicates, credentials and identity headers; the answer's headers are read as
``httpx.Headers`` reads them. The fast paths must never diverge."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import httpx
import pytest

from outbox import Endpoint
from outbox.wire.transport import request_headers


def _reference(endpoint: Endpoint, *, stored_headers: Mapping[str, str], operation_id: str,
               request_id: str, tenant: str, has_body: bool) -> dict[str, str]:
    """The definition: the merge by httpx.Headers, as the dispatcher always did it."""
    headers = httpx.Headers(endpoint.headers)
    headers.update(stored_headers)
    if endpoint.auth is not None and not isinstance(endpoint.auth, httpx.Auth):
        headers.update(endpoint.auth())
    if endpoint.tenant_auth is not None:
        headers.update(endpoint.tenant_auth(tenant))
    if has_body:
        headers.setdefault("content-type", "application/json")
    headers[endpoint.idempotency_header] = endpoint.wire_key(tenant, operation_id)
    headers[endpoint.request_id_header] = request_id
    if endpoint.tenant_header is not None:
        headers[endpoint.tenant_header] = tenant
    return dict(headers.multi_items())


STATIC: list[Mapping[str, Any]] = [
    {},
    {"Accept": "application/json", "X-Api-Version": "2"},
    {"X-Dup": "a", "x-dup": "b", "X-DUP": "c"},  # case variants of one name
    {"Content-Type": "text/plain; charset=utf-8"},
    {"idempotency-key": "from-static", "X-Request-Id": "static-id"},
    MappingProxyType({"X-Proxy": "1", "x-proxy": "2"}),  # not a dict
    httpx.Headers([("X-Multi", "1"), ("X-Multi", "2")]),  # a multi-dict
]
STORED: list[Mapping[str, Any]] = [
    {},
    {"accept": "text/csv", "X-Api-Version": "3"},
    {"CONTENT-TYPE": "application/xml"},
    {"X-Dup": "s1", "x-b": "s2", "x-DUP": "s3"},
    {"Idempotency-Key": "forged", "x-request-id": "forged", "X-Tenant": "forged"},
    {"X-Bytes": b"raw"},
    {"X-Latin": "caf\u00e9"},  # httpx refuses it: so must we, the same way
    {"X-Number": 3},
]
AUTH: list[Mapping[str, Any] | None] = [
    None,
    {"Authorization": "Bearer t"},
    {"authorization": "Bearer u", "X-Api-Version": "auth", "x-dup": "auth"},
    {"Idempotency-Key": "from-auth"},
    {"X-Auth-Utf8": "\u00fc"},
]


def _cases() -> Any:
    return itertools.product(STATIC, STORED, AUTH)


def _outcome(fn: Any, endpoint: Endpoint, **kwargs: Any) -> Any:
    try:
        return fn(endpoint, **kwargs)
    except Exception as exc:  # the same error class and message, or none
        return type(exc), str(exc)


@pytest.mark.parametrize("tenant_header", [None, "X-Tenant", "x-api-version"])
@pytest.mark.parametrize("has_body", [True, False])
def test_request_headers_are_httpx_merge(tenant_header: str | None, has_body: bool) -> None:
    for static, stored, auth in _cases():
        calls: list[str] = []

        def supplier(
            auth: Mapping[str, Any] | None = auth, calls: list[str] = calls
        ) -> Mapping[str, Any]:
            calls.append("auth")
            assert auth is not None
            return auth

        endpoint = Endpoint(
            name="rx",
            base_url="http://127.0.0.1:9",
            headers=static,  # type: ignore[arg-type]
            auth=supplier if auth is not None else None,  # type: ignore[arg-type]
            tenant_header=tenant_header,
        )
        kwargs: dict[str, Any] = dict(
            stored_headers=stored, operation_id="op-1", request_id="req-1",
            tenant="t1" if tenant_header else "", has_body=has_body,
        )
        ours = _outcome(request_headers, endpoint, **kwargs)
        ours_calls = len(calls)
        theirs = _outcome(_reference, endpoint, **kwargs)
        assert ours == theirs, (static, stored, auth)
        if isinstance(ours, dict):
            assert list(ours) == list(theirs)  # the order too
        assert ours_calls == len(calls) - ours_calls  # auth asked as often as httpx asks


@pytest.mark.parametrize("operation_id", ["op-1", "caf\u00e9"])
def test_identity_headers_and_tenant_credentials(operation_id: str) -> None:
    endpoint = Endpoint(
        name="rx",
        base_url="http://127.0.0.1:9",
        headers={"X-Static": "1"},
        tenant_scope="credentials",
        tenant_auth=lambda tenant: {"Authorization": f"Bearer {tenant}", "x-static": "2"},
        idempotency_header="Idempotency-Key",
        request_id_header="idempotency-key",  # the same name: the request ID wins
    )
    kwargs: dict[str, Any] = dict(
        stored_headers={"X-Static": "3"}, operation_id=operation_id, request_id="r",
        tenant="acme", has_body=True,
    )
    ours = _outcome(request_headers, endpoint, **kwargs)
    theirs = _outcome(_reference, endpoint, **kwargs)
    assert ours == theirs
    assert list(ours) == list(theirs)


RAW_RESPONSE_HEADERS = [
    [(b"X-Request-ID", b"rx-1"), (b"Content-Type", b"application/json")],
    [(b"x-request-id", b"a"), (b"X-REQUEST-ID", b"b"), (b"request-id", b""),
     (b"Idempotent-Replayed", b"true")],
    [(b"X-Request-Id", b"caf\xc3\xa9"), (b"x-amzn-requestid", b"\xe9t\xe9")],  # latin-1 wins
    [(b"X-Request-Id", b"caf\xc3\xa9"), (b"Content-Type", b"text/plain")],  # utf-8
    [(b"\xc3\x89-Header", b"1"), (b"\xc3\xa9-header", b"2")],  # non-ASCII names
]
NAMES = ["x-request-id", "X-Request-ID", "request-id", "Request-Id", "x-amzn-requestid",
         "idempotent-replayed", "content-type", "absent", "\u00e9-header", "\u00c9-Header"]


@pytest.mark.parametrize("raw", RAW_RESPONSE_HEADERS)
def test_response_header_lookups_are_httpx_lookups(raw: list[tuple[bytes, bytes]]) -> None:
    from outbox.wire.transport import _ResponseHeaders

    reference = httpx.Response(200, headers=raw).headers
    ours = _ResponseHeaders(httpx.Response(200, headers=raw).headers)
    for name in NAMES:
        assert _outcome(lambda _, n=name: ours.get(n), None) == _outcome(
            lambda _, n=name: reference.get(n), None
        ), name
