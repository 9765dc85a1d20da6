"""Asking the receiver whether an operation was applied: the status lookup.

An endpoint may say how to look an operation up by its key::

    Endpoint(..., status_lookup=StatusLookup(path="/operations/{operation_id}"))

:func:`lookup_status` sends that request (with the endpoint's auth, static headers, a
fresh request ID and the tenant header) and classifies the answer as ``APPLIED`` (with
the receiver's stored result), ``NOT_APPLIED`` or ``UNKNOWN``. It never raises for what
the network or the receiver does: every doubt is ``UNKNOWN``.

:func:`probe` and :func:`probe_all` use it to settle unresolved operations, through the
:class:`~outbox.reconcile.Reconciler`'s own actions (so the audit row and the optimistic
version check are the same as an operator's), under the actor ``status-lookup``:

* ``APPLIED``: resolved as succeeded; the receiver's result is in the audit details.
* ``NOT_APPLIED`` while the receiver still keeps the key: requeued under the same
  operation ID (a resend is deduplicated by the receiver should the lookup be wrong).
* ``NOT_APPLIED`` after the key retention has passed: left unresolved, with the evidence
  in the audit trail; the receiver may simply have forgotten the key, so only an
  operator may requeue it (``--accept-duplicate-risk``).
* ``UNKNOWN``: left for the operator.
"""

from __future__ import annotations

import asyncio
import enum
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from outbox.body import read_body
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    OperatorActionRefused,
    ValidationError,
)
from outbox.model import Operation, Reason, State, ms_to_datetime
from outbox.transport import build_client, clean_message, request_headers

if TYPE_CHECKING:
    from outbox.client import Outbox
    from outbox.config import Endpoint

__all__ = [
    "ACTOR",
    "APPLIED",
    "NOT_APPLIED",
    "UNKNOWN",
    "LookupClassifier",
    "LookupResult",
    "LookupStatus",
    "ProbeAction",
    "ProbeOutcome",
    "StatusLookup",
    "default_classify",
    "lookup_status",
    "probe",
    "probe_all",
]

#: The actor named in the audit trail for what the status lookup settles.
ACTOR = "status-lookup"
#: The audit action of an evidence row that changes no state.
EVIDENCE_ACTION = "lookup"
#: Bytes of a lookup response read at most; a bigger answer is UNKNOWN.
_MAX_LOOKUP_BODY = 1024 * 1024
#: Characters of a lookup response body kept as evidence.
_EVIDENCE_CHARS = 2000
_LOOKUP_CONCURRENCY = 8


class LookupStatus(enum.StrEnum):
    """What the receiver says about an operation key."""

    #: The receiver applied it; the lookup carries its stored result.
    APPLIED = "applied"
    #: The receiver has no record of the key.
    NOT_APPLIED = "not_applied"
    #: Anything else: processing, an error, an answer not understood, no answer.
    UNKNOWN = "unknown"


