"""Browsing an outbox, and operator actions guarded by the version the operator saw.

The web console (``outbox console``) is a thin layer over this module and
:class:`~outbox.reconcile.Reconciler`: filtered pages with totals, the audit log, the
overview's aggregates, and :class:`GuardedReconciler`, which runs the Reconciler's own
actions (every rule in one place) either only on the version of the operation that was
shown to the operator, or as a dry run that checks every rule and writes nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Generic, TypeVar

from outbox.errors import (
    ConcurrentModification,
    ValidationError,
)
from outbox.model import Operation, Reason, State
from outbox.reconcile import (
    Plan,
    Reconciler,
    StatusReport,
    check_actor,
    check_note,
    default_operator,
)
from outbox.reconcile.bulk import BulkItem, BulkOutcome, BulkReport, Selection, bulk
from outbox.reconcile.history import EndpointLatency, QueueHistory, endpoint_latency, queue_history
from outbox.reconcile.probe import probe, skip_reason
from outbox.reconcile.status import DEFAULT_DISPATCHER_TIMEOUT, Watch, watch
from outbox.store import browse as sql
from outbox.store.rows import AuditRecord

if TYPE_CHECKING:
    from outbox.reconcile.parts import OutboxParts

T = TypeVar("T")

MAX_PAGE = 500


@dataclass(frozen=True)
class Page(Generic[T]):
    items: list[T]
    total: int
    offset: int
    limit: int

    @property
    def first(self) -> int:
        """1-based index of the first item shown (0 when empty)."""
        return self.offset + 1 if self.items else 0

    @property
    def last(self) -> int:
        return self.offset + len(self.items)

    @property
    def has_previous(self) -> bool:
        return self.offset > 0

    @property
    def has_next(self) -> bool:
        return self.offset + len(self.items) < self.total


@dataclass(frozen=True)
class OperationFilter:
    """What to list. ``older_than`` is the operation's age (since it was enqueued);
    ``id_contains`` matches any part of the operation ID, literally."""

    states: tuple[State, ...] = ()
    reason: Reason | None = None
    endpoint: str | None = None
    tenant: str | None = None
    older_than: timedelta | None = None
    id_contains: str | None = None

    def __post_init__(self) -> None:
        if self.id_contains is not None and len(self.id_contains) > 255:
            raise ValidationError("the operation ID search is longer than 255 characters")
        if self.older_than is not None and self.older_than < timedelta(0):
            raise ValidationError("the age filter must not be negative")


@dataclass(frozen=True)
class Facets:
    endpoints: list[str]
    tenants: list[str]
    actors: list[str]


@dataclass(frozen=True)
class Overview:
    """``outbox status``'s report (counts, reasons, per-endpoint backlog, attempts by
    outcome, dispatchers as live, stopped or lost), for the console's first page."""

    status: StatusReport
    watch: Watch
    dispatcher_timeout: timedelta
    endpoints_registered: list[str]
    now_ms: int
    #: The reconciliation queue's size minute by minute over the last hour.
    queue: QueueHistory | None = None
    #: Each endpoint's attempt latency over the last hour.
    latency: list[EndpointLatency] = dataclasses.field(default_factory=list)


