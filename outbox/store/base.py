"""Dialect-neutral SQL. The only module, with its dialect subclasses, that speaks SQL."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from sqlalchemy import Connection, Engine, func, insert, select, update
from sqlalchemy.exc import DBAPIError, OperationalError

from outbox.canonical import CanonicalArgs
from outbox.errors import NotStoredError, StoreError
from outbox.model import (
    Attempt,
    Delivery,
    ErrorClass,
    Operation,
    PolicySnapshot,
    State,
)
from outbox.store.operator import OperatorQueries
from outbox.store.records import (
    AttemptOutcome,
    Claimed,
    InsertResult,
    Recovered,
    Settlement,
    StartedAttempt,
    TxStatus,
)
from outbox.store.rows import (
    attempt_from_row,
    operation_from_row,
    operation_row,
)
from outbox.store.statements import (
    _ATTEMPT_OUTCOME,
    DUE,
    _outcome_update,
    blocks,
    claimable_ids,
)
from outbox.store.tables import attempts, operations


class Store(OperatorQueries):
    """Every read and write of the outbox tables. Subclasses add the dialect's claim."""

    dialect = "generic"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read_engine = engine.execution_options(outbox_read_only=True)
        # Built once, run with parameters: building an INSERT with literal .values() costs
        # SQLAlchemy more than the database spends on it (each value coerced and hashed
        # into a cache key, on every call).
        wake = self._insert_wakes()
        self._insert_one = self._insert_ignoring_duplicate().returning(operations.c.id, *wake)
        self._insert_many = self._insert_ignoring_duplicate().returning(
            operations.c.id, operations.c.tenant, operations.c.operation_id, *wake
        )

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

    def transaction_marker(self, conn: Connection) -> str | None:
        """An ID of the open transaction that outlives its connection (PostgreSQL)."""
        return None

    def commit_status(self, marker: str) -> TxStatus:
        """What became of the transaction ``transaction_marker`` named."""
        return TxStatus.UNKNOWN

    # -- enqueue ------------------------------------------------------------------

    def _insert_ignoring_duplicate(self) -> Any:
        """INSERT INTO operations ... ON CONFLICT (tenant, operation_id) DO NOTHING."""
        raise NotImplementedError

    def insert_operation(
        self,
        conn: Connection,
        *,
        tenant: str,
        operation_id: str,
        args: CanonicalArgs,
        ordering_key: str | None,
        now_ms: int,
        traceparent: str | None = None,
        policy: PolicySnapshot | None = None,
    ) -> InsertResult:
        """Insert a pending operation, or find the one already stored under the key.

        Atomic under concurrency: the unique (tenant, operation_id) constraint decides
        the winner; the loser reads the winner's row and writes nothing.
        """
        values = operation_row(
            tenant=tenant,
            operation_id=operation_id,
            args=args,
            ordering_key=ordering_key,
            now_ms=now_ms,
            traceparent=traceparent,
            policy=policy,
        )
        try:
            pk = conn.execute(self._insert_one, values).scalar()
            if pk is not None:
                return InsertResult(pk=pk, created=True, args_sha256=args.args_sha256)
            row = conn.execute(
                select(operations.c.id, operations.c.args_sha256).where(
                    operations.c.tenant == tenant, operations.c.operation_id == operation_id
                )
            ).one()
        except DBAPIError as exc:
            raise NotStoredError(f"the operation was not stored: {exc.orig}") from exc
        return InsertResult(pk=row.id, created=False, args_sha256=row.args_sha256)

    def insert_operations(
        self, conn: Connection, rows: Sequence[dict[str, Any]]
    ) -> dict[tuple[str, str], int]:
        """Insert many rows (see :func:`operation_row`) in one statement, skipping keys
        already stored; returns {(tenant, operation_id): pk} of the rows inserted."""
        if not rows:
            return {}
        try:
            result = conn.execute(self._insert_many, list(rows))
            return {(r.tenant, r.operation_id): r.id for r in result}
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
        return operation_from_row(row, history)

    def operation_on(self, conn: Connection, tenant: str, operation_id: str) -> Operation:
        """Read an operation on the given connection (inside its transaction)."""
        row = conn.execute(
            select(operations).where(
                operations.c.tenant == tenant, operations.c.operation_id == operation_id
            )
        ).one()
        return operation_from_row(row, ())

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

    def _due_ids(self, now_ms: int, limit: int) -> Any:
        """SELECT of the ids a claim may take, oldest due first."""
        return claimable_ids(now_ms, limit)

    def _claim_statement(self, *, now_ms: int, limit: int, values: dict[str, Any]) -> Any:
        raise NotImplementedError

    _CLAIMED_COLUMNS = (
        operations.c.id,
        operations.c.tenant,
        operations.c.operation_id,
        operations.c.endpoint,
        operations.c.method,
        operations.c.path,
        operations.c.headers,
        operations.c.body,
        operations.c.attempts_counted,
        operations.c.attempts_total,
        operations.c.maybe_delivered,
        operations.c.saw_refusal,
        operations.c.first_attempt_at,
        operations.c.window_started_at,
        operations.c.lease_until,
        operations.c.created_at,
        operations.c.traceparent,
        operations.c.attempts_in_progress,
        operations.c.policy_window_ms,
    )

    def claim(
        self, *, owner: str, token: str, now_ms: int, lease_ms: int, limit: int
    ) -> tuple[list[Claimed], list[Recovered]]:
        """Take up to ``limit`` due operations under a new lease, in one short transaction.

        Operations whose previous lease expired are taken too; their open attempts are
        closed as ``unknown`` in the same transaction.
        """
        until = now_ms + lease_ms
        values = {
            "state": State.IN_FLIGHT.value,
            "lease_token": token,
            "lease_owner": owner,
            "lease_until": until,
            "next_attempt_at": until,
            "version": operations.c.version + 1,
            "updated_at": now_ms,
        }
        with self.write() as conn:
            rows = conn.execute(
                self._claim_statement(now_ms=now_ms, limit=limit, values=values)
            ).all()
            claimed = [
                Claimed(
                    pk=r.id,
                    tenant=r.tenant,
                    operation_id=r.operation_id,
                    endpoint=r.endpoint,
                    method=r.method,
                    path=r.path,
                    headers_json=r.headers,
                    body=r.body,
                    attempts_counted=r.attempts_counted,
                    attempts_total=r.attempts_total,
                    maybe_delivered=bool(r.maybe_delivered),
                    saw_refusal=bool(r.saw_refusal),
                    first_attempt_at=r.first_attempt_at,
                    window_started_at=r.window_started_at,
                    lease_until=r.lease_until,
                    created_at=r.created_at,
                    traceparent=r.traceparent,
                    attempts_in_progress=r.attempts_in_progress,
                    policy_window_ms=r.policy_window_ms,
                )
                for r in rows
            ]
            if not claimed:
                return [], []
            # Only a row taken over from an expired lease can have an open attempt. A
            # dialect whose claim cannot say what the row was (no "was" column) checks all.
            taken_over = [
                r.id
                for r in rows
                if r._mapping.get("was", State.IN_FLIGHT.value) == State.IN_FLIGHT.value
            ]
            recovered = self._close_open_attempts(conn, taken_over, now_ms) if taken_over else []
        if recovered:
            flagged = {r.pk for r in recovered}
            claimed = [replace(c, maybe_delivered=True) if c.pk in flagged else c for c in claimed]
        return claimed, recovered

    def _close_open_attempts(
        self, conn: Connection, pks: Sequence[int], now_ms: int
    ) -> list[Recovered]:
        rows = conn.execute(
            update(attempts)
            .where(attempts.c.operation_pk.in_(pks), attempts.c.delivery.is_(None))
            .values(
                delivery=Delivery.UNKNOWN.value,
                finished_at=now_ms,
                error_class=ErrorClass.LEASE_EXPIRED.value,
                error_message=(
                    "the dispatcher's lease expired before it recorded an outcome "
                    "(it crashed, was killed or paused); the request may have been sent"
                ),
            )
            .returning(
                attempts.c.operation_pk,
                attempts.c.request_id,
                attempts.c.number,
                attempts.c.dispatcher_id,
            )
        ).all()
        if rows:
            conn.execute(
                update(operations)
                .where(operations.c.id.in_([r.operation_pk for r in rows]))
                .values(maybe_delivered=True)
            )
        return [
            Recovered(
                pk=r.operation_pk,
                request_id=r.request_id,
                number=r.number,
                dispatcher_id=r.dispatcher_id,
            )
            for r in rows
        ]

    def begin_attempts(
        self,
        *,
        token: str,
        owner: str,
        now_ms: int,
        lease_until: int,
        request_ids: dict[int, str],
    ) -> list[StartedAttempt]:
        """Commit the attempt rows of a batch before any of them is sent.

        Fenced on the lease token: an operation another dispatcher took over gets no
        attempt and must not be sent.
        """
        if not request_ids:
            return []
        with self.write() as conn:
            rows = conn.execute(
                update(operations)
                .where(operations.c.id.in_(list(request_ids)), operations.c.lease_token == token)
                .values(
                    attempts_total=operations.c.attempts_total + 1,
                    attempts_counted=operations.c.attempts_counted + 1,
                    first_attempt_at=func.coalesce(operations.c.first_attempt_at, now_ms),
                    window_started_at=func.coalesce(operations.c.window_started_at, now_ms),
                    last_error=None,
                    updated_at=now_ms,
                )
                .returning(
                    operations.c.id,
                    operations.c.attempts_total,
                    operations.c.first_attempt_at,
                    operations.c.window_started_at,
                )
            ).all()
            started = [
                StartedAttempt(
                    pk=r.id,
                    request_id=request_ids[r.id],
                    number=r.attempts_total,
                    first_attempt_at=r.first_attempt_at,
                    window_started_at=r.window_started_at,
                )
                for r in rows
            ]
            if started:
                conn.execute(
                    insert(attempts),
                    [
                        {
                            "operation_pk": s.pk,
                            "number": s.number,
                            "request_id": s.request_id,
                            "dispatcher_id": owner,
                            "lease_token": token,
                            "started_at": now_ms,
                            "lease_until": lease_until,
                        }
                        for s in started
                    ],
                )
        return started

    def record_outcomes(self, *, now_ms: int, outcomes: Sequence[AttemptOutcome]) -> set[int]:
        """Write attempt outcomes and transitions; returns the operations written.

        Each write is fenced on the lease token: if another dispatcher has taken the
        operation over, neither the attempt nor the operation changes. One transaction
        per batch: a fencing read (row-locked on PostgreSQL, and the write lock is already
        held on SQLite), then one prepared UPDATE per kind of transition, executed for all
        of its rows at once.
        """
        if not outcomes:
            return set()
        with self.write() as conn:
            held = dict(
                conn.execute(
                    select(operations.c.id, operations.c.lease_token)
                    .where(operations.c.id.in_([out.pk for out in outcomes]))
                    .order_by(operations.c.id)
                    .with_for_update()
                ).all()
            )
            mine = [out for out in outcomes if held.get(out.pk) == out.lease_token]
            if not mine:
                return set()
            groups: dict[tuple[bool, bool, bool, bool], list[dict[str, Any]]] = {}
            for out in mine:
                params: dict[str, Any] = {
                    "b_pk": out.pk,
                    "b_token": out.lease_token,
                    "b_state": out.state.value,
                    "b_reason": out.reason.value if out.reason else None,
                    "b_next": out.next_attempt_at,
                    "b_maybe": out.maybe_delivered,
                    "b_refusal": out.saw_refusal,
                    "b_now": now_ms,
                }
                if out.result is not None:
                    params.update(
                        b_rstatus=out.result.status,
                        b_rheaders=out.result.headers_json,
                        b_rbody=out.result.body,
                        b_rsha=out.result.sha256,
                        b_rsize=out.result.size,
                        b_rtrunc=out.result.truncated,
                    )
                shape = (out.counted, out.state.is_settled, out.result is not None, out.in_progress)
                groups.setdefault(shape, []).append(params)
            for shape, rows in groups.items():
                conn.execute(_outcome_update(*shape), rows)
            conn.execute(
                _ATTEMPT_OUTCOME,
                [
                    {
                        "b_rid": out.request_id,
                        "b_delivery": out.delivery.value,
                        "b_verdict": out.verdict.value if out.verdict else None,
                        "b_counted": out.counted,
                        "b_status": out.status_code,
                        "b_rrid": out.receiver_request_id,
                        "b_eclass": out.error_class,
                        "b_emsg": out.error_message,
                        "b_duration": out.duration_ms,
                        "b_now": now_ms,
                    }
                    for out in mine
                ],
            )
        return {out.pk for out in mine}

    def settle(self, *, now_ms: int, settlements: Sequence[Settlement]) -> set[int]:
        """Move claimed operations to a state without sending (e.g. window closed).

        A settlement with ``not_sent`` also records one closed, not-sent attempt with
        that error class and message: the evidence of why it never left.
        """
        written: set[int] = set()
        if not settlements:
            return written
        with self.write() as conn:
            for s in settlements:
                values: dict[str, Any] = {
                    "state": s.state.value,
                    "reason": s.reason.value if s.reason else None,
                    "last_error": s.last_error,
                    "next_attempt_at": None,
                    "lease_token": None,
                    "lease_owner": None,
                    "lease_until": None,
                    "updated_at": now_ms,
                    "finished_at": now_ms,
                }
                if s.not_sent is not None:
                    values["attempts_total"] = operations.c.attempts_total + 1
                row = conn.execute(
                    update(operations)
                    .where(operations.c.id == s.pk, operations.c.lease_token == s.lease_token)
                    .values(values)
                    .returning(operations.c.attempts_total)
                ).first()
                if row is None:
                    continue
                written.add(s.pk)
                if s.not_sent is not None:
                    error_class, message, request_id, owner = s.not_sent
                    conn.execute(
                        insert(attempts).values(
                            operation_pk=s.pk,
                            number=row.attempts_total,
                            request_id=request_id,
                            dispatcher_id=owner,
                            lease_token=s.lease_token,
                            started_at=now_ms,
                            lease_until=now_ms,
                            finished_at=now_ms,
                            delivery=Delivery.NOT_SENT.value,
                            counted=False,
                            error_class=error_class,
                            error_message=message,
                            duration_ms=0,
                        )
                    )
        return written

    def release(
        self,
        *,
        token: str,
        now_ms: int,
        pks: Sequence[int],
        delay_ms: int = 0,
        last_error: str | None = None,
    ) -> int:
        """Give back claimed operations without an attempt, due again after ``delay_ms``.

        ``last_error`` says why they could not be sent (shown to operators, counted by
        ``status``); it is cleared by the next attempt. With it, the retry window starts
        now if it has not started: an operation no dispatcher can send still ends.
        """
        if not pks:
            return 0
        extra: dict[str, Any] = {}
        if last_error is not None:
            extra = {
                "last_error": last_error,
                "window_started_at": func.coalesce(operations.c.window_started_at, now_ms),
            }
        with self.write() as conn:
            return conn.execute(
                update(operations)
                .where(operations.c.id.in_(list(pks)), operations.c.lease_token == token)
                .values(
                    state=State.PENDING.value,
                    **extra,
                    next_attempt_at=now_ms + delay_ms,
                    lease_token=None,
                    lease_owner=None,
                    lease_until=None,
                    updated_at=now_ms,
                )
            ).rowcount


__all__ = ["Store"]