APPLIED = LookupStatus.APPLIED
NOT_APPLIED = LookupStatus.NOT_APPLIED
UNKNOWN = LookupStatus.UNKNOWN


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A classified status lookup, with the evidence it rests on."""

    status: LookupStatus
    #: The receiver's stored result of the operation (APPLIED only).
    result: Any = None
    #: Why, in plain words.
    detail: str = ""
    #: Filled in by :func:`lookup_status`: what was asked and what came back.
    method: str | None = None
    path: str | None = None
    http_status: int | None = None
    request_id: str | None = None
    body: str | None = None
    error: str | None = None

    @classmethod
    def applied(cls, result: Any = None, detail: str = "") -> LookupResult:
        return cls(LookupStatus.APPLIED, result, detail or "the receiver applied it")

    @classmethod
    def not_applied(cls, detail: str = "") -> LookupResult:
        return cls(LookupStatus.NOT_APPLIED, None, detail or "the receiver has no record of it")

    @classmethod
    def unknown(cls, detail: str = "") -> LookupResult:
        return cls(LookupStatus.UNKNOWN, None, detail or "the answer does not tell")

    def describe(self) -> str:
        """``GET /operations/x -> 404: the receiver has no record of it``."""
        asked = f"{self.method} {self.path}" if self.method and self.path else "lookup"
        got = str(self.http_status) if self.http_status is not None else (self.error or "-")
        return f"{asked} -> {got}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "result": self.result,
            "detail": self.detail,
            "method": self.method,
            "path": self.path,
            "http_status": self.http_status,
            "request_id": self.request_id,
            "body": self.body,
            "error": self.error,
        }


#: Classifies a status lookup's (fully read) response.
LookupClassifier = Callable[[httpx.Response], LookupResult]


def default_classify(response: httpx.Response) -> LookupResult:
    """The route of :class:`outbox.testing.Receiver` (and receivers shaped like it).

    ``200 {"state": "applied", "response": {"status": S, "body": B}}`` is APPLIED with
    that response when S is 2xx (or absent); a stored non-2xx response is UNKNOWN (the
    receiver did something but answered an error: a person decides). ``404`` is
    NOT_APPLIED. Everything else (``409 {"state": "processing"}``, 5xx, auth errors, a
    body not understood) is UNKNOWN.
    """
    status = response.status_code
    if status == 404:
        return LookupResult.not_applied("the receiver has no record of the key")
    if status != 200:
        return LookupResult.unknown(f"the receiver answered {status}")
    try:
        data = json.loads(response.content)
    except ValueError:
        return LookupResult.unknown("200 with a body that is not JSON")
    if not isinstance(data, dict) or data.get("state") != "applied":
        state = data.get("state") if isinstance(data, dict) else None
        return LookupResult.unknown(f"200 but the state is {state!r}, not 'applied'")
    stored = data.get("response")
    stored_status = stored.get("status") if isinstance(stored, dict) else None
    if isinstance(stored_status, int) and not 200 <= stored_status < 300:
        return LookupResult.unknown(
            f"the receiver holds the key with a stored {stored_status} response; "
            "whether that counts as done is for a person to decide"
        )
    return LookupResult.applied(stored, "the receiver reports the operation applied")


@dataclass(frozen=True, kw_only=True)
class StatusLookup:
    """How to ask an endpoint's receiver about one operation key.

    ``path`` is relative to the endpoint's ``base_url`` and names the operation with
    ``{operation_id}`` (and optionally the tenant with ``{tenant}``); both are
    percent-encoded. ``{operation_id}`` is the key as sent: with
    ``tenant_scope="key_prefix"``, ``<tenant>/<operation ID>``. The endpoint's auth,
    static headers, request ID header and tenant header are sent; the idempotency
    header is not (a lookup is not an operation).
    """

    path: str = "/operations/{operation_id}"
    classify: LookupClassifier = default_classify
    method: str = "GET"
    #: The dispatcher asks as soon as an operation becomes unresolved: an "applied"
    #: answer settles it as succeeded at once; any other answer is left as evidence.
    on_unresolved: bool = True

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or "{operation_id}" not in self.path:
            raise ConfigurationError(
                f"status_lookup path must start with '/' and contain {{operation_id}}, "
                f"got {self.path!r}"
            )
        try:
            self.path.format(operation_id="x", tenant="t")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(
                f"status_lookup path {self.path!r} may only use {{operation_id}} and "
                f"{{tenant}}: {exc!r}"
            ) from exc
        if not callable(self.classify):
            raise ConfigurationError("status_lookup classify must be a callable")
        if not self.method.isalpha():
            raise ConfigurationError(f"status_lookup method {self.method!r} is not a method")
        object.__setattr__(self, "method", self.method.upper())

    def target(self, operation_id: str, tenant: str = "") -> str:
        return self.path.format(
            operation_id=quote(operation_id, safe=""), tenant=quote(tenant, safe="")
        )


async def _read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """The decoded body, or None past ``limit`` (bounded however it is encoded)."""
    body = await read_body(response, keep=limit, limit=limit)
    return body.head if body.complete else None


async def lookup_status(
    client: httpx.AsyncClient, endpoint: Endpoint, operation_id: str, tenant: str
) -> LookupResult:
    """Ask the receiver about ``operation_id`` through ``endpoint.status_lookup``.

    ``client`` is the endpoint's client (``outbox.transport.build_client``). Bounded by
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

    response: httpx.Response | None = None
    try:
        async with asyncio.timeout(endpoint.timeout):
            request = client.build_request(lookup.method, path, headers=headers)
            response = await client.send(request, stream=True)
            try:
                body = await _read_capped(response, _MAX_LOOKUP_BODY)
            finally:
                await response.aclose()
    except Exception as exc:
        error = (
            f"no answer within {endpoint.timeout}s"
            if isinstance(exc, TimeoutError)
            else clean_message(f"{type(exc).__name__}: {exc}")
        )
        return asked(
            LookupResult.unknown(f"the lookup failed ({error})"),
            http_status=response.status_code if response is not None else None,
            error=error,
        )
    evidence = body[:_EVIDENCE_CHARS].decode("utf-8", errors="replace") if body else None
    if body is None:
        return asked(
            LookupResult.unknown(f"the lookup answer exceeds {_MAX_LOOKUP_BODY} bytes"),
            http_status=response.status_code,
        )
    # The body is decoded already: the classifier's copy must not decode it again.
    framing = ("content-encoding", "content-length", "transfer-encoding")
    plain = [(k, v) for k, v in response.headers.multi_items() if k.lower() not in framing]
    read = httpx.Response(
        response.status_code, headers=plain, content=body, request=response.request
    )
    try:
        classified = lookup.classify(read)
        if not isinstance(classified, LookupResult):
            raise TypeError(f"classify returned {type(classified).__name__}, not LookupResult")
    except Exception as exc:
        error = clean_message(f"{type(exc).__name__}: {exc}")
        classified = LookupResult.unknown(f"the lookup classifier failed ({error})")
        return asked(classified, http_status=response.status_code, body=evidence, error=error)
    return asked(classified, http_status=response.status_code, body=evidence)


