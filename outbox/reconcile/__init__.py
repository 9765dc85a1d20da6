"""Operator actions over the reconciliation queue, and settling operations from what
their receiver says. Returns reports; never prints.

Every action is conditional on the operation's version as read (optimistic
concurrency): of two operators acting at once, one wins and the other gets
:class:`ConcurrentModification`; the winner's action and only it is in the audit trail.

The package: :mod:`.reports` (what an operator reads), :mod:`.actions` (resolve,
requeue, cancel, purge, each planned then applied), :mod:`.probe` (settling from a
status lookup; imported when a probe runs, as it brings httpx) and :mod:`.reconciler`
(:class:`Reconciler`, all of them).
"""

from outbox.base.durations import parse_duration
from outbox.reconcile.actions import (
    ACCEPT_RISK_EFFECT,
    OperatorActions,
    Plan,
    Refusal,
    check_actor,
    check_note,
    default_operator,
)
from outbox.reconcile.reconciler import Reconciler
from outbox.reconcile.reports import (
    OperationReport,
    RequeueRisk,
    StatusReport,
    attempt_dict,
    audit_dict,
    describe_attempt,
    explain,
    operation_dict,
)

__all__ = [
    "ACCEPT_RISK_EFFECT",
    "OperationReport",
    "OperatorActions",
    "Plan",
    "Reconciler",
    "Refusal",
    "RequeueRisk",
    "StatusReport",
    "attempt_dict",
    "audit_dict",
    "check_actor",
    "check_note",
    "default_operator",
    "describe_attempt",
    "explain",
    "operation_dict",
    "parse_duration",
]
