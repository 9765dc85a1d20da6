"""The store's queries for operators and monitoring: listing, counting, audited
transitions, the audit trail, purging and the figures ``outbox status`` shows.

A base of :class:`~outbox.store.base.Store`, which supplies the transactions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    delete,
    func,
    insert,
    select,
    tuple_,
    update,
)

from outbox.errors import StoreError
from outbox.model import (
    Operation,
    Reason,
    State,
)
from outbox.store.changes import ChangeSignals
from outbox.store.rows import OLDEST_FIRST, AuditRecord, audit_from_row, operation_from_row
from outbox.store.sealing import Sealer
from outbox.store.tables import attempts, audit, operations


@dataclass(frozen=True, slots=True)
class OperatorSelection:
    """Which operations an operator query takes: those in ``states`` that match every
    filter given. ``older_than_ms``/``newer_than_ms`` bound ``updated_at``."""

    states: Sequence[State]
    tenant: str | None = None
    endpoint: str | None = None
    reason: Reason | None = None
    older_than_ms: int | None = None
    newer_than_ms: int | None = None

    def apply(self, query: Any) -> Any:
        """``query`` (a SELECT from the operations table) narrowed to this filter."""
        query = query.where(operations.c.state.in_([s.value for s in self.states]))
        if self.tenant is not None:
            query = query.where(operations.c.tenant == self.tenant)
        if self.endpoint is not None:
            query = query.where(operations.c.endpoint == self.endpoint)
        if self.reason is not None:
            query = query.where(operations.c.reason == self.reason.value)
        if self.older_than_ms is not None:
            query = query.where(operations.c.updated_at <= self.older_than_ms)
        if self.newer_than_ms is not None:
            query = query.where(operations.c.updated_at >= self.newer_than_ms)
        return query


class OperatorQueries(ChangeSignals):
    """Operator and monitoring queries; :class:`~outbox.store.base.Store` mixes them in."""

    engine: Engine
    dialect: str
    sealer: Sealer

    def read(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def write(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    # -- operators ----------------------------------------------------------------

    def list_operations(
        self, where: OperatorSelection, *, limit: int | None = 50, offset: int = 0
    ) -> list[Operation]:
        """Operations ``where`` takes, oldest change first (no attempts);
        ``limit=None`` returns every match."""
        query = where.apply(select(operations))
        query = query.order_by(*OLDEST_FIRST).limit(limit).offset(offset)
        with self.read() as conn:
            return [operation_from_row(r, (), self.sealer) for r in conn.execute(query)]

    def count_operations(self, where: OperatorSelection) -> int:
        """How many operations :meth:`list_operations` would return without a limit."""
        query = where.apply(select(func.count()).select_from(operations))
        with self.read() as conn:
            return int(conn.execute(query).scalar_one())

    def transition_by_operator(
        self,
        *,
        pk: int,
        expected_version: int,
        from_state: State,
        values: dict[str, Any],
        audit_row: dict[str, Any],
    ) -> bool:
        """Apply an operator's change if nobody changed the operation since it was read.

        The audit row is written in the same transaction, or not at all.
        """
        values = {**values, "version": operations.c.version + 1}
        with self.write() as conn:
            changed = conn.execute(
                update(operations)
                .where(
                    operations.c.id == pk,
                    operations.c.version == expected_version,
                    operations.c.state == from_state.value,
                )
                .values(values)
            ).rowcount
            if changed != 1:
                return False
            conn.execute(insert(audit).values(audit_row))
            if values.get("state") == State.PENDING.value:
                self._signal_on(conn)
        if values.get("state") == State.PENDING.value:
            self.announce()
        return True

    def audit_trail(self, tenant: str, operation_id: str) -> list[AuditRecord]:
        with self.read() as conn:
            rows = conn.execute(
                select(audit)
                .where(audit.c.tenant == tenant, audit.c.operation_id == operation_id)
                .order_by(audit.c.id)
            ).all()
        return [audit_from_row(r) for r in rows]

    def purgeable_counts(self, *, finished_before_ms: int) -> dict[str, int]:
        """What :meth:`purge` would delete now, per state."""
        terminal = [s.value for s in (State.SUCCEEDED, State.FAILED, State.CANCELLED)]
        with self.read() as conn:
            return {
                r.state: r.n
                for r in conn.execute(
                    select(operations.c.state, func.count().label("n"))
                    .where(
                        operations.c.state.in_(terminal),
                        operations.c.finished_at < finished_before_ms,
                    )
                    .group_by(operations.c.state)
                )
            }

    def database_bytes(self) -> int | None:
        """The database's size on disk, where the store can tell (SQLite)."""
        return None

    def vacuum(self) -> None:
        """Give the space of deleted rows back to the file system (SQLite)."""
        raise StoreError(f"vacuum is for SQLite; {self.dialect} reclaims space itself")

    def purge(
        self,
        *,
        finished_before_ms: int,
        batch_size: int = 500,
        on_batch: Callable[[int], None] | None = None,
    ) -> dict[str, int]:
        """Delete terminal operations finished before the cutoff, with their attempts.

        Unresolved, pending and in-flight operations are never touched. Works in
        bounded batches so no transaction grows with the table; ``on_batch`` is told
        how many each batch deleted. Each state is walked through the ``(state,
        updated_at)`` index from where the previous batch stopped (a keyset, not
        ``LIMIT`` from the start again), so a batch never rescans the entries of rows
        already deleted and not yet vacuumed: the cost of a batch stays flat however
        large the purge. A terminal row changed after it finished waits until that
        change is older than the cutoff too.
        """
        removed: dict[str, int] = {}
        for state in (State.SUCCEEDED, State.FAILED, State.CANCELLED):
            after: tuple[int, int] | None = None
            while True:
                with self.write() as conn:
                    batch = conn.execute(
                        _purge_batch(state.value, finished_before_ms, after, batch_size)
                    ).all()
                    if not batch:
                        break
                    ids = [r.id for r in batch]
                    conn.execute(delete(attempts).where(attempts.c.operation_pk.in_(ids)))
                    conn.execute(
                        delete(operations).where(
                            operations.c.id.in_(ids), operations.c.state == state.value
                        )
                    )
                after = (batch[-1].updated_at, batch[-1].id)
                removed[state.value] = removed.get(state.value, 0) + len(batch)
                if on_batch is not None:
                    on_batch(len(batch))
        return removed

    def record_audit(self, row: dict[str, Any]) -> None:
        with self.write() as conn:
            conn.execute(insert(audit).values(row))

    def tenants_holding(self, operation_id: str, *, limit: int = 4) -> list[str]:
        """The tenants that hold an operation with this ID (for a not-found message)."""
        with self.read() as conn:
            return list(
                conn.execute(
                    select(operations.c.tenant)
                    .where(operations.c.operation_id == operation_id)
                    .order_by(operations.c.tenant)
                    .limit(limit)
                ).scalars()
            )

    def state_counts(self) -> dict[str, int]:
        with self.read() as conn:
            return {
                r.state: r.n
                for r in conn.execute(
                    select(operations.c.state, func.count().label("n")).group_by(operations.c.state)
                )
            }


def _purge_batch(state: str, cutoff_ms: int, after: tuple[int, int] | None, size: int) -> Any:
    """The next ``size`` operations in ``state`` finished before the cutoff, after the
    ``(updated_at, id)`` where the previous batch stopped."""
    query = select(operations.c.id, operations.c.updated_at).where(
        operations.c.state == state,
        operations.c.updated_at < cutoff_ms,
        operations.c.finished_at < cutoff_ms,
    )
    if after is not None:
        query = query.where(
            operations.c.updated_at >= after[0],  # the index's range: starts where we were
            tuple_(operations.c.updated_at, operations.c.id) > tuple_(after[0], after[1]),
        )
    return query.order_by(operations.c.updated_at, operations.c.id).limit(size)