# -- settling unresolved operations -------------------------------------------------------


class ProbeAction(enum.StrEnum):
    """What a probe did with an unresolved operation."""

    #: APPLIED: resolved as succeeded.
    RESOLVED = "resolved_succeeded"
    #: NOT_APPLIED within the key retention: requeued under the same operation ID.
    REQUEUED = "requeued"
    #: NOT_APPLIED after the key retention: left unresolved, evidence in the audit.
    EVIDENCE_RECORDED = "evidence_recorded"
    #: UNKNOWN: left for the operator.
    LEFT_FOR_OPERATOR = "left_for_operator"
    #: Not looked up (no status_lookup, a key conflict) or changed meanwhile.
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class ProbeOutcome:
    """One operation's status lookup and what was done about it."""

    tenant: str
    operation_id: str
    endpoint: str
    action: ProbeAction
    #: The state after the probe.
    state: State
    detail: str
    lookup: LookupResult | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "operation_id": self.operation_id,
            "endpoint": self.endpoint,
            "action": self.action.value,
            "state": self.state.value,
            "detail": self.detail,
            "lookup": self.lookup.as_dict() if self.lookup is not None else None,
        }


@dataclass
class _Pending:
    op: Operation
    endpoint: Endpoint | None
    skip: str | None = None
    result: LookupResult | None = field(default=None)


def _skip_reason(outbox: Outbox, op: Operation) -> str | None:
    endpoint = outbox.endpoints.get(op.endpoint)
    if endpoint is None:
        return f"endpoint {op.endpoint!r} is not registered here (pass --app)"
    if endpoint.status_lookup is None:
        return f"endpoint {op.endpoint!r} has no status_lookup configured"
    if op.reason is Reason.KEY_CONFLICT:
        return (
            "the receiver bound this key to other arguments: a lookup by key would describe "
            "the other intent, so a person decides"
        )
    return None


async def _lookup_all(outbox: Outbox, pending: Sequence[_Pending]) -> None:
    clients: dict[str, httpx.AsyncClient] = {}
    gate = asyncio.Semaphore(_LOOKUP_CONCURRENCY)

    async def one(item: _Pending) -> None:
        endpoint = item.endpoint
        assert endpoint is not None
        client = clients.get(endpoint.name)
        if client is None:
            factory = outbox.transport_factory
            client = build_client(endpoint, factory(endpoint) if factory else None)
            clients[endpoint.name] = client
        async with gate:
            op = item.op
            item.result = await lookup_status(client, endpoint, op.operation_id, op.tenant)

    try:
        await asyncio.gather(*(one(p) for p in pending if p.skip is None))
    finally:
        for client in clients.values():
            await client.aclose()


