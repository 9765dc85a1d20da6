"""Rows to objects and back: the one mapping between the tables and the model."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Row,
)

from outbox.base.fields import from_row
from outbox.canonical import CanonicalArgs
from outbox.model import (
    Attempt,
    Delivery,
    Operation,
    PolicySnapshot,
    Reason,
    Result,
    State,
    Verdict,
)
from outbox.store.sealing import PLAIN, Sealed, Sealer
from outbox.store.tables import operations

#: "Oldest first", the one order of every operation list (``outbox reconcile list``,
#: bulk selections, the console's queue and operations pages): by the last change of
#: state (for the reconciliation queue, entry into it), then by row ID. The index
#: ``ix_outbox_operations_state_updated`` serves it.
OLDEST_FIRST = (operations.c.updated_at, operations.c.id)
NEWEST_FIRST = (operations.c.updated_at.desc(), operations.c.id.desc())


@dataclass(frozen=True, slots=True)
class AuditRecord:
    tenant: str
    operation_id: str
    actor: str
    action: str
    from_state: str | None
    to_state: str | None
    note: str
    details: dict[str, Any] | None
    at_ms: int


def headers_from_text(text: str | None) -> dict[str, str]:
    """Stored headers (a JSON object, or NULL for none) as a dict of strings."""
    value = json.loads(text) if text else {}
    return {str(k): str(v) for k, v in value.items()}


def stored_headers(text: str | None) -> tuple[dict[str, str], str | None]:
    """A row's stored headers, or none and why: one corrupt row (changed outside outbox)
    must fail neither the claim of a whole batch nor an operator's look at it."""
    try:
        return headers_from_text(text), None
    except (ValueError, AttributeError, TypeError):
        return {}, "its stored headers are not a JSON object (changed outside outbox)"


def _stored_body(text: str | None) -> Any:
    """The stored JSON body; as the raw text if it no longer parses (changed outside)."""
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def headers_text(headers: dict[str, str]) -> str:
    """Headers as stored: a JSON object, names sorted."""
    return json.dumps(headers, sort_keys=True)


def operation_row(
    *,
    tenant: str,
    operation_id: str,
    args: CanonicalArgs,
    ordering_key: str | None,
    now_ms: int,
    traceparent: str | None = None,
    policy: PolicySnapshot | None = None,
) -> dict[str, Any]:
    """The row of a new pending operation."""
    return {
        **policy_columns(policy),
        "tenant": tenant,
        "operation_id": operation_id,
        "endpoint": args.endpoint,
        "method": args.method,
        "path": args.path,
        "headers": json.dumps(args.headers, sort_keys=True, separators=(",", ":")),
        "body": args.body_json,
        "body_raw": args.body_raw,
        "args_sha256": args.args_sha256,
        "ordering_key": ordering_key,
        "state": State.PENDING.value,
        "attempts_counted": 0,
        "attempts_total": 0,
        "maybe_delivered": False,
        "saw_refusal": False,
        "next_attempt_at": max(now_ms, args.not_before_ms or now_ms),
        "priority": args.priority,
        "not_before": args.not_before_ms,
        "deliver_within_ms": args.deliver_within_ms,
        "version": 0,
        "created_at": now_ms,
        "updated_at": now_ms,
        "traceparent": traceparent,
    }


def policy_columns(policy: PolicySnapshot | None) -> dict[str, int | None]:
    """The ``policy_*`` columns of a snapshot (all NULL: unknown)."""
    return {
        "policy_window_ms": policy.window_ms if policy else None,
        "policy_key_retention_ms": policy.key_retention_ms if policy else None,
        "policy_margin_ms": policy.margin_ms if policy else None,
        "policy_max_attempts": policy.max_attempts if policy else None,
        "policy_in_progress_budget": policy.in_progress_budget if policy else None,
    }


def policy_from_row(r: Row[Any]) -> PolicySnapshot | None:
    if (
        r.policy_window_ms is None
        or r.policy_key_retention_ms is None
        or r.policy_margin_ms is None
        or r.policy_max_attempts is None
    ):
        return None
    return PolicySnapshot(
        window_ms=r.policy_window_ms,
        key_retention_ms=r.policy_key_retention_ms,
        margin_ms=r.policy_margin_ms,
        max_attempts=r.policy_max_attempts,
        in_progress_budget=r.policy_in_progress_budget
        if r.policy_in_progress_budget is not None
        else 0,
    )


def attempt_from_row(r: Row[Any]) -> Attempt:
    return from_row(
        Attempt,
        r,
        started_at_ms=r.started_at,
        lease_until_ms=r.lease_until,
        finished_at_ms=r.finished_at,
        delivery=Delivery(r.delivery) if r.delivery else None,
        verdict=Verdict(r.verdict) if r.verdict else None,
        counted=bool(r.counted),
    )


def operation_from_row(
    r: Row[Any], history: tuple[Attempt, ...], sealer: Sealer = PLAIN
) -> Operation:
    result = None
    if r.result_status is not None:
        rbody = sealer.open_result(r, "result_body")
        rheaders = sealer.open_result(r, "result_headers")
        body: Any = json.loads(rbody) if isinstance(rbody, str) else rbody
        result = Result(
            status_code=r.result_status,
            headers=headers_from_text(rheaders) if not isinstance(rheaders, Sealed) else {},
            body=body,
            body_sha256=r.result_sha256,
            body_size=r.result_size or 0,
            truncated=bool(r.result_truncated),
        )
    body = _opened_body(sealer.open_request(r, "body"))
    raw = sealer.open_request_raw(r)
    if isinstance(raw, Sealed):  # a sealed form or raw body, no key here: say which
        body, raw = raw, None
    return Operation(
        pk=r.id,
        tenant=r.tenant,
        operation_id=r.operation_id,
        endpoint=r.endpoint,
        method=r.method,
        path=r.path,
        headers=_opened_headers(sealer.open_request(r, "headers")),
        body=body,
        state=State(r.state),
        reason=Reason(r.reason) if r.reason else None,
        ordering_key=r.ordering_key,
        attempts_counted=r.attempts_counted,
        attempts_total=r.attempts_total,
        created_at_ms=r.created_at,
        updated_at_ms=r.updated_at,
        next_attempt_at_ms=r.next_attempt_at,
        first_attempt_at_ms=r.first_attempt_at,
        window_started_at_ms=r.window_started_at,
        version=r.version,
        result=result,
        attempts=history,
        attempts_in_progress=r.attempts_in_progress or 0,
        last_error=r.last_error,
        policy=policy_from_row(r),
        priority=r.priority,
        not_before_ms=r.not_before,
        deliver_within_ms=r.deliver_within_ms,
        body_raw=raw,
    )


def _opened_headers(value: str | Sealed | None) -> dict[str, str]:
    # Sealed headers read as none; the body (sealed with them) says which key is missing.
    return {} if value is None or isinstance(value, Sealed) else stored_headers(value)[0]


def _opened_body(value: str | Sealed | None) -> Any:
    return value if isinstance(value, Sealed) else _stored_body(value)


def audit_from_row(r: Row[Any]) -> AuditRecord:
    details = json.loads(r.details) if r.details else None
    return from_row(AuditRecord, r, details=details, at_ms=r.at)
