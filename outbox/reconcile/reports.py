"""What an operator reads: an operation's story in plain words, and the reports of the
operator commands."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.forms import body_view
from outbox.model import (
    Attempt,
    Delivery,
    ErrorClass,
    Operation,
    Reason,
    State,
    Verdict,
    ms_to_iso,
)
from outbox.reconcile.status import Figures, Watch, endpoint_state_dict
from outbox.store.rows import AuditRecord
from outbox.store.sealing import Sealed

if TYPE_CHECKING:
    pass


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
    if attempt.error_class == ErrorClass.STORED_FAILURE_REPLAYED:
        marker = (attempt.error_message or "").split(";", 1)[0]
        return (
            f"attempt {n}: the receiver replayed the {attempt.status_code} it stored for this "
            f"key ({marker}), so every retry would get the same answer; whether the first "
            "request was applied is not known"
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
                f'the receiver answered "still processing" {op.attempts_in_progress} times, '
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
    if op.state is State.FAILED:
        return _why_failed(op)
    return op.state.value


def _why_failed(op: Operation) -> str:
    """``failed``: which answer settled it, from which attempt (or that an operator did)."""
    last = next((a for a in reversed(op.attempts) if a.delivery is not None), None)
    if last is None or last.verdict is not Verdict.FAILED:
        return "failed: settled by an operator (see the audit trail)"
    answer = (
        f"the receiver refused it with {last.status_code}"
        if last.status_code is not None
        else f"attempt {last.number} ended with {last.error_class or 'a definitive refusal'}"
    )
    if last.receiver_request_id:
        answer += f" (receiver request {last.receiver_request_id})"
    return f"failed: {answer}, answering attempt {last.number} of {op.attempts_total}"


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
                "key_expires_at": ms_to_iso(self.requeue_risk.key_expires_at_ms),
                "key_retention_passed": self.requeue_risk.key_retention_passed,
                "note": self.requeue_risk.note,
                "policy_source": self.requeue_risk.policy_source,
            },
            "attempts": [attempt_dict(a) for a in op.attempts],
            "audit": [audit_dict(r) for r in self.audit],
        }


def _opened(value: Any) -> Any:
    """A body as JSON can carry it: an encrypted one no key here opens says so."""
    return str(value) if isinstance(value, Sealed) else value


def operation_dict(op: Operation) -> dict[str, Any]:
    """The stable JSON shape of an operation (the manual, "JSON shapes")."""
    result = None
    if op.result is not None:
        result = {
            "status": op.result.status_code,
            "headers": op.result.headers,
            "body": _opened(op.result.body),
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
        "body": _opened(op.body),
        "body_view": {"kind": "encrypted", "note": str(op.body)}
        if isinstance(op.body, Sealed)
        else body_view(op.content_type, op.body_bytes),
        "state": op.state.value,
        "reason": op.reason.value if op.reason else None,
        "ordering_key": op.ordering_key,
        "priority": op.priority,
        "not_before": ms_to_iso(op.not_before_ms),
        # The operation's own business deadline, when enqueue set one (None: the
        # endpoint's RetryPolicy.deliver_within).
        "deliver_within_ms": op.deliver_within_ms,
        "deliver_by": None
        if op.deliver_within_ms is None
        else ms_to_iso(op.created_at_ms + op.deliver_within_ms),
        "attempts_counted": op.attempts_counted,
        "attempts_total": op.attempts_total,
        "attempts_in_progress": op.attempts_in_progress,
        "last_error": op.last_error,
        "created_at": ms_to_iso(op.created_at_ms),
        "updated_at": ms_to_iso(op.updated_at_ms),
        "next_attempt_at": ms_to_iso(op.next_attempt_at_ms)
        if op.state in (State.PENDING, State.IN_FLIGHT)
        else None,
        "first_attempt_at": ms_to_iso(op.first_attempt_at_ms),
        "version": op.version,
        "result": result,
    }


def attempt_dict(a: Attempt) -> dict[str, Any]:
    return {
        "number": a.number,
        "request_id": a.request_id,
        "dispatcher_id": a.dispatcher_id,
        "started_at": ms_to_iso(a.started_at_ms),
        "finished_at": ms_to_iso(a.finished_at_ms),
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
        "at": ms_to_iso(r.at_ms),
        "actor": r.actor,
        "action": r.action,
        "from_state": r.from_state,
        "to_state": r.to_state,
        "note": r.note,
        "details": r.details,
    }


@dataclass(frozen=True)
class StatusReport:
    """``outbox status``: the operator figures (:class:`~outbox.reconcile.status.Figures`,
    the one computation every view renders), the dispatchers and the problems found."""

    figures: Figures
    problems: list[str] = field(default_factory=list)
    #: Dispatchers, and the same figures.
    watch: Watch | None = None

    @property
    def counts(self) -> dict[str, int | None]:
        return self.figures.counts

    @property
    def oldest_pending_age_seconds(self) -> float | None:
        return self.figures.oldest_pending_age_seconds

    @property
    def unresolved_by_reason(self) -> dict[str, int]:
        return self.figures.unresolved_by_reason

    @property
    def attempts_last_hour(self) -> int:
        return self.figures.attempts_last_hour

    @property
    def keys_near_expiry(self) -> int:
        return self.figures.near_key_expiry

    @property
    def keys_expired(self) -> int:
        return self.figures.key_expired

    def as_dict(self) -> dict[str, Any]:
        return {
            **(self.watch.as_dict() if self.watch is not None else {}),
            "counts": self.counts,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "reconciliation_backlog": self.figures.reconciliation_queue,
            "unresolved_by_reason": self.unresolved_by_reason,
            "attempts_last_hour": self.attempts_last_hour,
            "keys_near_expiry": self.keys_near_expiry,
            "keys_expired": self.keys_expired,
            "figures": self.figures.as_dict(),
            "endpoint_states": [
                endpoint_state_dict(e, self.figures.limits.get(e.name))
                for e in self.figures.endpoint_states
            ],
            "problems": self.problems,
            "ok": not self.problems,
        }


@dataclass(frozen=True)
class RequeueRisk:
    key_expires_at_ms: int | None
    key_retention_passed: bool | None  #: None when the operation's policy is unknown
    note: str
    #: Where the policy came from: "snapshot" (stored on the row), "endpoint" (the
    #: application's registered endpoint, for rows older than snapshots) or "unknown".
    policy_source: str = "snapshot"
