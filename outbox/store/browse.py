"""Read-only SQL for browsing an outbox: filtered pages with totals and the audit log.
Used by :mod:`outbox.reconcile.browse` (the web console's library); the overview's aggregates are
``outbox status``'s own (:mod:`outbox.store.monitoring`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select

from outbox.model import Operation, Reason, State
from outbox.store.base import Store
from outbox.store.rows import (
    NEWEST_FIRST,
    OLDEST_FIRST,
    AuditRecord,
    audit_from_row,
    operation_from_row,
)
from outbox.store.tables import audit, operations


@dataclass(frozen=True, slots=True)
class OperationQuery:
    """Filters over ``outbox_operations``; ``None`` or empty means no filter."""

    states: tuple[State, ...] = ()
    reason: Reason | None = None
    endpoint: str | None = None
    tenant: str | None = None
    created_before_ms: int | None = None
    id_contains: str | None = None


@dataclass(frozen=True, slots=True)
class AuditQuery:
    actor: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    operation_id: str | None = None


def _where(query: Any, q: OperationQuery) -> Any:
    if q.states:
        query = query.where(operations.c.state.in_([s.value for s in q.states]))
    if q.reason is not None:
        query = query.where(operations.c.reason == q.reason.value)
    if q.endpoint is not None:
        query = query.where(operations.c.endpoint == q.endpoint)
    if q.tenant is not None:
        query = query.where(operations.c.tenant == q.tenant)
    if q.created_before_ms is not None:
        query = query.where(operations.c.created_at <= q.created_before_ms)
    if q.id_contains:
        # autoescape: % and _ in the search text match themselves.
        query = query.where(operations.c.operation_id.contains(q.id_contains, autoescape=True))
    return query


def operations_page(
    store: Store, q: OperationQuery, *, newest_first: bool, limit: int, offset: int
) -> tuple[list[Operation], int]:
    """One page of operations (without attempts) and the total matching the filters."""
    order = NEWEST_FIRST if newest_first else OLDEST_FIRST
    with store.read() as conn:
        total = int(
            conn.execute(_where(select(func.count()).select_from(operations), q)).scalar_one()
        )
        rows = conn.execute(
            _where(select(operations), q).order_by(*order).limit(limit).offset(offset)
        )
        return [operation_from_row(r, (), store.sealer) for r in rows], total


def audit_page(
    store: Store, q: AuditQuery, *, limit: int, offset: int
) -> tuple[list[AuditRecord], int]:
    """Audit rows, newest first, and the total matching the filters."""

    def where(query: Any) -> Any:
        if q.actor is not None:
            query = query.where(audit.c.actor == q.actor)
        if q.since_ms is not None:
            query = query.where(audit.c.at >= q.since_ms)
        if q.until_ms is not None:
            query = query.where(audit.c.at < q.until_ms)
        if q.operation_id is not None:
            query = query.where(audit.c.operation_id == q.operation_id)
        return query

    with store.read() as conn:
        total = int(conn.execute(where(select(func.count()).select_from(audit))).scalar_one())
        rows = conn.execute(
            where(select(audit))
            .order_by(audit.c.at.desc(), audit.c.id.desc())
            .limit(limit)
            .offset(offset)
        ).all()
    return [audit_from_row(r) for r in rows], total


def endpoint_in_use(store: Store, name: str) -> bool:
    """Whether any stored operation, live or settled, names endpoint ``name``."""
    with store.read() as conn:
        found = conn.execute(
            select(operations.c.id).where(operations.c.endpoint == name).limit(1)
        ).first()
    return found is not None


def distinct_values(store: Store) -> tuple[list[str], list[str], list[str]]:
    """Endpoints, tenants and audit actors present, for the filter menus (capped)."""
    with store.read() as conn:
        endpoints = [
            r[0]
            for r in conn.execute(
                select(operations.c.endpoint).distinct().order_by(operations.c.endpoint)
            )
        ]
        tenants = [
            r[0]
            for r in conn.execute(
                select(operations.c.tenant).distinct().order_by(operations.c.tenant).limit(200)
            )
        ]
        actors = [
            r[0]
            for r in conn.execute(
                select(audit.c.actor).distinct().order_by(audit.c.actor).limit(200)
            )
        ]
    return endpoints, tenants, actors
