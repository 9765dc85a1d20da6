"""Settling unresolved operations from what their receiver says (the status lookup).

:func:`probe` and :func:`probe_all` ask with :func:`outbox.wire.lookup.lookup_status` and
settle through the operator's own actions (so the audit row and the optimistic version
check are the same as an operator's), under the actor ``status-lookup``:

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import httpx

from outbox.config import Endpoint
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    OperatorActionRefused,
    ValidationError,
)
from outbox.model import LookupResult, LookupStatus, Operation, Reason, State, ms_to_iso
from outbox.reconcile.actions import OperatorActions
from outbox.wire.lookup import lookup_status
from outbox.wire.transport import build_client

if TYPE_CHECKING:
    from outbox.config import Endpoint
    from outbox.reconcile.parts import OutboxParts


#: The actor named in the audit trail for what the status lookup settles.
ACTOR = "status-lookup"


#: The audit action of an evidence row that changes no state.
EVIDENCE_ACTION = "lookup"


_LOOKUP_CONCURRENCY = 8


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


def skip_reason(outbox: OutboxParts, op: Operation) -> str | None:
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


async def _lookup_all(outbox: OutboxParts, pending: Sequence[_Pending]) -> None:
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


def _outcome(
    op: Operation,
    action: ProbeAction,
    state: State,
    detail: str,
    lookup: LookupResult | None = None,
) -> ProbeOutcome:
    """What a probe did with ``op``: the action, the state after it, why, the answer read."""
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
    outbox: OutboxParts, operation_id: str, tenant: str, result: LookupResult
) -> ProbeOutcome | None:
    """What the dispatcher does with a lookup made as an operation became unresolved.

    APPLIED settles it as succeeded (audited as ``status-lookup``). NOT_APPLIED is
    recorded as evidence and left: a resend needs a new window, which is a person's
    decision or an explicit ``outbox reconcile probe``. None if it is no longer unresolved.
    """
    op = outbox.get(operation_id, tenant=tenant)
    if op.state is not State.UNRESOLVED or skip_reason(outbox, op) is not None:
        return None
    return _settle(
        outbox,
        _Pending(op, outbox.endpoints.get(op.endpoint), None, result),
        requeue_not_applied=False,
    )


def _settle(
    outbox: OutboxParts, item: _Pending, *, requeue_not_applied: bool = True
) -> ProbeOutcome:
    op, result = item.op, item.result
    if item.skip is not None or result is None:
        detail = item.skip or "not looked up"
        return _outcome(op, ProbeAction.SKIPPED, op.state, detail)
    rec = OperatorActions(outbox)
    if result.status is LookupStatus.APPLIED:
        done = rec.resolve(
            op.operation_id,
            tenant=op.tenant,
            outcome=State.SUCCEEDED,
            note=f"status lookup: {result.describe()}; resolved as succeeded with the "
            "receiver's result",
            operator=ACTOR,
            details={"status_lookup": result.as_dict(), "receiver_result": result.result},
        )
        return _outcome(op, ProbeAction.RESOLVED, done.state, result.detail, result)
    if result.status is LookupStatus.NOT_APPLIED:
        endpoint = item.endpoint
        assert endpoint is not None
        # The dispatcher sends under a key only until it is no longer usable; a requeue
        # later than that would go straight back to unresolved.
        policy = endpoint.policy_snapshot()
        first = op.first_attempt_at_ms
        usable_until = None if first is None else policy.key_usable_until_ms(first)
        if not requeue_not_applied:
            note = (
                f"status lookup as it became unresolved: {result.describe()}; the receiver "
                "reports it never applied. Left for an operator: `outbox reconcile probe` "
                "sends it again under the same operation ID while the key is retained."
            )
            return _left_with_evidence(
                outbox, op, result, note, "never applied; left for an operator"
            )
        if usable_until is None or outbox.clock.now_ms() < usable_until:
            when = ms_to_iso(usable_until, timespec="seconds")
            until = "" if when is None else f" (until {when})"
            done = rec.requeue(
                op.operation_id,
                tenant=op.tenant,
                note=f"status lookup: {result.describe()}; the receiver still keeps the key"
                f"{until}, so it is sent again under the same operation ID",
                operator=ACTOR,
            )
            return _outcome(op, ProbeAction.REQUEUED, done.state, result.detail, result)
        expires = policy.key_expires_at_ms(first or 0)
        expires_at = ms_to_iso(expires, timespec="seconds") or "?"
        note = (
            f"status lookup: never applied according to the receiver ({result.describe()}), "
            f"but the key's retention (until {expires_at}, less a safety margin of "
            f"{endpoint.margin}) is over: the receiver may have forgotten an applied "
            "operation. Left unresolved: requeue explicitly (--accept-duplicate-risk) once "
            "you have checked."
        )
        detail = "never applied; requeue explicitly (the key retention is over)"
        return _left_with_evidence(outbox, op, result, note, detail)
    return _outcome(op, ProbeAction.LEFT_FOR_OPERATOR, op.state, result.detail, result)


def _left_with_evidence(
    outbox: OutboxParts, op: Operation, result: LookupResult, note: str, detail: str
) -> ProbeOutcome:
    """Leave ``op`` as it is with the answer recorded as evidence: an audit row that
    changes no state, not repeated when the last one says the same."""
    outcome = _outcome(op, ProbeAction.EVIDENCE_RECORDED, op.state, detail, result)
    trail = outbox.store.audit_trail(op.tenant, op.operation_id)
    if trail:
        last = trail[-1]
        if last.actor == ACTOR and last.action == EVIDENCE_ACTION and last.note == note[:2000]:
            return outcome
    outbox.store.record_audit(
        {
            "tenant": op.tenant,
            "operation_id": op.operation_id,
            "actor": ACTOR,
            "action": EVIDENCE_ACTION,
            "from_state": op.state.value,
            "to_state": op.state.value,
            "note": note[:2000],
            "details": json.dumps({"status_lookup": result.as_dict()}, sort_keys=True, default=str),
            "at": outbox.clock.now_ms(),
        }
    )
    return outcome


def probe(outbox: OutboxParts, operation_id: str, *, tenant: str = "") -> ProbeOutcome:
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
    skip = skip_reason(outbox, op)
    if skip is not None:
        error = OperatorActionRefused if op.reason is Reason.KEY_CONFLICT else ConfigurationError
        raise error(f"cannot probe {operation_id!r}: {skip}")
    item = _Pending(op, outbox.endpoints.get(op.endpoint))
    asyncio.run(_lookup_all(outbox, [item]))
    return _settle(outbox, item)


def probe_all(
    outbox: OutboxParts,
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
    if limit is not None and limit < 1:
        raise ValidationError("limit must be at least 1")
    rec = OperatorActions(outbox)
    ops: list[Operation] = []
    page = 500
    while limit is None or len(ops) < limit:
        batch = rec.unresolved(
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
        _Pending(op, outbox.endpoints.get(op.endpoint), skip_reason(outbox, op)) for op in ops
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