class Browser:
    """Read-only views of an outbox, paged with totals."""

    def __init__(self, outbox: OutboxParts) -> None:
        self.outbox = outbox
        self.store = outbox.store

    @staticmethod
    def _check_page(limit: int, offset: int) -> None:
        if not 1 <= limit <= MAX_PAGE or offset < 0:
            raise ValidationError(f"limit must be 1-{MAX_PAGE} and offset >= 0")

    def _query(self, flt: OperationFilter) -> sql.OperationQuery:
        cutoff = None
        if flt.older_than is not None:
            cutoff = self.outbox.clock.now_ms() - int(flt.older_than.total_seconds() * 1000)
        return sql.OperationQuery(
            states=flt.states,
            reason=flt.reason,
            endpoint=flt.endpoint,
            tenant=flt.tenant,
            created_before_ms=cutoff,
            id_contains=flt.id_contains or None,
        )

    def operations(
        self,
        flt: OperationFilter = OperationFilter(),
        *,
        newest_first: bool = False,
        limit: int = 50,
        offset: int = 0,
    ) -> Page[Operation]:
        """Operations matching ``flt`` (without their attempts), oldest first by default."""
        self._check_page(limit, offset)
        items, total = sql.operations_page(
            self.store, self._query(flt), newest_first=newest_first, limit=limit, offset=offset
        )
        return Page(items, total, offset, limit)

    def audit_log(
        self,
        *,
        actor: str | None = None,
        since_ms: int | None = None,
        until_ms: int | None = None,
        operation_id: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> Page[AuditRecord]:
        """Every operator action, newest first."""
        self._check_page(limit, offset)
        items, total = sql.audit_page(
            self.store,
            sql.AuditQuery(actor, since_ms, until_ms, operation_id),
            limit=limit,
            offset=offset,
        )
        return Page(items, total, offset, limit)

    def facets(self) -> Facets:
        endpoints, tenants, actors = sql.distinct_values(self.store)
        return Facets(endpoints, tenants, actors)

    def overview(self) -> Overview:
        timeout = DEFAULT_DISPATCHER_TIMEOUT
        report = Reconciler(self.outbox).status(dispatcher_timeout=timeout)
        now = self.outbox.clock.now_ms()
        seen = report.watch or watch(self.outbox, now_ms=now, dispatcher_timeout=timeout)
        return Overview(
            status=report,
            watch=seen,
            dispatcher_timeout=timeout,
            endpoints_registered=sorted(self.outbox.endpoints),
            now_ms=now,
            queue=queue_history(self.outbox, now_ms=report.figures.now_ms),
            latency=endpoint_latency(self.outbox, now_ms=report.figures.now_ms),
        )


class GuardedReconciler(Reconciler):
    """The Reconciler's actions, guarded by the version the operator saw, or dry.

    ``expected_version``: the action is refused with :class:`ConcurrentModification`
    unless the operation is still at that version when it is read, and the write itself
    is conditional on the same version (as every Reconciler action is). ``dry_run``:
    every check runs (state, requeue risk, note, operator) and nothing is written; the
    operation returned is the one that would result.
    """

    def __init__(
        self, outbox: OutboxParts, *, expected_version: int | None = None, dry_run: bool = False
    ) -> None:
        super().__init__(outbox)
        self._expected = expected_version
        self.dry_run = dry_run

    def _load(self, operation_id: str, tenant: str) -> Operation:
        op = super()._load(operation_id, tenant)
        expected, self._expected = self._expected, None  # only the first read is checked
        if expected is not None and op.version != expected:
            raise ConcurrentModification(
                f"operation {operation_id!r} changed since it was shown (version "
                f"{expected}, now {op.version}: {op.state.value}); nothing was written"
            )
        return op

    def _act(self, op: Operation, plan: Plan, *, note: str, operator: str | None) -> Operation:
        if not self.dry_run:
            return super()._act(op, plan, note=note, operator=operator)
        check_note(note)
        check_actor(operator or default_operator())
        to_state = plan.to_state
        return dataclasses.replace(
            op, state=to_state, reason=None if to_state is not State.UNRESOLVED else op.reason
        )


BULK_ACTIONS = ("resolve", "requeue", "cancel", "probe")


def probe_refusal(outbox: OutboxParts, op: Operation) -> str | None:
    """Why :func:`outbox.reconcile.probe.probe` would not look ``op`` up, or None if it would."""
    if op.state is not State.UNRESOLVED:
        return f"operation {op.operation_id!r} is {op.state.value}, not unresolved"
    return skip_reason(outbox, op)


def _someone_else(tenant: str, operation_id: str, version: int, now: Operation | None) -> BulkItem:
    state = "it is gone" if now is None else f"now version {now.version}: {now.state.value}"
    return BulkItem(
        tenant,
        operation_id,
        BulkOutcome.CHANGED_BY_SOMEONE_ELSE,
        detail=f"operation {operation_id!r} changed since it was shown (version {version}, "
        f"{state}); nothing was written",
    )


def _probe_one(outbox: OutboxParts, op: Operation, *, dry_run: bool) -> BulkItem:
    refusal = probe_refusal(outbox, op)
    if refusal is not None:
        return BulkItem(op.tenant, op.operation_id, BulkOutcome.REFUSED, "cannot probe",
                        f"cannot probe {op.operation_id!r}: {refusal}")  # fmt: skip
    if dry_run:
        return BulkItem(op.tenant, op.operation_id, BulkOutcome.CHANGED, None,
                        "would ask the receiver")  # fmt: skip
    outcome = probe(outbox, op.operation_id, tenant=op.tenant)
    detail = f"{outcome.action.value}, now {outcome.state.value}: {outcome.detail}"
    return BulkItem(op.tenant, op.operation_id, BulkOutcome.CHANGED, None, detail)


def bulk_action(
    outbox: OutboxParts,
    targets: list[tuple[str, str, int]],
    *,
    action: str,
    note: str,
    operator: str,
    outcome: str | None = None,
    accept_duplicate_risk: bool = False,
    dry_run: bool,
    filters: dict[str, str] | None = None,
) -> BulkReport:
    """Apply (or preview) one action to each ``(tenant, operation_id, version)``: the
    console's bulk actions, through the CLI's engine (:func:`outbox.reconcile.bulk.bulk`)
    and in its words (changed, refused, changed by someone else).

    An operation no longer at the version the operator was shown is left alone. One
    refused or changed operation does not stop the others. ``filters`` (the listing the
    operator previewed) go into each audit row under ``bulk``, as the CLI's do.
    """
    if action not in BULK_ACTIONS:
        raise ValidationError(f"bulk action must be one of {', '.join(BULK_ACTIONS)}")
    if action == "resolve" and outcome not in ("succeeded", "failed"):
        raise ValidationError("resolve needs an outcome: succeeded or failed")
    if action != "probe":  # a probe's settlement is audited with the receiver's answer
        check_note(note)
    check_actor(operator)
    details = {"bulk": {k: v for k, v in (filters or {}).items() if v}, "via": "console"}
    rec = Reconciler(outbox)
    report = BulkReport(action=action, dry_run=dry_run, selection=Selection())
    for tenant, operation_id, version in targets:
        op = rec.store.get_operation(tenant, operation_id, with_attempts=action == "probe")
        if op is None or op.version != version:
            report.items.append(_someone_else(tenant, operation_id, version, op))
            continue
        if action == "probe":
            report.items.append(_probe_one(outbox, op, dry_run=dry_run))
            continue
        one = bulk(
            rec,
            action,
            Selection(),
            note=note,
            operator=operator,
            dry_run=dry_run,
            outcome=outcome,
            accept_duplicate_risk=accept_duplicate_risk,
            selected=[op],
            audit_details=details,
        )
        report.items.extend(one.items)
    return report