def _iso(ms: int | None) -> str:
    when = ms_to_datetime(ms)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z") if when else "?"


def _outcome(
    op: Operation,
    action: ProbeAction,
    *,
    state: State,
    detail: str,
    lookup: LookupResult | None = None,
) -> ProbeOutcome:
    return ProbeOutcome(
        tenant=op.tenant,
        operation_id=op.operation_id,
        endpoint=op.endpoint,
        action=action,
        state=state,
        detail=detail,
        lookup=lookup,
    )


def settle_after_dispatch(
    outbox: Outbox, operation_id: str, tenant: str, result: LookupResult
) -> ProbeOutcome | None:
    """What the dispatcher does with a lookup made as an operation became unresolved.

    APPLIED settles it as succeeded (audited as ``status-lookup``). NOT_APPLIED is
    recorded as evidence and left: a resend needs a new window, which is a person's
    decision or an explicit ``outbox reconcile probe``. None if it is no longer unresolved.
    """
    op = outbox.get(operation_id, tenant=tenant)
    if op.state is not State.UNRESOLVED or _skip_reason(outbox, op) is not None:
        return None
    return _settle(outbox, _Pending(op, outbox.endpoints.get(op.endpoint), None, result),
                   requeue_not_applied=False)


def _settle(outbox: Outbox, item: _Pending, *, requeue_not_applied: bool = True) -> ProbeOutcome:
    from outbox.reconcile import Reconciler

    op, result = item.op, item.result
    if item.skip is not None or result is None:
        detail = item.skip or "not looked up"
        return _outcome(op, ProbeAction.SKIPPED, state=op.state, detail=detail)
    rec = Reconciler(outbox)
    evidence = result.as_dict()
    if result.status is LookupStatus.APPLIED:
        done = rec.resolve(
            op.operation_id,
            tenant=op.tenant,
            outcome=State.SUCCEEDED,
            note=f"status lookup: {result.describe()}; resolved as succeeded with the "
            "receiver's result",
            operator=ACTOR,
            details={"status_lookup": evidence, "receiver_result": result.result},
        )
        return _outcome(
            op,
            ProbeAction.RESOLVED,
            state=done.state,
            detail=result.detail,
            lookup=result,
        )
    if result.status is LookupStatus.NOT_APPLIED:
        endpoint = item.endpoint
        assert endpoint is not None
        # The dispatcher sends under a key only until first attempt + retention - margin;
        # a requeue later than that would go straight back to unresolved.
        usable_until = (
            None
            if op.first_attempt_at_ms is None
            else op.first_attempt_at_ms
            + int((endpoint.key_retention - endpoint.margin).total_seconds() * 1000)
        )
        if not requeue_not_applied:
            _record_evidence(
                outbox,
                op,
                f"status lookup as it became unresolved: {result.describe()}; the receiver "
                "reports it never applied. Left for an operator: `outbox reconcile probe` "
                "sends it again under the same operation ID while the key is retained.",
                evidence,
            )
            return _outcome(op, ProbeAction.EVIDENCE_RECORDED, state=op.state,
                            detail="never applied; left for an operator", lookup=result)
        if usable_until is None or outbox.clock.now_ms() < usable_until:
            until = "" if usable_until is None else f" (until {_iso(usable_until)})"
            done = rec.requeue(
                op.operation_id,
                tenant=op.tenant,
                note=f"status lookup: {result.describe()}; the receiver still keeps the key"
                f"{until}, so it is sent again under the same operation ID",
                operator=ACTOR,
            )
            return _outcome(
                op,
                ProbeAction.REQUEUED,
                state=done.state,
                detail=result.detail,
                lookup=result,
            )
        expires = (op.first_attempt_at_ms or 0) + int(endpoint.key_retention.total_seconds() * 1000)
        note = (
            f"status lookup: never applied according to the receiver ({result.describe()}), "
            f"but the key's retention (until {_iso(expires)}, less a safety margin of "
            f"{endpoint.margin}) is over: the receiver may have forgotten an applied "
            "operation. Left unresolved: requeue explicitly (--accept-duplicate-risk) once "
            "you have checked."
        )
        _record_evidence(outbox, op, note, evidence)
        return _outcome(
            op,
            ProbeAction.EVIDENCE_RECORDED,
            state=op.state,
            detail="never applied; requeue explicitly (the key retention is over)",
            lookup=result,
        )
    return _outcome(
        op,
        ProbeAction.LEFT_FOR_OPERATOR,
        state=op.state,
        detail=result.detail,
        lookup=result,
    )


