"""Operator actions over the reconciliation queue. Returns reports; never prints.

Every action is conditional on the operation's version as read (optimistic
concurrency): of two operators acting at once, one wins and the other gets
:class:`ConcurrentModification`; the winner's action and only it is in the audit trail.
"""

from __future__ import annotations

import builtins
import getpass
import json
import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from outbox import lookup
from outbox.canonical import check_operation_id, check_tenant
from outbox.errors import (
    ConcurrentModification,
    OperationNotFound,
    OperatorActionRefused,
    ValidationError,
)
from outbox.model import (
    Action,
    Attempt,
    Delivery,
    ErrorClass,
    Operation,
    Reason,
    State,
    Verdict,
    ms_to_datetime,
)
from outbox.status import DEFAULT_DISPATCHER_TIMEOUT, Watch, watch
from outbox.store.base import AuditRecord

if TYPE_CHECKING:
    from outbox.client import Outbox

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_MAX_NOTE = 2000


def parse_duration(text: str) -> timedelta:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w``."""
    match = _DURATION.match(text)
    if not match:
        raise ValidationError(f"duration must look like 30d, 12h, 90m or 45s; got {text!r}")
    return timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def default_operator() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


def _iso(ms: int | None) -> str | None:
    value = ms_to_datetime(ms)
    return value.isoformat(timespec="milliseconds").replace("+00:00", "Z") if value else None


def describe_attempt(attempt: Attempt) -> str:
    """One attempt's evidence in plain words."""
    n = attempt.number
    if attempt.delivery is None:
        return f"attempt {n} is open: a dispatcher holds it and may be sending it now"
    if attempt.error_class == ErrorClass.LEASE_EXPIRED:
        return (
            f"attempt {n} may have reached the receiver: its dispatcher stopped "
            "(crashed, killed or paused) before recording what happened"
        )
    if attempt.error_class == ErrorClass.LEASE_CHECK_FAILED:
        return f"attempt {n} was not sent: too little of the lease was left"
    if attempt.error_class == ErrorClass.WINDOW_CLOSED_BEFORE_SEND:
        return f"attempt {n} was not sent: the retry window closed before it could start"
    if attempt.error_class == ErrorClass.CLASSIFIER_FAILED:
        return (
            f"attempt {n} may have reached the receiver"
            f"{f' (it answered {attempt.status_code})' if attempt.status_code else ''}, but "
            f"the endpoint's classifier failed: {attempt.error_message}"
        )
    if attempt.delivery is Delivery.NOT_SENT:
        return (
            f"attempt {n} never left this machine: {attempt.error_class}"
            f"{': ' + attempt.error_message if attempt.error_message else ''}"
        )
    if attempt.delivery is Delivery.UNKNOWN:
        if attempt.error_class in (
            ErrorClass.ATTEMPT_DEADLINE_EXCEEDED,
            "ReadTimeout",
            "WriteTimeout",
        ):
            return (
                f"attempt {n} may have reached the receiver: no complete response "
                "arrived within the attempt deadline after the request was sent"
            )
        return (
            f"attempt {n} may have reached the receiver: the connection closed after "
            f"the request was sent ({attempt.error_class})"
        )
    status = attempt.status_code
    verdict = attempt.verdict
    if verdict is Verdict.SUCCESS:
        if status is not None and not 200 <= status < 300:
            return f"attempt {n} succeeded: the receiver replayed the stored result ({status})"
        return f"attempt {n} succeeded with {status}"
    if verdict is Verdict.IN_PROGRESS:
        return f"attempt {n}: the receiver said the key is still being processed ({status})"
    if verdict is Verdict.KEY_CONFLICT:
        return f"attempt {n}: the receiver refused the key as bound to other arguments ({status})"
    if status in (500, 502, 504) or (status is not None and status >= 500 and status != 503):
        return f"attempt {n} may have been applied: the receiver answered {status}"
    if verdict is Verdict.FAILED:
        return f"attempt {n}: the receiver refused it definitively with {status}"
    return f"attempt {n}: the receiver refused it with {status} before doing any work"


