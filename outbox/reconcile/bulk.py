"""Operator actions over many operations at once: a selection, a dry run, a summary.

A bulk action reads the operations a :class:`Selection` matches, then acts on each
exactly as the single action does (:meth:`Reconciler.plan_resolve` and friends, then
:meth:`Reconciler.apply`): one audit row per operation, each under the optimistic
version check against the operation *as it was selected*. An operation that changed
since (another operator, a dispatcher's claim, a status lookup) is reported as
``changed_by_someone_else`` and left alone. A dry run plans every operation and writes
nothing. Returns reports; never prints.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from outbox.base.durations import format_duration
from outbox.errors import ConcurrentModification, ValidationError
from outbox.model import Operation, Reason, State
from outbox.reconcile import (
    Plan,
    Reconciler,
    Refusal,
    check_actor,
    check_note,
    default_operator,
)

__all__ = ["BulkGroup", "BulkItem", "BulkOutcome", "BulkReport", "Selection", "bulk"]


@dataclass(frozen=True, kw_only=True)
class Selection:
    """Which operations a bulk action takes. Ages are of the last change."""

    tenant: str | None = None
    endpoint: str | None = None
    reason: Reason | str | None = None
    older_than: timedelta | None = None
    newer_than: timedelta | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "endpoint": self.endpoint,
            "reason": Reason(self.reason).value if self.reason is not None else None,
            "older_than": format_duration(self.older_than) if self.older_than else None,
            "newer_than": format_duration(self.newer_than) if self.newer_than else None,
        }


class BulkOutcome(enum.StrEnum):
    """What happened to one operation of a bulk action (or would, in a dry run)."""

    CHANGED = "changed"
    #: The action does not apply to it (its state, or the duplicate risk): left alone.
    REFUSED = "refused"
    #: It changed between the selection and the action: left alone.
    CHANGED_BY_SOMEONE_ELSE = "changed_by_someone_else"


def _fields_dict(record: BulkItem | BulkGroup) -> dict[str, Any]:
    """A report row for JSON: its fields in order, the outcome as its value."""
    values = {f.name: getattr(record, f.name) for f in fields(record)}
    return {name: v.value if isinstance(v, enum.Enum) else v for name, v in values.items()}


@dataclass(frozen=True)
class BulkItem:
    tenant: str
    operation_id: str
    outcome: BulkOutcome
    #: The refusal's short reason (counted in the summary), else None.
    why: str | None = None
    #: The refusal's full message, or the (would-be) new state.
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return _fields_dict(self)


@dataclass(frozen=True)
class BulkGroup:
    """Operations of one bulk action that met the same fate, for a summary that stays
    short however many were selected."""

    outcome: BulkOutcome
    #: The refusal's short reason; for changed operations, the (would-be) new state.
    why: str
    count: int
    #: The first few operation IDs, in selection order (oldest first).
    first_ids: list[str]

    def as_dict(self) -> dict[str, Any]:
        return _fields_dict(self)


@dataclass
class BulkReport:
    action: str
    dry_run: bool
    selection: Selection
    items: list[BulkItem] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counted = Counter(item.outcome.value for item in self.items)
        return {outcome.value: counted.get(outcome.value, 0) for outcome in BulkOutcome}

    @property
    def refusals(self) -> dict[str, int]:
        """How many were refused, by short reason."""
        return dict(Counter(i.why for i in self.items if i.why is not None).most_common())

    def groups(self, first: int = 3) -> list[BulkGroup]:
        """The items grouped by outcome and reason, largest group first, each with its
        first ``first`` operation IDs."""
        seen: dict[tuple[BulkOutcome, str], list[str]] = {}
        for item in self.items:
            why = item.why or item.detail or item.outcome.value
            if item.outcome is BulkOutcome.CHANGED_BY_SOMEONE_ELSE:
                why = "it changed after it was selected"
            seen.setdefault((item.outcome, why), []).append(item.operation_id)
        order = list(BulkOutcome)
        groups = [
            BulkGroup(outcome, why, len(ids), ids[:first]) for (outcome, why), ids in seen.items()
        ]
        return sorted(groups, key=lambda g: (order.index(g.outcome), -g.count, g.why))

    @property
    def exit_ok(self) -> bool:
        """Everything selected was (or would be) changed."""
        return all(item.outcome is BulkOutcome.CHANGED for item in self.items)

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "dry_run": self.dry_run,
            "selection": self.selection.as_dict(),
            "matched": len(self.items),
            "counts": self.counts,
            "refusals": self.refusals,
            "groups": [g.as_dict() for g in self.groups()],
            "operations": [item.as_dict() for item in self.items],
        }


#: action -> (the state it applies to, whether planning needs the attempt history)
_ACTIONS: dict[str, tuple[State, bool]] = {
    "resolve": (State.UNRESOLVED, False),
    "requeue": (State.UNRESOLVED, True),
    "cancel": (State.PENDING, True),
}


def select(rec: Reconciler, action: str, selection: Selection) -> list[Operation]:
    """The operations a bulk ``action`` would take, oldest change first."""
    state, _ = _ACTIONS[action]
    if selection.reason is not None and state is not State.UNRESOLVED:
        raise ValidationError(f"--reason selects unresolved operations; {action} takes pending")
    where = rec.operation_filter(
        state,
        tenant=selection.tenant,
        endpoint=selection.endpoint,
        reason=selection.reason,
        older_than=selection.older_than,
        newer_than=selection.newer_than,
    )
    return rec.store.list_operations(where, limit=None)


def bulk(
    rec: Reconciler,
    action: str,
    selection: Selection,
    *,
    note: str,
    operator: str | None = None,
    dry_run: bool = False,
    outcome: State | str | None = None,
    accept_duplicate_risk: bool = False,
    selected: list[Operation] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    audit_details: dict[str, Any] | None = None,
) -> BulkReport:
    """Apply ``action`` ("resolve" with ``outcome``, "requeue" or "cancel") to every
    operation ``selection`` matches (or to ``selected``, from :func:`select`: what the
    operator confirmed), each on its own under the version check.

    ``on_progress(done, total)`` is called after each operation. ``audit_details``
    replaces the selection as what each audit row records of the bulk action (the
    console passes the filters of the listing the operator previewed).
    """
    if action not in _ACTIONS:
        raise ValidationError(f"unknown bulk action {action!r}")
    if action == "resolve" and outcome is None:
        raise ValidationError("resolve takes --as succeeded or --as failed")
    # Checked once up front (a dry run too): a bad note must not fail every operation.
    check_note(note)
    check_actor(operator or default_operator())
    _, needs_attempts = _ACTIONS[action]
    ops = selected if selected is not None else select(rec, action, selection)
    report = BulkReport(action=action, dry_run=dry_run, selection=selection)
    details = audit_details or {
        "bulk": {k: v for k, v in selection.as_dict().items() if v is not None}
    }
    for done, listed in enumerate(ops, start=1):
        report.items.append(
            _one(
                rec,
                action,
                listed,
                needs_attempts=needs_attempts,
                dry_run=dry_run,
                outcome=outcome,
                accept_duplicate_risk=accept_duplicate_risk,
                note=note,
                operator=operator,
                details=details,
            )
        )
        if on_progress is not None:
            on_progress(done, len(ops))
    return report


def _one(
    rec: Reconciler,
    action: str,
    listed: Operation,
    *,
    needs_attempts: bool,
    dry_run: bool,
    outcome: State | str | None,
    accept_duplicate_risk: bool,
    note: str,
    operator: str | None,
    details: dict[str, Any],
) -> BulkItem:
    def item(result: BulkOutcome, why: str | None = None, detail: str = "") -> BulkItem:
        return BulkItem(listed.tenant, listed.operation_id, result, why, detail)

    someone_else = item(
        BulkOutcome.CHANGED_BY_SOMEONE_ELSE,
        detail="it changed after it was selected (another operator, a dispatcher or a "
        "status lookup); nothing was written",
    )
    op: Operation | None = listed
    if needs_attempts:
        op = rec.store.get_operation(listed.tenant, listed.operation_id)
        if op is None or op.version != listed.version:
            return someone_else
    assert op is not None
    plan: Plan | Refusal
    if action == "resolve":
        assert outcome is not None
        plan = rec.plan_resolve(op, outcome)
    elif action == "requeue":
        plan = rec.plan_requeue(op, accept_duplicate_risk=accept_duplicate_risk)
    else:
        plan = rec.plan_cancel(op)
    if isinstance(plan, Refusal):
        return item(BulkOutcome.REFUSED, plan.why, plan.message)
    if dry_run:
        return item(BulkOutcome.CHANGED, detail=plan.to_state.value)
    plan = Plan(plan.action, plan.to_state, plan.values, {**plan.details, **details})
    try:
        rec.apply(op, plan, note=note, operator=operator)
    except ConcurrentModification:
        return someone_else
    return item(BulkOutcome.CHANGED, detail=plan.to_state.value)
