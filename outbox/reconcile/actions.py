"""Operator actions over the reconciliation queue. Returns reports; never prints.

Every action is conditional on the operation's version as read (optimistic
concurrency): of two operators acting at once, one wins and the other gets
:class:`ConcurrentModification`; the winner's action and only it is in the audit trail."""

from __future__ import annotations

import getpass
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from outbox.base.durations import format_duration
from outbox.base.safetext import check_printable
from outbox.canonical import check_operation_id, check_tenant, quoted
from outbox.errors import (
    ConcurrentModification,
    OperationNotFound,
    OperatorActionRefused,
    ValidationError,
)
from outbox.model import (
    Action,
    Delivery,
    Operation,
    PolicySnapshot,
    Reason,
    State,
    ms_to_iso,
)
from outbox.reconcile.reports import OperationReport, RequeueRisk, StatusReport, explain
from outbox.reconcile.status import DEFAULT_DISPATCHER_TIMEOUT, SETTLED_COUNT_LIMIT, watch
from outbox.store.browse import distinct_values, endpoint_in_use
from outbox.store.endpoints import Circuit, EndpointState
from outbox.store.operator import OperatorSelection

if TYPE_CHECKING:
    from outbox.reconcile.parts import OutboxParts


#: What ``--accept-duplicate-risk`` does, said wherever a requeue is refused for it.
ACCEPT_RISK_EFFECT = (
    "--accept-duplicate-risk requeues it anyway and restarts the key's life: the next "
    "attempt counts as the first, with a new retry window and key retention from then "
    "on. If the receiver applied an earlier attempt and has forgotten the key, that "
    "resend may cause a second effect (a second charge, a second order). Use it only "
    "after checking with the receiver that the operation was not applied"
)


_MAX_NOTE = 2000


def default_operator() -> str:
    try:
        return getpass.getuser()
    except Exception:
        return "unknown"


@dataclass(frozen=True)
class Plan:
    """An operator action checked against the operation as read, not yet applied."""

    action: Action
    to_state: State
    values: dict[str, Any]
    details: dict[str, Any]


@dataclass(frozen=True)
class Refusal:
    """Why an action does not apply: ``why`` is short and the same for alike cases (bulk
    summaries count by it); ``message`` names the operation and says what to do."""

    why: str
    message: str

    def error(self) -> OperatorActionRefused:
        return OperatorActionRefused(self.message)


class FilterArgs(TypedDict, total=False):
    """The filters of an operator's read or action over many operations: each one given
    narrows it. Ages are of the last change (for unresolved operations, how long they
    have been unresolved)."""

    tenant: str | None
    endpoint: str | None
    reason: Reason | str | None
    older_than: timedelta | None
    newer_than: timedelta | None


