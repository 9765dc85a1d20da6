"""Dialect-neutral SQL. The only module, with its dialect subclasses, that speaks SQL."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Row,
    bindparam,
    delete,
    exists,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.sql.elements import ColumnElement

from outbox.canonical import CanonicalArgs
from outbox.errors import NotStoredError, StoreError
from outbox.model import (
    BLOCKING_STATES,
    Attempt,
    Delivery,
    ErrorClass,
    Operation,
    PolicySnapshot,
    Reason,
    Result,
    State,
    Verdict,
)
from outbox.store.changes import ChangeSource
from outbox.store.commit import TxStatus
from outbox.store.records import (
    AttemptOutcome,
    Claimed,
    Recovered,
    Settlement,
    StartedAttempt,
)
from outbox.store.tables import attempts, audit, operations

o = operations
a = attempts


def _states(*states: State) -> list[Any]:
    # Literal values, not bound parameters: SQLite uses a partial index only when it can
    # see that the query's WHERE implies the index's.
    return [literal_column(f"'{s.value}'") for s in states]


DUE: ColumnElement[bool] = o.c.state.in_(_states(State.PENDING, State.IN_FLIGHT))


@dataclass(frozen=True, slots=True)
class InsertResult:
    pk: int
    created: bool
    args_sha256: str


@dataclass(frozen=True, slots=True)
class AuditRecord:
    tenant: str
    operation_id: str
    actor: str
    action: str
    from_state: str | None
    to_state: str | None
    note: str
    details: dict[str, Any] | None
    at_ms: int


class Store:
    """Every read and write of the outbox tables. Subclasses add the dialect's claim."""

    dialect = "generic"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._read_engine = engine.execution_options(outbox_read_only=True)
        # Built once, run with parameters: building an INSERT with literal .values() costs
        # SQLAlchemy more than the database spends on it (each value coerced and hashed
        # into a cache key, on every call).
        wake = self._insert_wakes()
        self._insert_one = self._insert_ignoring_duplicate().returning(o.c.id, *wake)
        self._insert_many = self._insert_ignoring_duplicate().returning(
            o.c.id, o.c.tenant, o.c.operation_id, *wake
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

    # -- change signals (see outbox.store.changes) ---------------------------------

    def _insert_wakes(self) -> tuple[Any, ...]:
        """Extra RETURNING columns of the enqueue INSERT that signal dispatchers."""
        return ()

    def _signal_on(self, conn: Connection) -> None:
        """Signal dispatchers from inside ``conn``'s transaction (delivered at commit)."""

    def announce(self) -> None:
        """Tell this process's dispatchers that a transaction of ours just committed work."""

    def change_source(self, *, application_name: str, interval: float) -> ChangeSource | None:
        """What wakes an idle dispatcher of this database, or None: poll only."""
        return None

    def next_due_ms(self, now_ms: int) -> int | None:
        """The earliest ``next_attempt_at`` after ``now_ms`` among pending and in-flight
        operations (a scheduled retry, an expiring lease), through the due index."""
        with self.read() as conn:
            value = conn.execute(
                select(func.min(o.c.next_attempt_at)).where(DUE, o.c.next_attempt_at > now_ms)
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
                select(o.c.id, o.c.args_sha256).where(
                    o.c.tenant == tenant, o.c.operation_id == operation_id
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
                select(o).where(o.c.tenant == tenant, o.c.operation_id == operation_id)
            ).one_or_none()
            if row is None:
                return None
            history: tuple[Attempt, ...] = ()
            if with_attempts:
                history = tuple(
                    _attempt(r)
                    for r in conn.execute(
                        select(a).where(a.c.operation_pk == row.id).order_by(a.c.number)
                    )
                )
        return _operation(row, history)

    def operation_on(self, conn: Connection, tenant: str, operation_id: str) -> Operation:
        """Read an operation on the given connection (inside its transaction)."""
        row = conn.execute(
            select(o).where(o.c.tenant == tenant, o.c.operation_id == operation_id)
        ).one()
        return _operation(row, ())

    def get_state(self, tenant: str, operation_id: str) -> State | None:
        with self.read() as conn:
            value = conn.execute(
                select(o.c.state).where(o.c.tenant == tenant, o.c.operation_id == operation_id)
            ).scalar()
        return State(value) if value is not None else None

    def blocking_predecessor(self, op: Operation) -> str | None:
        """The operation ID that an ordering key makes this one wait for, if any."""
        if op.ordering_key is None:
            return None
        with self.read() as conn:
            return conn.execute(
                select(o.c.operation_id)
                .where(
                    o.c.tenant == op.tenant,
                    o.c.ordering_key == op.ordering_key,
                    o.c.id < op.pk,
                    o.c.state.in_([s.value for s in BLOCKING_STATES]),
                )
                .order_by(o.c.id)
                .limit(1)
            ).scalar()

    def preflight(self) -> None:
        """Checks before a dispatcher starts (the SQLite store checks its file)."""

    def _due_ids(self, now_ms: int, limit: int) -> Any:
        """SELECT of the ids a claim may take, oldest due first."""
        earlier = o.alias("earlier")
        blocked = exists().where(
            earlier.c.tenant == o.c.tenant,
            earlier.c.ordering_key == o.c.ordering_key,
            earlier.c.id < o.c.id,
            earlier.c.state.in_(_states(State.PENDING, State.IN_FLIGHT, State.UNRESOLVED)),
        )
        return (
            select(o.c.id)
            .where(DUE, o.c.next_attempt_at <= now_ms)
            .where(or_(o.c.ordering_key.is_(None), ~blocked))
            .order_by(o.c.next_attempt_at)
            .limit(limit)
        )

    def _claim_statement(self, *, now_ms: int, limit: int, values: dict[str, Any]) -> Any:
        raise NotImplementedError

    _CLAIMED_COLUMNS = (
        o.c.id,
        o.c.tenant,
        o.c.operation_id,
        o.c.endpoint,
        o.c.method,
        o.c.path,
        o.c.headers,
        o.c.body,
        o.c.attempts_counted,
        o.c.attempts_total,
        o.c.maybe_delivered,
        o.c.saw_refusal,
        o.c.first_attempt_at,
        o.c.window_started_at,
        o.c.lease_until,
        o.c.created_at,
        o.c.traceparent,
        o.c.attempts_in_progress,
        o.c.policy_window_ms,
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
            "version": o.c.version + 1,
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
                r.id for r in rows
                if r._mapping.get("was", State.IN_FLIGHT.value) == State.IN_FLIGHT.value
            ]
            recovered = (
                self._close_open_attempts(conn, taken_over, now_ms) if taken_over else []
            )
        if recovered:
            flagged = {r.pk for r in recovered}
            claimed = [replace(c, maybe_delivered=True) if c.pk in flagged else c for c in claimed]
        return claimed, recovered

    def _close_open_attempts(
        self, conn: Connection, pks: Sequence[int], now_ms: int
    ) -> list[Recovered]:
        rows = conn.execute(
            update(a)
            .where(a.c.operation_pk.in_(pks), a.c.delivery.is_(None))
            .values(
                delivery=Delivery.UNKNOWN.value,
                finished_at=now_ms,
                error_class=ErrorClass.LEASE_EXPIRED.value,
                error_message=(
                    "the dispatcher's lease expired before it recorded an outcome "
                    "(it crashed, was killed or paused); the request may have been sent"
                ),
            )
            .returning(a.c.operation_pk, a.c.request_id, a.c.number, a.c.dispatcher_id)
        ).all()
        if rows:
            conn.execute(
                update(o)
                .where(o.c.id.in_([r.operation_pk for r in rows]))
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
                update(o)
                .where(o.c.id.in_(list(request_ids)), o.c.lease_token == token)
                .values(
                    attempts_total=o.c.attempts_total + 1,
                    attempts_counted=o.c.attempts_counted + 1,
                    first_attempt_at=func.coalesce(o.c.first_attempt_at, now_ms),
                    window_started_at=func.coalesce(o.c.window_started_at, now_ms),
                    last_error=None,
                    updated_at=now_ms,
                )
                .returning(o.c.id, o.c.attempts_total, o.c.first_attempt_at, o.c.window_started_at)
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
                    insert(a),
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
                    select(o.c.id, o.c.lease_token)
                    .where(o.c.id.in_([out.pk for out in outcomes]))
                    .order_by(o.c.id)
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
                    values["attempts_total"] = o.c.attempts_total + 1
                row = conn.execute(
                    update(o)
                    .where(o.c.id == s.pk, o.c.lease_token == s.lease_token)
                    .values(values)
                    .returning(o.c.attempts_total)
                ).first()
                if row is None:
                    continue
                written.add(s.pk)
                if s.not_sent is not None:
                    error_class, message, request_id, owner = s.not_sent
                    conn.execute(
                        insert(a).values(
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
                "window_started_at": func.coalesce(o.c.window_started_at, now_ms),
            }
        with self.write() as conn:
            return conn.execute(
                update(o)
                .where(o.c.id.in_(list(pks)), o.c.lease_token == token)
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

    # -- operators ----------------------------------------------------------------

    def _select_operations(
        self,
        query: Any,
        *,
        states: Sequence[State],
        tenant: str | None,
        endpoint: str | None,
        reason: Reason | None,
        older_than_ms: int | None,
        newer_than_ms: int | None,
    ) -> Any:
        query = query.where(o.c.state.in_([s.value for s in states]))
        if tenant is not None:
            query = query.where(o.c.tenant == tenant)
        if endpoint is not None:
            query = query.where(o.c.endpoint == endpoint)
        if reason is not None:
            query = query.where(o.c.reason == reason.value)
        if older_than_ms is not None:
            query = query.where(o.c.updated_at <= older_than_ms)
        if newer_than_ms is not None:
            query = query.where(o.c.updated_at >= newer_than_ms)
        return query

    def list_operations(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        endpoint: str | None = None,
        reason: Reason | None = None,
        older_than_ms: int | None = None,
        newer_than_ms: int | None = None,
        limit: int | None = 50,
        offset: int = 0,
    ) -> list[Operation]:
        """Operations in ``states`` matching the filters, oldest change first (no
        attempts). ``older_than_ms``/``newer_than_ms`` bound ``updated_at``;
        ``limit=None`` returns every match."""
        query = self._select_operations(
            select(o),
            states=states,
            tenant=tenant,
            endpoint=endpoint,
            reason=reason,
            older_than_ms=older_than_ms,
            newer_than_ms=newer_than_ms,
        )
        query = query.order_by(o.c.updated_at, o.c.id).limit(limit).offset(offset)
        with self.read() as conn:
            return [_operation(r, ()) for r in conn.execute(query)]

    def count_operations(
        self,
        *,
        states: Sequence[State],
        tenant: str | None = None,
        endpoint: str | None = None,
        reason: Reason | None = None,
        older_than_ms: int | None = None,
        newer_than_ms: int | None = None,
    ) -> int:
        """How many operations :meth:`list_operations` would return without a limit."""
        query = self._select_operations(
            select(func.count()).select_from(o),
            states=states,
            tenant=tenant,
            endpoint=endpoint,
            reason=reason,
            older_than_ms=older_than_ms,
            newer_than_ms=newer_than_ms,
        )
        with self.read() as conn:
            return int(conn.execute(query).scalar_one())

    def snapshot_policies(self, policies: dict[int, PolicySnapshot]) -> int:
        """Fill the policy snapshot of operations that have none (rows older than
        snapshots); a snapshot already there is never overwritten."""
        if not policies:
            return 0
        with self.write() as conn:
            return sum(
                conn.execute(
                    update(o)
                    .where(o.c.id == pk, o.c.policy_window_ms.is_(None))
                    .values(policy_columns(policy))
                ).rowcount
                for pk, policy in policies.items()
            )

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
        values = {**values, "version": o.c.version + 1}
        with self.write() as conn:
            changed = conn.execute(
                update(o)
                .where(
                    o.c.id == pk,
                    o.c.version == expected_version,
                    o.c.state == from_state.value,
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
        return [
            AuditRecord(
                tenant=r.tenant,
                operation_id=r.operation_id,
                actor=r.actor,
                action=r.action,
                from_state=r.from_state,
                to_state=r.to_state,
                note=r.note,
                details=json.loads(r.details) if r.details else None,
                at_ms=r.at,
            )
            for r in rows
        ]

    def purgeable_counts(self, *, finished_before_ms: int) -> dict[str, int]:
        """What :meth:`purge` would delete now, per state."""
        terminal = [s.value for s in (State.SUCCEEDED, State.FAILED, State.CANCELLED)]
        with self.read() as conn:
            return {
                r.state: r.n
                for r in conn.execute(
                    select(o.c.state, func.count().label("n"))
                    .where(o.c.state.in_(terminal), o.c.finished_at < finished_before_ms)
                    .group_by(o.c.state)
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
        how many each batch deleted.
        """
        removed: dict[str, int] = {}
        terminal = [s.value for s in (State.SUCCEEDED, State.FAILED, State.CANCELLED)]
        while True:
            with self.write() as conn:
                batch = conn.execute(
                    select(o.c.id, o.c.state)
                    .where(o.c.state.in_(terminal), o.c.finished_at < finished_before_ms)
                    .limit(batch_size)
                ).all()
                if not batch:
                    return removed
                ids = [r.id for r in batch]
                conn.execute(delete(a).where(a.c.operation_pk.in_(ids)))
                conn.execute(delete(o).where(o.c.id.in_(ids), o.c.state.in_(terminal)))
            for r in batch:
                removed[r.state] = removed.get(r.state, 0) + 1
            if on_batch is not None:
                on_batch(len(batch))

    def record_audit(self, row: dict[str, Any]) -> None:
        with self.write() as conn:
            conn.execute(insert(audit).values(row))

    def state_counts(self) -> dict[str, int]:
        with self.read() as conn:
            return {
                r.state: r.n
                for r in conn.execute(
                    select(o.c.state, func.count().label("n")).group_by(o.c.state)
                )
            }

    def reason_counts(self) -> dict[str, int]:
        with self.read() as conn:
            return {
                r.reason: r.n
                for r in conn.execute(
                    select(o.c.reason, func.count().label("n"))
                    .where(o.c.state == State.UNRESOLVED.value)
                    .group_by(o.c.reason)
                )
            }

    def oldest_pending_created_ms(self) -> int | None:
        with self.read() as conn:
            return conn.execute(
                select(func.min(o.c.created_at)).where(o.c.state == State.PENDING.value)
            ).scalar()

    def attempts_since(self, since_ms: int) -> int:
        with self.read() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(a).where(a.c.started_at >= since_ms)
                ).scalar_one()
            )

    def keys_near_expiry_by_snapshot(self, expiring_before_ms: int) -> int:
        """Live, attempted operations whose key (by their policy snapshot) expires
        before the given time."""
        live = [s.value for s in (State.PENDING, State.IN_FLIGHT, State.UNRESOLVED)]
        with self.read() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(o)
                    .where(
                        o.c.state.in_(live),
                        o.c.first_attempt_at.is_not(None),
                        o.c.policy_key_retention_ms.is_not(None),
                        o.c.first_attempt_at + o.c.policy_key_retention_ms <= expiring_before_ms,
                    )
                ).scalar_one()
            )

    def keys_near_expiry(self, endpoint: str, first_attempt_before_ms: int) -> int:
        """Like :meth:`keys_near_expiry_by_snapshot`, for rows without a snapshot."""
        live = [s.value for s in (State.PENDING, State.IN_FLIGHT, State.UNRESOLVED)]
        with self.read() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(o)
                    .where(
                        o.c.endpoint == endpoint,
                        o.c.policy_key_retention_ms.is_(None),
                        o.c.state.in_(live),
                        o.c.first_attempt_at.is_not(None),
                        o.c.first_attempt_at <= first_attempt_before_ms,
                    )
                ).scalar_one()
            )


_OUTCOME_UPDATES: dict[tuple[bool, bool, bool, bool], Any] = {}


def _outcome_update(counted: bool, settled: bool, has_result: bool, in_progress: bool) -> Any:
    """The prepared, fenced UPDATE of an operation for one kind of attempt outcome.

    Built once per kind and executed with parameters: building a statement with literal
    ``.values()`` per row costs SQLAlchemy more than the database spends running it.
    """
    key = (counted, settled, has_result, in_progress)
    stmt = _OUTCOME_UPDATES.get(key)
    if stmt is None:
        values: dict[str, Any] = {
            "state": bindparam("b_state"),
            "reason": bindparam("b_reason"),
            "next_attempt_at": bindparam("b_next"),
            "lease_token": None,
            "lease_owner": None,
            "lease_until": None,
            "maybe_delivered": bindparam("b_maybe"),
            "saw_refusal": bindparam("b_refusal"),
            "updated_at": bindparam("b_now"),
        }
        if not counted:
            values["attempts_counted"] = o.c.attempts_counted - 1
        if in_progress:
            values["attempts_in_progress"] = o.c.attempts_in_progress + 1
        if settled:
            values["finished_at"] = bindparam("b_now")
        if has_result:
            values.update(
                result_status=bindparam("b_rstatus"),
                result_headers=bindparam("b_rheaders"),
                result_body=bindparam("b_rbody"),
                result_sha256=bindparam("b_rsha"),
                result_size=bindparam("b_rsize"),
                result_truncated=bindparam("b_rtrunc"),
            )
        stmt = (
            update(o)
            .where(o.c.id == bindparam("b_pk"), o.c.lease_token == bindparam("b_token"))
            .values(values)
        )
        _OUTCOME_UPDATES[key] = stmt
    return stmt


_ATTEMPT_OUTCOME = (
    update(a)
    .where(a.c.request_id == bindparam("b_rid"), a.c.delivery.is_(None))
    .values(
        delivery=bindparam("b_delivery"),
        verdict=bindparam("b_verdict"),
        counted=bindparam("b_counted"),
        status_code=bindparam("b_status"),
        receiver_request_id=bindparam("b_rrid"),
        error_class=bindparam("b_eclass"),
        error_message=bindparam("b_emsg"),
        duration_ms=bindparam("b_duration"),
        finished_at=bindparam("b_now"),
    )
)


def operation_row(
    *,
    tenant: str,
    operation_id: str,
    args: CanonicalArgs,
    ordering_key: str | None,
    now_ms: int,
    traceparent: str | None = None,
    policy: PolicySnapshot | None = None,
) -> dict[str, Any]:
    """The row of a new pending operation."""
    return {
        **policy_columns(policy),
        "tenant": tenant,
        "operation_id": operation_id,
        "endpoint": args.endpoint,
        "method": args.method,
        "path": args.path,
        "headers": json.dumps(args.headers, sort_keys=True, separators=(",", ":")),
        "body": args.body_json,
        "args_sha256": args.args_sha256,
        "ordering_key": ordering_key,
        "state": State.PENDING.value,
        "attempts_counted": 0,
        "attempts_total": 0,
        "maybe_delivered": False,
        "saw_refusal": False,
        "next_attempt_at": now_ms,
        "version": 0,
        "created_at": now_ms,
        "updated_at": now_ms,
        "traceparent": traceparent,
    }


def policy_columns(policy: PolicySnapshot | None) -> dict[str, int | None]:
    """The ``policy_*`` columns of a snapshot (all NULL: unknown)."""
    return {
        "policy_window_ms": policy.window_ms if policy else None,
        "policy_key_retention_ms": policy.key_retention_ms if policy else None,
        "policy_margin_ms": policy.margin_ms if policy else None,
        "policy_max_attempts": policy.max_attempts if policy else None,
        "policy_in_progress_budget": policy.in_progress_budget if policy else None,
    }


def _policy(r: Row[Any]) -> PolicySnapshot | None:
    if (
        r.policy_window_ms is None
        or r.policy_key_retention_ms is None
        or r.policy_margin_ms is None
        or r.policy_max_attempts is None
    ):
        return None
    return PolicySnapshot(
        window_ms=r.policy_window_ms,
        key_retention_ms=r.policy_key_retention_ms,
        margin_ms=r.policy_margin_ms,
        max_attempts=r.policy_max_attempts,
        in_progress_budget=r.policy_in_progress_budget
        if r.policy_in_progress_budget is not None
        else 0,
    )



def _attempt(r: Row[Any]) -> Attempt:
    return Attempt(
        number=r.number,
        request_id=r.request_id,
        dispatcher_id=r.dispatcher_id,
        started_at_ms=r.started_at,
        lease_until_ms=r.lease_until,
        finished_at_ms=r.finished_at,
        delivery=Delivery(r.delivery) if r.delivery else None,
        verdict=Verdict(r.verdict) if r.verdict else None,
        status_code=r.status_code,
        receiver_request_id=r.receiver_request_id,
        error_class=r.error_class,
        error_message=r.error_message,
        duration_ms=r.duration_ms,
        counted=bool(r.counted),
    )


def _operation(r: Row[Any], history: tuple[Attempt, ...]) -> Operation:
    result = None
    if r.result_status is not None:
        body: Any = json.loads(r.result_body) if r.result_body is not None else None
        result = Result(
            status_code=r.result_status,
            headers=json.loads(r.result_headers or "{}"),
            body=body,
            body_sha256=r.result_sha256,
            body_size=r.result_size or 0,
            truncated=bool(r.result_truncated),
        )
    return Operation(
        pk=r.id,
        tenant=r.tenant,
        operation_id=r.operation_id,
        endpoint=r.endpoint,
        method=r.method,
        path=r.path,
        headers=json.loads(r.headers),
        body=json.loads(r.body) if r.body is not None else None,
        state=State(r.state),
        reason=Reason(r.reason) if r.reason else None,
        ordering_key=r.ordering_key,
        attempts_counted=r.attempts_counted,
        attempts_total=r.attempts_total,
        created_at_ms=r.created_at,
        updated_at_ms=r.updated_at,
        next_attempt_at_ms=r.next_attempt_at,
        first_attempt_at_ms=r.first_attempt_at,
        window_started_at_ms=r.window_started_at,
        version=r.version,
        result=result,
        attempts=history,
        attempts_in_progress=r.attempts_in_progress or 0,
        last_error=r.last_error,
        policy=_policy(r),
    )


__all__ = ["DUE", "AuditRecord", "InsertResult", "Store", "operation_row", "policy_columns"]