def explain(op: Operation) -> str:
    """Why the operation is where it is, in plain words."""
    if op.state is State.UNRESOLVED:
        doubtful = [
            a
            for a in op.attempts
            if a.delivery is Delivery.UNKNOWN
            or (a.status_code is not None and a.status_code >= 500 and a.status_code != 503)
            or a.status_code == 409
        ]
        if op.reason is Reason.OUTCOME_UNKNOWN and doubtful:
            return (
                describe_attempt(doubtful[-1])
                + ". Check with the receiver whether it was applied, then resolve or requeue."
            )
        if op.reason is Reason.RETRIES_EXHAUSTED:
            statuses = sorted({a.status_code for a in op.attempts if a.status_code})
            return (
                f"every answer was a refusal before work ({', '.join(map(str, statuses))}) "
                f"until the attempts or the window ran out; {op.attempts_total} attempts"
            )
        if op.reason is Reason.RECEIVER_BUSY:
            return (
                f"the receiver answered \"still processing\" {op.attempts_in_progress} times, "
                "the whole in-progress budget: it holds the key, but whether the first "
                "request was applied is not known. Ask the receiver, then resolve or requeue."
            )
        if op.reason is Reason.CONFLICTING_EVIDENCE:
            last = op.attempts[-1] if op.attempts else None
            return (
                "the receiver refused it definitively"
                + (f" ({last.status_code})" if last and last.status_code else "")
                + " after an earlier attempt that may have been applied: the refusal does "
                "not prove that nothing happened. Check with the receiver."
            )
        if op.reason is Reason.NEVER_DELIVERED and op.last_error:
            return f"never sent: {op.last_error}"
        if op.reason is Reason.NEVER_DELIVERED:
            last = op.attempts[-1] if op.attempts else None
            return "no attempt ever left this machine" + (
                f" (last error: {last.error_class})" if last else ""
            )
        if op.reason is Reason.KEY_CONFLICT:
            return (
                "the receiver says this operation ID is bound to other arguments: "
                "another intent used the same key"
            )
        return f"unresolved ({op.reason})"
    if op.state is State.PENDING and op.last_error:
        return f"pending, but no dispatcher could send it: {op.last_error}"
    if op.state is State.PENDING and op.attempts_total:
        return f"waiting to retry after {op.attempts_total} attempts"
    return op.state.value


@dataclass(frozen=True)
class RequeueRisk:
    key_expires_at_ms: int | None
    key_retention_passed: bool | None  #: None when the endpoint is not registered here
    note: str


@dataclass(frozen=True)
class OperationReport:
    """Everything an operator needs to settle one operation."""

    operation: Operation
    explanation: str
    requeue_risk: RequeueRisk
    audit: list[AuditRecord]
    blocked_by: str | None = None

    def as_dict(self) -> dict[str, Any]:
        op = self.operation
        return {
            **operation_dict(op),
            "explanation": self.explanation,
            "blocked_by": self.blocked_by,
            "requeue_risk": {
                "key_expires_at": _iso(self.requeue_risk.key_expires_at_ms),
                "key_retention_passed": self.requeue_risk.key_retention_passed,
                "note": self.requeue_risk.note,
            },
            "attempts": [attempt_dict(a) for a in op.attempts],
            "audit": [audit_dict(r) for r in self.audit],
        }


def operation_dict(op: Operation) -> dict[str, Any]:
    """The stable JSON shape of an operation (documented in the README)."""
    result = None
    if op.result is not None:
        result = {
            "status": op.result.status_code,
            "headers": op.result.headers,
            "body": op.result.body,
            "body_sha256": op.result.body_sha256,
            "body_size": op.result.body_size,
            "truncated": op.result.truncated,
        }
    return {
        "tenant": op.tenant,
        "operation_id": op.operation_id,
        "endpoint": op.endpoint,
        "method": op.method,
        "path": op.path,
        "headers": op.headers,
        "body": op.body,
        "state": op.state.value,
        "reason": op.reason.value if op.reason else None,
        "ordering_key": op.ordering_key,
        "attempts_counted": op.attempts_counted,
        "attempts_total": op.attempts_total,
        "attempts_in_progress": op.attempts_in_progress,
        "last_error": op.last_error,
        "created_at": _iso(op.created_at_ms),
        "updated_at": _iso(op.updated_at_ms),
        "next_attempt_at": _iso(op.next_attempt_at_ms)
        if op.state in (State.PENDING, State.IN_FLIGHT)
        else None,
        "first_attempt_at": _iso(op.first_attempt_at_ms),
        "version": op.version,
        "result": result,
    }


def attempt_dict(a: Attempt) -> dict[str, Any]:
    return {
        "number": a.number,
        "request_id": a.request_id,
        "dispatcher_id": a.dispatcher_id,
        "started_at": _iso(a.started_at_ms),
        "finished_at": _iso(a.finished_at_ms),
        "delivery": a.delivery.value if a.delivery else None,
        "verdict": a.verdict.value if a.verdict else None,
        "counted": a.counted,
        "status": a.status_code,
        "receiver_request_id": a.receiver_request_id,
        "error_class": a.error_class,
        "error_message": a.error_message,
        "duration_ms": a.duration_ms,
        "description": describe_attempt(a),
    }


