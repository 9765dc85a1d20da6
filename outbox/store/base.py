"""Dialect-neutral SQL. The only module, with its dialect subclasses, that speaks SQL."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import DBAPIError, OperationalError

from outbox.errors import NotStoredError, StoreError
from outbox.model import (
    Attempt,
    Operation,
    State,
)
from outbox.store.direct import DirectInsert
from outbox.store.endpoints import EndpointQueries
from outbox.store.marker import note_marker
from outbox.store.operator import OperatorQueries
from outbox.store.records import (
    InsertResult,
    TxStatus,
)
from outbox.store.rows import (
    attempt_from_row,
    operation_from_row,
)
from outbox.store.sealing import PLAIN, Sealer
from outbox.store.statements import (
    DUE,
    blocks,
)
from outbox.store.tables import attempts, operations


class Store(OperatorQueries, EndpointQueries):
    """Every read and write of the outbox tables. Subclasses add the dialect's claim."""

    dialect = "generic"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read_engine = engine.execution_options(outbox_read_only=True)
        # Built once, run with parameters: building an INSERT with literal .values() costs
        # SQLAlchemy more than the database spends on it (each value coerced and hashed
        # into a cache key, on every call).
        wake = (*self._insert_wakes(), *self._insert_marks())
        self._insert_one = self._insert_ignoring_duplicate().returning(operations.c.id, *wake)
        self._insert_many = self._insert_ignoring_duplicate().returning(
            operations.c.id, operations.c.tenant, operations.c.operation_id, *wake
        )
        self._direct: DirectInsert | None = None
        #: Per-tenant in-flight limits by endpoint (``Endpoint.tenant_max_in_flight``).
        self.tenant_caps: dict[str, int] = {}
        #: The tenant this store's last claim served last (``store.fairness``).
        self.tenant_cursor = ""
        #: Seals request and result columns on write, opens them on read (store.sealing).
        self.sealer: Sealer = PLAIN

    # -- transactions -------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """A short write transaction (BEGIN IMMEDIATE on SQLite)."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except OperationalError as exc:
            raise StoreError(f"database write failed: {exc.orig}") from exc

    @contextmanager
    def read(self) -> Iterator[Connection]:
        with self._read_engine.connect() as conn:
            yield conn

    def server_time_ms(self) -> int | None:
        """The database server's clock, where the database has one worth using."""
        return None

    def caller_holds_write_lock(self) -> bool:
        """Whether a write transaction of our own would wait on the caller itself
        (SQLite: this thread or task already holds the file's write lock)."""
        return False

    def next_due_ms(self, now_ms: int) -> int | None:
        """The earliest ``next_attempt_at`` after ``now_ms`` among pending and in-flight
        operations (a scheduled retry, an expiring lease), through the due index."""
        with self.read() as conn:
            value = conn.execute(
                select(func.min(operations.c.next_attempt_at)).where(
                    DUE, operations.c.next_attempt_at > now_ms
                )
            ).scalar()
        return int(value) if value is not None else None

    def _insert_marks(self) -> tuple[Any, ...]:
        """Extra RETURNING columns of the enqueue INSERT that name its transaction, an
        ID that outlives the connection (``outbox.store.marker``); none on SQLite."""
        return ()

    def commit_status(self, marker: str) -> TxStatus:
        """What became of the transaction the enqueue INSERT named."""
        return TxStatus.UNKNOWN

    def seal_failed_commit(self) -> bool:
        """After a failed COMMIT of our own with no transaction marker: make what is
        stored now all that will ever be stored of it, and say so (True). Here nothing
        can: only a dialect that knows how overrides it (SQLite)."""
        return False

    # -- enqueue ------------------------------------------------------------------

    def _insert_ignoring_duplicate(self) -> Any:
        """INSERT INTO operations ... ON CONFLICT (tenant, operation_id) DO NOTHING."""
        raise NotImplementedError

    def insert_operation(self, conn: Connection, values: dict[str, Any]) -> InsertResult:
        """Insert a pending operation (``values``: see :func:`operation_row`), or find the
        one already stored under its key.

        Atomic under concurrency: the unique (tenant, operation_id) constraint decides
        the winner; the loser reads the winner's row and writes nothing.
        """
        tenant, operation_id = values["tenant"], values["operation_id"]
        try:
            inserted = conn.execute(self._insert_one, values).first()
            if inserted is not None:
                note_marker(conn, inserted)
                return InsertResult(pk=inserted.id, created=True, args_sha256=values["args_sha256"])
            row = conn.execute(
                select(operations.c.id, operations.c.args_sha256).where(
                    operations.c.tenant == tenant, operations.c.operation_id == operation_id
                )
            ).one()
        except DBAPIError as exc:
            raise NotStoredError.because(exc.orig) from exc
        return InsertResult(pk=row.id, created=False, args_sha256=row.args_sha256)

    @property
    def statements_observed(self) -> bool:
        """Whether something listens to this engine's statements (an SQLAlchemy
        instrumentation such as OpenTelemetry's): then every statement goes through
        SQLAlchemy, where it sees them, and :meth:`insert_own` is not used."""
        dispatch = self.engine.dispatch
        return bool(
            dispatch.before_cursor_execute
            or dispatch.after_cursor_execute
            or self.engine.dialect.is_async  # its driver's calls are coroutines
        )

    def insert_own(self, row: dict[str, Any]) -> int | None:
        """Insert one operation (``row``: see :func:`operation_row`) in a transaction of
        its own and commit it, on the driver's connection: its primary key, or None
        when its key is already stored (nothing written). Failures are reported as
        ``outbox.store.direct`` says; ``outbox.store.commit.insert_and_commit`` tells
        them apart."""
        direct = self._direct
        if direct is None or not direct.accepts(row):
            direct = self._direct = DirectInsert(self.engine, self._insert_one, tuple(row))
        return direct.run(row)

    def insert_operations(
        self, conn: Connection, rows: Sequence[dict[str, Any]]
    ) -> dict[tuple[str, str], int]:
        """Insert many rows (see :func:`operation_row`) in one statement, skipping keys
        already stored; returns {(tenant, operation_id): pk} of the rows inserted."""
        if not rows:
            return {}
        try:
            inserted = conn.execute(self._insert_many, list(rows)).all()
            note_marker(conn, inserted[0] if inserted else None)
            return {(r.tenant, r.operation_id): r.id for r in inserted}
        except DBAPIError as exc:
            raise NotStoredError(f"the operations were not stored: {exc.orig}") from exc

    # -- reads --------------------------------------------------------------------

    def get_operation(
        self, tenant: str, operation_id: str, *, with_attempts: bool = True
    ) -> Operation | None:
        with self.read() as conn:
            row = conn.execute(
                select(operations).where(
                    operations.c.tenant == tenant, operations.c.operation_id == operation_id
                )
            ).one_or_none()
            if row is None:
                return None
            history: tuple[Attempt, ...] = ()
            if with_attempts:
                history = tuple(
                    attempt_from_row(r)
                    for r in conn.execute(
                        select(attempts)
                        .where(attempts.c.operation_pk == row.id)
                        .order_by(attempts.c.number)
                    )
                )
        return operation_from_row(row, history, self.sealer)

    def operation_on(self, conn: Connection, tenant: str, operation_id: str) -> Operation:
        """Read an operation on the given connection (inside its transaction)."""
        row = conn.execute(
            select(operations).where(
                operations.c.tenant == tenant, operations.c.operation_id == operation_id
            )
        ).one()
        return operation_from_row(row, (), self.sealer)

    def get_state(self, tenant: str, operation_id: str) -> State | None:
        with self.read() as conn:
            value = conn.execute(
                select(operations.c.state).where(
                    operations.c.tenant == tenant, operations.c.operation_id == operation_id
                )
            ).scalar()
        return State(value) if value is not None else None

    def blocking_predecessor(self, op: Operation) -> str | None:
        """The operation ID that an ordering key makes this one wait for, if any."""
        if op.ordering_key is None:
            return None
        with self.read() as conn:
            return conn.execute(
                select(operations.c.operation_id)
                .where(blocks(operations, tenant=op.tenant, ordering_key=op.ordering_key, pk=op.pk))
                .order_by(operations.c.id)
                .limit(1)
            ).scalar()

    def preflight(self) -> None:
        """Checks before a dispatcher starts (the SQLite store checks its file)."""


__all__ = ["Store"]
