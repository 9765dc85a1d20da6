"""Asking the receiver whether an operation was applied: the status lookup.

An endpoint may say how to look an operation up by its key::

    Endpoint(..., status_lookup=StatusLookup(path="/operations/{operation_id}"))

:func:`lookup_status` sends that request (with the endpoint's auth, static headers, a
fresh request ID and the tenant header) and classifies the answer as ``APPLIED`` (with
the receiver's stored result), ``NOT_APPLIED`` or ``UNKNOWN``. It never raises for what
the network or the receiver does: every doubt is ``UNKNOWN``.

The rules it classifies by (``StatusLookup``, ``default_classify``) are configuration
(:mod:`outbox.config`); the answer's vocabulary (``LookupStatus``, ``LookupResult``) is
in :mod:`outbox.model`; settling an operation from the answer is an operator action
(:mod:`outbox.reconcile.probe`). This module only asks.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx

from outbox.model import LookupResult
from outbox.wire.exchange import clean_message, exchange
from outbox.wire.redact import request_redactor
from outbox.wire.transport import request_headers

if TYPE_CHECKING:
    from outbox.config import Endpoint

__all__ = ["lookup_status"]

#: Bytes of a lookup response read at most; a bigger answer is UNKNOWN.
_MAX_LOOKUP_BODY = 1024 * 1024
#: Characters of a lookup response body kept as evidence.
_EVIDENCE_CHARS = 2000


async def lookup_status(
    client: httpx.AsyncClient, endpoint: Endpoint, operation_id: str, tenant: str
) -> LookupResult:
    """Ask the receiver about ``operation_id`` through ``endpoint.status_lookup``.

    ``client`` is the endpoint's client (``outbox.wire.transport.build_client``). Bounded by
    the endpoint's timeout. Never raises on a network or receiver problem: that is
    UNKNOWN, with the error as evidence.
    """
    lookup = endpoint.status_lookup
    if lookup is None:
        return LookupResult.unknown(f"endpoint {endpoint.name!r} has no status_lookup")
    # The receiver knows the operation by the key it was sent (with key-prefix tenant
    # scoping, "<tenant>/<operation ID>").
    path = lookup.target(endpoint.wire_key(tenant, operation_id), tenant)
    request_id = str(uuid.uuid4())
    headers = request_headers(
        endpoint,
        stored_headers={},
        operation_id=operation_id,
        request_id=request_id,
        tenant=tenant,
        has_body=False,
    )
    # A lookup is not an operation: no idempotency key (names are case-insensitive).
    skip = endpoint.idempotency_header.lower()
    headers = {name: value for name, value in headers.items() if name.lower() != skip}

    def asked(result: LookupResult, **evidence: Any) -> LookupResult:
        return replace(result, method=lookup.method, path=path, request_id=request_id, **evidence)

    ex = await exchange(
        client,
        lookup.method,
        path,
        headers=headers,
        content=None,
        deadline_seconds=endpoint.timeout,
        keep=_MAX_LOOKUP_BODY,
        limit=_MAX_LOOKUP_BODY,
    )
    # The one redactor attempts use: a lookup route may echo the credentials it was sent.
    redactor = request_redactor(endpoint, headers, ex.request)
    if ex.error is not None:
        error = (
            f"no answer within {endpoint.timeout}s"
            if ex.timed_out
            else clean_message(redactor.text(f"{type(ex.error).__name__}: {ex.error}"))
        )
        return asked(
            LookupResult.unknown(f"the lookup failed ({error})"),
            http_status=ex.status,
            error=error,
        )
    assert ex.response is not None and ex.body is not None
    response = ex.response
    body = redactor.bytes(ex.body.head) if ex.body.complete else None
    evidence = body[:_EVIDENCE_CHARS].decode("utf-8", errors="replace") if body else None
    if body is None:
        return asked(
            LookupResult.unknown(f"the lookup answer exceeds {_MAX_LOOKUP_BODY} bytes"),
            http_status=response.status_code,
        )
    # The body is decoded already: the classifier's copy must not decode it again.
    read = ex.readable(body)
    try:
        classified = lookup.classify(read)
        if not isinstance(classified, LookupResult):
            raise TypeError(f"classify returned {type(classified).__name__}, not LookupResult")
    except Exception as exc:
        error = redactor.text(clean_message(f"{type(exc).__name__}: {exc}"))
        classified = LookupResult.unknown(f"the lookup classifier failed ({error})")
        return asked(classified, http_status=response.status_code, body=evidence, error=error)
    return asked(classified, http_status=response.status_code, body=evidence)