def audit_dict(r: AuditRecord) -> dict[str, Any]:
    return {
        "at": _iso(r.at_ms),
        "actor": r.actor,
        "action": r.action,
        "from_state": r.from_state,
        "to_state": r.to_state,
        "note": r.note,
        "details": r.details,
    }


@dataclass(frozen=True)
class StatusReport:
    counts: dict[str, int]
    oldest_pending_age_seconds: float | None
    unresolved_by_reason: dict[str, int]
    attempts_last_hour: int
    keys_near_expiry: int
    problems: list[str] = field(default_factory=list)
    #: Dispatchers, per-endpoint backlog, last hour's attempts by outcome.
    watch: Watch | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            **(self.watch.as_dict() if self.watch is not None else {}),
            "counts": self.counts,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "reconciliation_backlog": sum(self.unresolved_by_reason.values()),
            "unresolved_by_reason": self.unresolved_by_reason,
            "attempts_last_hour": self.attempts_last_hour,
            "keys_near_expiry": self.keys_near_expiry,
            "problems": self.problems,
            "ok": not self.problems,
        }


class Reconciler:
    """The operator's view of an outbox. The CLI is a thin layer over this."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.store = outbox.store

    def _load(self, operation_id: str, tenant: str) -> Operation:
        op = self.store.get_operation(check_tenant(tenant), check_operation_id(operation_id))
        if op is None:
            raise OperationNotFound(f"no operation {operation_id!r} in tenant {tenant!r}")
        return op

    # -- reads --------------------------------------------------------------------

    def list(
        self,
        *,
        tenant: str | None = None,
        endpoint: str | None = None,
        reason: Reason | str | None = None,
        older_than: timedelta | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[Operation]:
        """Unresolved operations, oldest first, filtered and paged."""
        if limit < 1 or offset < 0:
            raise ValidationError("limit must be >= 1 and offset >= 0")
        cutoff = None
        if older_than is not None:
            cutoff = self.outbox.clock.now_ms() - int(older_than.total_seconds() * 1000)
        return self.store.list_operations(
            states=[State.UNRESOLVED],
            tenant=tenant,
            endpoint=endpoint,
            reason=Reason(reason) if reason is not None else None,
            older_than_ms=cutoff,
            limit=limit,
            offset=offset,
        )

    def show(self, operation_id: str, *, tenant: str = "") -> OperationReport:
        op = self._load(operation_id, tenant)
        return OperationReport(
            operation=op,
            explanation=explain(op),
            requeue_risk=self.requeue_risk(op),
            audit=self.store.audit_trail(op.tenant, op.operation_id),
            blocked_by=self.store.blocking_predecessor(op) if op.state is State.PENDING else None,
        )

    def requeue_risk(self, op: Operation) -> RequeueRisk:
        endpoint = self.outbox.endpoints.get(op.endpoint)
        if op.first_attempt_at_ms is None:
            return RequeueRisk(None, False, "no attempt was ever sent: requeue is safe")
        if endpoint is None:
            return RequeueRisk(
                None,
                None,
                f"endpoint {op.endpoint!r} is not registered here (pass --app): the key's "
                "retention is unknown, so requeue needs --accept-duplicate-risk",
            )
        expires = op.first_attempt_at_ms + int(endpoint.key_retention.total_seconds() * 1000)
        if op.attempts and all(a.delivery is Delivery.NOT_SENT for a in op.attempts):
            return RequeueRisk(expires, False, "no attempt ever left this machine: requeue is safe")
        # The dispatcher stops sending a margin before the receiver forgets the key; past
        # that point a requeue without accepting the risk would send nothing.
        usable = endpoint.key_retention - endpoint.margin
        sendable_until = op.first_attempt_at_ms + int(usable.total_seconds() * 1000)
        passed = self.outbox.clock.now_ms() >= sendable_until
        if passed:
            note = (
                "the receiver's key retention has passed since the first attempt: a resend "
                "may be treated as a new operation and applied twice"
            )
        else:
            note = (
                "the receiver still remembers the key: a resend under it replays the "
                "original result if the first attempt was applied"
            )
        return RequeueRisk(expires, passed, note)

    def status(
        self,
        *,
        max_unresolved: int | None = None,
        max_pending_age: timedelta | None = None,
        near_expiry: timedelta = timedelta(hours=1),
        max_near_expiry: int | None = None,
        dispatcher_timeout: timedelta = DEFAULT_DISPATCHER_TIMEOUT,
        require_dispatcher: bool = False,
        max_unsendable: int | None = None,
    ) -> StatusReport:
        """Counts and thresholds.

        ``require_dispatcher``: a problem when work is due and no dispatcher (running or
        stopped) was seen within ``dispatcher_timeout``. ``max_unsendable``: pending
        operations no dispatcher can send (say, an endpoint none registered).
        """
        now = self.outbox.clock.now_ms()
        seen = watch(self.outbox, now_ms=now, dispatcher_timeout=dispatcher_timeout)
        counts = {s.value: 0 for s in State}
        counts.update(self.store.state_counts())
        oldest = self.store.oldest_pending_created_ms()
        age = (now - oldest) / 1000 if oldest is not None else None
        reasons = self.store.reason_counts()
        near = 0
        for name, endpoint in self.outbox.endpoints.items():
            retention_ms = int((endpoint.key_retention - near_expiry).total_seconds() * 1000)
            near += self.store.keys_near_expiry(name, now - retention_ms)
        problems = []
        backlog = sum(reasons.values())
        if max_unresolved is not None and backlog > max_unresolved:
            problems.append(f"{backlog} unresolved operations (threshold {max_unresolved})")
        limit_s = max_pending_age.total_seconds() if max_pending_age is not None else None
        if limit_s is not None and age is not None and age > limit_s:
            problems.append(
                f"oldest pending operation is {age:.0f}s old (threshold {limit_s:.0f}s)"
            )
        if max_near_expiry is not None and near > max_near_expiry:
            problems.append(
                f"{near} live operations within {near_expiry} of key expiry "
                f"(threshold {max_near_expiry})"
            )
        last = max((d.row.last_seen_at_ms for d in seen.dispatchers), default=None)
        silent = last is None or now - last > dispatcher_timeout.total_seconds() * 1000
        if require_dispatcher and seen.backlog.due and silent:
            problems.append(
                f"{seen.backlog.due} operations are due and no dispatcher was seen in the last "
                f"{dispatcher_timeout.total_seconds():.0f}s"
                + ("" if last is None else f" (last seen {(now - last) / 1000:.0f}s ago)")
            )
        if max_unsendable is not None and seen.backlog.unsendable > max_unsendable:
            problems.append(
                f"{seen.backlog.unsendable} pending operations cannot be sent by any "
                f"dispatcher (threshold {max_unsendable}); see `outbox show`"
            )
        return StatusReport(
            watch=seen,
            counts=counts,
            oldest_pending_age_seconds=age,
            unresolved_by_reason=reasons,
            attempts_last_hour=self.store.attempts_since(now - 3_600_000),
            keys_near_expiry=near,
            problems=problems,
        )

    def probe(self, operation_id: str, *, tenant: str = "") -> lookup.ProbeOutcome:
        """Ask the receiver (the endpoint's status_lookup) and settle a definitive answer."""
        return lookup.probe(self.outbox, operation_id, tenant=tenant)

    def probe_all(
        self, *, endpoint: str | None = None, tenant: str | None = None
    ) -> builtins.list[lookup.ProbeOutcome]:
        """:meth:`probe` every unresolved operation (optionally filtered)."""
        return lookup.probe_all(self.outbox, endpoint=endpoint, tenant=tenant)

    # -- actions ------------------------------------------------------------------

    def _act(
        self,
        op: Operation,
        *,
        action: Action,
        to_state: State,
        values: dict[str, Any],
        note: str,
        operator: str | None,
        details: dict[str, Any] | None = None,
    ) -> Operation:
        note = _check_note(note)
        actor = _check_actor(operator or default_operator())
        now = self.outbox.clock.now_ms()
        ok = self.store.transition_by_operator(
            pk=op.pk,
            expected_version=op.version,
            from_state=op.state,
            values={**values, "state": to_state.value, "updated_at": now},
            audit_row={
                "tenant": op.tenant,
                "operation_id": op.operation_id,
                "actor": actor,
                "action": action.value,
                "from_state": op.state.value,
                "to_state": to_state.value,
                "note": note,
                "details": json.dumps(details, sort_keys=True) if details else None,
                "at": now,
            },
        )
        if not ok:
            raise ConcurrentModification(
                f"operation {op.operation_id!r} changed while you acted on it (someone else "
                "resolved, requeued or a dispatcher claimed it); nothing was written. "
                "Run `outbox reconcile show` again."
            )
        return self._load(op.operation_id, op.tenant)

    def resolve(
        self,
        operation_id: str,
        *,
        tenant: str = "",
        outcome: State | str,
        note: str,
        operator: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> Operation:
        """Settle an unresolved operation as succeeded or failed, with a note."""
        target = State(outcome)
        if target not in (State.SUCCEEDED, State.FAILED):
            raise ValidationError("resolve takes --as succeeded or --as failed")
        op = self._load(operation_id, tenant)
        if op.state is not State.UNRESOLVED:
            raise OperatorActionRefused(
                f"operation {operation_id!r} is {op.state.value}, not unresolved; only "
                "operations in the reconciliation queue can be resolved"
            )
        return self._act(
            op,
            action=Action.RESOLVE,
            to_state=target,
            values={"finished_at": self.outbox.clock.now_ms(), "next_attempt_at": None},
            note=note,
            operator=operator,
            details={"reason": op.reason.value if op.reason else None, **(details or {})},
        )

    def requeue(
        self,
        operation_id: str,
        *,
        tenant: str = "",
        note: str,
        operator: str | None = None,
        accept_duplicate_risk: bool = False,
    ) -> Operation:
        """Send an unresolved operation again under the same operation ID, in a new window."""
        op = self._load(operation_id, tenant)
        if op.state is not State.UNRESOLVED:
            raise OperatorActionRefused(
                f"operation {operation_id!r} is {op.state.value}, not unresolved; only "
                "operations in the reconciliation queue can be requeued"
            )
        risk = self.requeue_risk(op)
        risky = risk.key_retention_passed is not False and op.first_attempt_at_ms is not None
        if risky and not accept_duplicate_risk:
            raise OperatorActionRefused(
                f"refusing to requeue {operation_id!r}: {risk.note}. If you have checked "
                "that the receiver did not apply it, pass --accept-duplicate-risk"
            )
        now = self.outbox.clock.now_ms()
        values: dict[str, Any] = {
            "reason": None,
            "next_attempt_at": now,
            "window_started_at": None,
            "attempts_counted": 0,
            "attempts_in_progress": 0,
            "last_error": None,
            "finished_at": None,
        }
        never_sent = all(a.delivery is Delivery.NOT_SENT for a in op.attempts)
        if (risky and accept_duplicate_risk) or never_sent:
            # The receiver has forgotten the key, or never saw it: the key's life (and so
            # the key-retention bound on the window) starts again with the next attempt.
            values["first_attempt_at"] = None
        return self._act(
            op,
            action=Action.REQUEUE,
            to_state=State.PENDING,
            values=values,
            note=note,
            operator=operator,
            details={
                "reason": op.reason.value if op.reason else None,
                "accept_duplicate_risk": accept_duplicate_risk,
            },
        )

    def cancel(
        self, operation_id: str, *, tenant: str = "", note: str, operator: str | None = None
    ) -> Operation:
        """Cancel a pending operation no attempt of which may have reached the receiver."""
        op = self._load(operation_id, tenant)
        if op.state is not State.PENDING:
            raise OperatorActionRefused(
                f"operation {operation_id!r} is {op.state.value}; only pending operations "
                "can be cancelled (unresolved ones are resolved as failed instead)"
            )
        if any(a.delivery is not Delivery.NOT_SENT for a in op.attempts):
            raise OperatorActionRefused(
                f"operation {operation_id!r} has an attempt that may have reached the "
                "receiver; it cannot be cancelled"
            )
        return self._act(
            op,
            action=Action.CANCEL,
            to_state=State.CANCELLED,
            values={"next_attempt_at": None, "finished_at": self.outbox.clock.now_ms()},
            note=note,
            operator=operator,
        )

    def purge(self, *, older_than: timedelta, operator: str | None = None) -> dict[str, int]:
        """Delete terminal operations finished more than ``older_than`` ago."""
        if older_than <= timedelta(0):
            raise ValidationError("--older-than must be positive")
        now = self.outbox.clock.now_ms()
        removed = self.store.purge(finished_before_ms=now - int(older_than.total_seconds() * 1000))
        if removed:
            self.store.record_audit(
                {
                    "tenant": "",
                    "operation_id": "*",
                    "actor": _check_actor(operator or default_operator()),
                    "action": Action.PURGE.value,
                    "from_state": None,
                    "to_state": None,
                    "note": f"purged terminal operations older than {older_than}",
                    "details": json.dumps(removed, sort_keys=True),
                    "at": now,
                }
            )
        return removed


def _check_note(note: str) -> str:
    if not isinstance(note, str) or not note.strip():
        raise ValidationError("a note is required: say what you checked and why")
    if len(note) > _MAX_NOTE:
        raise ValidationError(f"the note is longer than {_MAX_NOTE} characters")
    return note


def _check_actor(actor: str) -> str:
    if not actor or len(actor) > 255 or re.search(r"[\x00-\x1f\x7f]", actor):
        raise ValidationError("operator name must be 1-255 printable characters")
    return actor