class OperatorActions:
    """The operator's view of an outbox and every action on it but the status-lookup
    probes (see :class:`~outbox.reconcile.Reconciler`, which adds those)."""

    def __init__(self, outbox: OutboxParts) -> None:
        self.outbox = outbox
        self.store = outbox.store

    def _load(self, operation_id: str, tenant: str) -> Operation:
        op = self.store.get_operation(check_tenant(tenant), check_operation_id(operation_id))
        if op is None:
            message = f"no operation {operation_id!r} in tenant {tenant!r}"
            elsewhere = self.store.tenants_holding(operation_id)
            if elsewhere:
                names = " and ".join(repr(t) for t in elsewhere[:3])
                message += (
                    f"; it exists in tenant {names}"
                    + (" and others" if len(elsewhere) > 3 else "")
                    + f" (pass --tenant {elsewhere[0] or chr(39) * 2})"
                )
            raise OperationNotFound(message)
        return op

    # -- reads --------------------------------------------------------------------

    def cutoff_ms(self, age: timedelta | None) -> int | None:
        if age is None:
            return None
        if age < timedelta(0):
            raise ValidationError("a duration filter must not be negative")
        return self.outbox.clock.now_ms() - int(age.total_seconds() * 1000)

    def operation_filter(self, state: State, **filters: Unpack[FilterArgs]) -> OperatorSelection:
        """The store's filter for operations in ``state`` (ages measured from now)."""
        unknown = filters.keys() - FilterArgs.__optional_keys__
        if unknown:  # a misspelt filter must not widen a read to everything
            raise TypeError(f"unexpected filter keyword(s) {sorted(unknown)}")
        reason = filters.get("reason")
        return OperatorSelection(
            states=[state],
            tenant=filters.get("tenant"),
            endpoint=filters.get("endpoint"),
            reason=Reason(reason) if reason is not None else None,
            older_than_ms=self.cutoff_ms(filters.get("older_than")),
            newer_than_ms=self.cutoff_ms(filters.get("newer_than")),
        )

    def unresolved(
        self, *, limit: int = 50, offset: int = 0, **filters: Unpack[FilterArgs]
    ) -> list[Operation]:
        """Unresolved operations, oldest first, filtered (see :class:`FilterArgs`) and
        paged."""
        if limit < 1 or offset < 0:
            raise ValidationError("limit must be >= 1 and offset >= 0")
        where = self.operation_filter(State.UNRESOLVED, **filters)
        return self.store.list_operations(where, limit=limit, offset=offset)

    def count(self, **filters: Unpack[FilterArgs]) -> int:
        """How many unresolved operations match (what :meth:`unresolved` pages through)."""
        return self.store.count_operations(self.operation_filter(State.UNRESOLVED, **filters))

    def show(self, operation_id: str, *, tenant: str = "") -> OperationReport:
        op = self._load(operation_id, tenant)
        return OperationReport(
            operation=op,
            explanation=explain(op),
            requeue_risk=self.requeue_risk(op),
            audit=self.store.audit_trail(op.tenant, op.operation_id),
            blocked_by=self.store.blocking_predecessor(op) if op.state is State.PENDING else None,
        )

    def policy_of(self, op: Operation) -> tuple[PolicySnapshot | None, str]:
        """The policy the operation lives under and where it came from: the row's
        snapshot, else the registered endpoint's (``--app``), else unknown."""
        if op.policy is not None:
            return op.policy, "snapshot"
        endpoint = self.outbox.endpoints.get(op.endpoint)
        if endpoint is not None:
            return endpoint.policy_snapshot(), "endpoint"
        return None, "unknown"

    def requeue_risk(self, op: Operation) -> RequeueRisk:
        """Whether the receiver may have forgotten the key, from the database alone
        (the policy snapshot); the application is needed only for rows older than it."""
        policy, source = self.policy_of(op)
        if op.first_attempt_at_ms is None:
            return RequeueRisk(None, False, "no attempt was ever sent: requeue is safe", source)
        expires = None
        if policy is not None:
            expires = policy.key_expires_at_ms(op.first_attempt_at_ms)
        if op.attempts and all(a.delivery is Delivery.NOT_SENT for a in op.attempts):
            return RequeueRisk(
                expires, False, "no attempt ever left this machine: requeue is safe", source
            )
        if policy is None:
            return RequeueRisk(
                None,
                None,
                f"the retry policy of {op.operation_id!r} is unknown (it was enqueued before "
                "outbox kept a policy snapshot and no dispatcher has claimed it since), so "
                "the receiver's key retention is unknown; --app naming an application that "
                f"registers endpoint {op.endpoint!r} supplies it",
                source,
            )
        # The dispatcher stops sending a margin before the receiver forgets the key; past
        # that point a requeue without accepting the risk would send nothing.
        passed = self.outbox.clock.now_ms() >= policy.key_usable_until_ms(op.first_attempt_at_ms)
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
        return RequeueRisk(expires, passed, note, source)

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
        settled: bool = True,
        settled_limit: int | None = SETTLED_COUNT_LIMIT,
    ) -> StatusReport:
        """Counts and thresholds.

        ``require_dispatcher``: a problem when work is due and no dispatcher (running or
        stopped) was seen within ``dispatcher_timeout``. ``max_unsendable``: pending
        operations no dispatcher can send (say, an endpoint none registered).
        ``settled=False``: the settled states' counts are not read (None), so the read
        touches the live rows only, however long the history. ``settled_limit``: they are
        counted only when there are at most that many (else None, and
        ``figures.settled_over`` says so), a bounded read; None counts them all.
        """
        now = self.outbox.clock.now_ms()
        seen = watch(
            self.outbox,
            now_ms=now,
            dispatcher_timeout=dispatcher_timeout,
            near=near_expiry,
            settled=settled,
            settled_limit=settled_limit,
        )
        fig = seen.figures
        age = fig.oldest_pending_age_seconds
        near = fig.near_key_expiry
        problems = []
        backlog = fig.reconciliation_queue
        if max_unresolved is not None and backlog > max_unresolved:
            problems.append(f"{backlog} unresolved operations (threshold {max_unresolved})")
        limit_s = max_pending_age.total_seconds() if max_pending_age is not None else None
        if limit_s is not None and age is not None and age > limit_s:
            problems.append(
                f"oldest pending operation is {age:.0f}s old (threshold {limit_s:.0f}s)"
            )
        if max_near_expiry is not None and near > max_near_expiry:
            problems.append(
                f"{near} live operations within {format_duration(near_expiry)} of key expiry "
                f"(threshold {max_near_expiry})"
            )
        last = max((d.row.last_seen_at_ms for d in seen.dispatchers), default=None)
        silent = last is None or now - last > dispatcher_timeout.total_seconds() * 1000
        if require_dispatcher and fig.due and silent:
            problems.append(
                f"{fig.due} operations are due and no dispatcher was seen in the last "
                f"{dispatcher_timeout.total_seconds():.0f}s"
                + ("" if last is None else f" (last seen {(now - last) / 1000:.0f}s ago)")
            )
        if max_unsendable is not None and fig.unsendable > max_unsendable:
            problems.append(
                f"{fig.unsendable} pending operations cannot be sent by any "
                f"dispatcher (threshold {max_unsendable}); see `outbox show`"
            )
        for e in fig.endpoint_states:
            if e.circuit is not Circuit.CLOSED and not e.paused:
                problems.append(
                    f"endpoint {e.name}: circuit {e.circuit.value} since "
                    f"{ms_to_iso(e.since)}: {e.reason}"
                )
        return StatusReport(figures=fig, problems=problems, watch=seen)

    # -- actions ------------------------------------------------------------------

    def apply(self, op: Operation, plan: Plan, *, note: str, operator: str | None) -> Operation:
        """Apply a plan to the operation as it was read: only if its version is still the
        one read (else :class:`ConcurrentModification`), with its audit row, in one
        transaction."""
        note = check_note(note)
        actor = check_actor(operator or default_operator())
        now = self.outbox.clock.now_ms()
        ok = self.store.transition_by_operator(
            pk=op.pk,
            expected_version=op.version,
            from_state=op.state,
            values={**plan.values, "state": plan.to_state.value, "updated_at": now},
            audit_row={
                "tenant": op.tenant,
                "operation_id": op.operation_id,
                "actor": actor,
                "action": plan.action.value,
                "from_state": op.state.value,
                "to_state": plan.to_state.value,
                "note": note,
                "details": json.dumps(plan.details, sort_keys=True) if plan.details else None,
                "at": now,
            },
        )
        if not ok:
            raise ConcurrentModification(
                f"operation {op.operation_id!r} changed while you acted on it (someone else "
                "resolved, requeued or a dispatcher claimed it); nothing was written. "
                "Run `outbox reconcile show` again.",
                tenant=op.tenant,
                operation_id=op.operation_id,
            )
        return self._load(op.operation_id, op.tenant)

    @staticmethod
    def _not_in(op: Operation, expected: State, verb: str) -> Refusal:
        return Refusal(
            f"is {op.state.value}",
            f"operation {op.operation_id!r} is {op.state.value}, not {expected.value}; only "
            f"operations in the reconciliation queue can be {verb}",
        )

    def plan_resolve(self, op: Operation, outcome: State | str) -> Plan | Refusal:
        """Settling ``op`` as succeeded or failed, or why it does not apply."""
        target = State(outcome)
        if target not in (State.SUCCEEDED, State.FAILED):
            raise ValidationError("resolve takes --as succeeded or --as failed")
        if op.state is not State.UNRESOLVED:
            return self._not_in(op, State.UNRESOLVED, "resolved")
        return Plan(
            action=Action.RESOLVE,
            to_state=target,
            values={"finished_at": self.outbox.clock.now_ms(), "next_attempt_at": None},
            details={"reason": op.reason.value if op.reason else None},
        )

    def plan_requeue(self, op: Operation, *, accept_duplicate_risk: bool = False) -> Plan | Refusal:
        """Requeueing ``op`` (which needs its attempts), or why it does not apply."""
        if op.state is not State.UNRESOLVED:
            return self._not_in(op, State.UNRESOLVED, "requeued")
        risk = self.requeue_risk(op)
        risky = risk.key_retention_passed is not False and op.first_attempt_at_ms is not None
        if risky and not accept_duplicate_risk:
            why = "policy unknown" if risk.key_retention_passed is None else "key retention passed"
            return Refusal(
                f"{why}: needs --accept-duplicate-risk",
                f"refusing to requeue {op.operation_id!r}: {risk.note}. {ACCEPT_RISK_EFFECT}",
            )
        values: dict[str, Any] = {
            "reason": None,
            "next_attempt_at": self.outbox.clock.now_ms(),
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
        return Plan(
            action=Action.REQUEUE,
            to_state=State.PENDING,
            values=values,
            details={
                "reason": op.reason.value if op.reason else None,
                "accept_duplicate_risk": accept_duplicate_risk,
                "policy_source": risk.policy_source,
            },
        )

    def plan_cancel(self, op: Operation) -> Plan | Refusal:
        """Cancelling ``op`` (which needs its attempts), or why it does not apply."""
        if op.state is not State.PENDING:
            return Refusal(
                f"is {op.state.value}",
                f"operation {op.operation_id!r} is {op.state.value}; only pending operations "
                "can be cancelled (unresolved ones are resolved as failed instead)",
            )
        if any(a.delivery is not Delivery.NOT_SENT for a in op.attempts):
            return Refusal(
                "an attempt may have reached the receiver",
                f"operation {op.operation_id!r} has an attempt that may have reached the "
                "receiver; it cannot be cancelled",
            )
        return Plan(
            action=Action.CANCEL,
            to_state=State.CANCELLED,
            values={"next_attempt_at": None, "finished_at": self.outbox.clock.now_ms()},
            details={},
        )

    def _carry_out(
        self, op: Operation, plan: Plan | Refusal, *, note: str, operator: str | None
    ) -> Operation:
        if isinstance(plan, Refusal):
            raise plan.error()
        return self._act(op, plan, note=note, operator=operator)

    def _act(self, op: Operation, plan: Plan, *, note: str, operator: str | None) -> Operation:
        """The single actions' write: a hook subclasses override (the console's guarded,
        dry-run reconciler)."""
        return self.apply(op, plan, note=note, operator=operator)

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
        State(outcome)  # a bad outcome is a usage error before the lookup
        op = self._load(operation_id, tenant)
        plan = self.plan_resolve(op, outcome)
        if isinstance(plan, Plan) and details:
            plan = Plan(plan.action, plan.to_state, plan.values, {**plan.details, **details})
        return self._carry_out(op, plan, note=note, operator=operator)

    def requeue(
        self,
        operation_id: str,
        *,
        tenant: str = "",
        note: str,
        operator: str | None = None,
        accept_duplicate_risk: bool = False,
    ) -> Operation:
        """Send an unresolved operation again under the same operation ID, in a new window.

        Refused (:class:`OperatorActionRefused`) when the receiver may have forgotten the
        key, judged from the policy stored on the row, unless ``accept_duplicate_risk``.
        """
        op = self._load(operation_id, tenant)
        plan = self.plan_requeue(op, accept_duplicate_risk=accept_duplicate_risk)
        return self._carry_out(op, plan, note=note, operator=operator)

    def cancel(
        self, operation_id: str, *, tenant: str = "", note: str, operator: str | None = None
    ) -> Operation:
        """Cancel a pending operation no attempt of which may have reached the receiver."""
        op = self._load(operation_id, tenant)
        return self._carry_out(op, self.plan_cancel(op), note=note, operator=operator)

    def purge(
        self,
        *,
        older_than: timedelta,
        operator: str | None = None,
        dry_run: bool = False,
        on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, int]:
        """Delete terminal operations finished more than ``older_than`` ago; with
        ``dry_run``, only count them. Returns the count per state."""
        if older_than <= timedelta(0):
            raise ValidationError("--older-than must be positive")
        # Checked before anything is deleted: a refused purge deletes nothing.
        actor = check_actor(operator or default_operator())
        now = self.outbox.clock.now_ms()
        cutoff = now - int(older_than.total_seconds() * 1000)
        if dry_run:
            return self.store.purgeable_counts(finished_before_ms=cutoff)
        removed = self.store.purge(finished_before_ms=cutoff, on_batch=on_batch)
        if removed:
            self.store.record_audit(
                {
                    "tenant": "",
                    "operation_id": "*",
                    "actor": actor,
                    "action": Action.PURGE.value,
                    "from_state": None,
                    "to_state": None,
                    "note": f"purged terminal operations older than {older_than}",
                    "details": json.dumps(removed, sort_keys=True),
                    "at": now,
                }
            )
        return removed

    def set_endpoint_paused(
        self, name: str, *, paused: bool, note: str, operator: str | None = None
    ) -> EndpointState:
        """Pause an endpoint (planned maintenance: nothing of it is claimed, nothing is
        spent) or resume it, audited in the same transaction. The note and the operator
        are checked as for every other action, and ``name`` must be an endpoint this
        outbox knows (registered, with a fleet state, or named by a stored operation): a
        typo is refused rather than paused while the real endpoint goes on sending."""
        check_note(note)
        actor = check_actor(operator or default_operator())
        now = self.outbox.clock.now_ms()
        known = set(self.outbox.endpoints) | {s.name for s in self.store.endpoint_states()}
        if name not in known and not endpoint_in_use(self.store, name):
            # Only on the way to a refusal: every name the operator might have meant.
            named = sorted(known | set(distinct_values(self.store)[0]))
            listed = ", ".join(named[:10]) + (", ..." if len(named) > 10 else "")
            raise ValidationError(
                f"no endpoint {quoted(name, 64)} is known to this outbox (none registered "
                f"by that name, no fleet state, no stored operation); known: {listed or '-'}"
            )
        return self.store.set_paused(name, paused=paused, now_ms=now, actor=actor, note=note)

    def vacuum(self) -> tuple[int | None, int | None]:
        """SQLite: give deleted rows' space back to the file system. Returns the bytes on
        disk before and after; a :class:`StoreError` on PostgreSQL (autovacuum's job)."""
        before = self.store.database_bytes()
        self.store.vacuum()
        return before, self.store.database_bytes()


def check_note(note: str) -> str:
    if not isinstance(note, str) or not note.strip():
        raise ValidationError("a note is required: say what you checked and why")
    if len(note) > _MAX_NOTE:
        raise ValidationError(f"the note is longer than {_MAX_NOTE} characters")
    return check_printable(note, "note")


def check_actor(actor: str) -> str:
    if not actor or len(actor) > 255 or re.search(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]", actor):
        raise ValidationError("operator name must be 1-255 printable characters")
    return actor