def _record_evidence(outbox: Outbox, op: Operation, note: str, details: dict[str, Any]) -> None:
    """An audit row that changes no state; not repeated when the last one says the same."""
    trail = outbox.store.audit_trail(op.tenant, op.operation_id)
    if trail:
        last = trail[-1]
        if last.actor == ACTOR and last.action == EVIDENCE_ACTION and last.note == note[:2000]:
            return
    outbox.store.record_audit(
        {
            "tenant": op.tenant,
            "operation_id": op.operation_id,
            "actor": ACTOR,
            "action": EVIDENCE_ACTION,
            "from_state": op.state.value,
            "to_state": op.state.value,
            "note": note[:2000],
            "details": json.dumps({"status_lookup": details}, sort_keys=True, default=str),
            "at": outbox.clock.now_ms(),
        }
    )


def probe(outbox: Outbox, operation_id: str, *, tenant: str = "") -> ProbeOutcome:
    """Look one unresolved operation up at its receiver and settle it if the answer is
    definitive (see the module docstring).

    Raises :class:`OperationNotFound`, :class:`OperatorActionRefused` (not unresolved, or
    a key conflict), :class:`ConfigurationError` (no status lookup for its endpoint) and
    :class:`ConcurrentModification` (changed while we looked).
    """
    op = outbox.get(operation_id, tenant=tenant)
    if op.state is not State.UNRESOLVED:
        raise OperatorActionRefused(
            f"operation {operation_id!r} is {op.state.value}, not unresolved; only "
            "operations in the reconciliation queue are probed"
        )
    skip = _skip_reason(outbox, op)
    if skip is not None:
        error = OperatorActionRefused if op.reason is Reason.KEY_CONFLICT else ConfigurationError
        raise error(f"cannot probe {operation_id!r}: {skip}")
    item = _Pending(op, outbox.endpoints.get(op.endpoint))
    asyncio.run(_lookup_all(outbox, [item]))
    return _settle(outbox, item)


def probe_all(
    outbox: Outbox,
    *,
    endpoint: str | None = None,
    tenant: str | None = None,
    limit: int | None = None,
    reason: Reason | str | None = None,
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
) -> list[ProbeOutcome]:
    """Probe every unresolved operation (optionally of one endpoint or tenant), oldest
    first. Operations that cannot be looked up, or that change meanwhile, are reported
    as skipped; the others are settled as :func:`probe` does."""
    from outbox.reconcile import Reconciler

    if limit is not None and limit < 1:
        raise ValidationError("limit must be at least 1")
    rec = Reconciler(outbox)
    ops: list[Operation] = []
    page = 500
    while limit is None or len(ops) < limit:
        batch = rec.list(
            endpoint=endpoint,
            tenant=tenant,
            reason=reason,
            older_than=older_than,
            newer_than=newer_than,
            limit=page,
            offset=len(ops),
        )
        ops.extend(batch)
        if len(batch) < page:
            break
    if limit is not None:
        ops = ops[:limit]
    pending = [
        _Pending(op, outbox.endpoints.get(op.endpoint), _skip_reason(outbox, op)) for op in ops
    ]
    if any(p.skip is None for p in pending):
        asyncio.run(_lookup_all(outbox, pending))
    outcomes = []
    for item in pending:
        try:
            outcomes.append(_settle(outbox, item))
        except (ConcurrentModification, OperatorActionRefused) as exc:
            outcomes.append(
                ProbeOutcome(
                    tenant=item.op.tenant,
                    operation_id=item.op.operation_id,
                    endpoint=item.op.endpoint,
                    action=ProbeAction.SKIPPED,
                    state=outbox.get(item.op.operation_id, tenant=item.op.tenant).state,
                    detail=f"changed while being probed: {exc}",
                    lookup=item.result,
                )
            )
    return outcomes
