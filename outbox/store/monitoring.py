"""What monitoring reads and the dispatchers' heartbeats: the SQL behind ``outbox status``,
the scrape-time metrics and the ``outbox_dispatchers`` table.

Every function is one short transaction. The backlog snapshot is one query over the
live operations (pending, in flight, unresolved), so a scrape never walks the history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, delete, func, insert, literal, select, update

from outbox.base.fields import from_row
from outbox.model import LIVE_STATES, State, state_values
from outbox.store.base import Store
from outbox.store.statements import due_at
from outbox.store.tables import attempts, dispatchers, operations

_LIVE = state_values(LIVE_STATES)


@dataclass(frozen=True, slots=True)
class DispatcherRow:
    """One row of ``outbox_dispatchers``."""

    id: str
    host: str
    pid: int
    version: str
    concurrency: int
    in_flight: int
    started_at_ms: int
    last_seen_at_ms: int
    stopped_at_ms: int | None
    #: "listen", "poll" or "starting" (None: a dispatcher older than this column).
    wake_mode: str | None = None


@dataclass
class EndpointBacklog:
    """The live operations of one endpoint, as of one snapshot."""

    #: Pending or in flight with an expired lease, and due now.
    due: int = 0
    #: The ``next_attempt_at`` of the longest-waiting due operation.
    oldest_due_at_ms: int | None = None
    pending: int = 0
    in_flight: int = 0
    unresolved: int = 0
    #: Live, attempted operations whose key the receiver forgets within the window.
    near_expiry: int = 0
    #: Live, attempted operations whose key the receiver has already forgotten.
    key_expired: int = 0
    #: Live, attempted operations whose key retention is unknown (no policy snapshot).
    retention_unknown: int = 0
    #: Pending operations no dispatcher can send now (``last_error`` set).
    unsendable: int = 0


@dataclass
class Backlog:
    """One snapshot of the live operations: per endpoint, and unresolved per reason."""

    now_ms: int
    endpoints: dict[str, EndpointBacklog] = field(default_factory=dict)
    unresolved_by_reason: dict[str, int] = field(default_factory=dict)
    #: ``created_at`` of the oldest pending operation.
    oldest_pending_created_ms: int | None = None

    @property
    def due(self) -> int:
        return sum(e.due for e in self.endpoints.values())

    @property
    def unsendable(self) -> int:
        return sum(e.unsendable for e in self.endpoints.values())


def _key_expires_at(retention_ms_by_endpoint: Mapping[str, int]) -> Any:
    """When the receiver forgets the row's key: its first attempt plus the retention of
    its policy snapshot (or, for rows older than snapshots, of the registered endpoint)."""
    retention: Any = operations.c.policy_key_retention_ms
    if retention_ms_by_endpoint:
        fallback = case(
            {name: literal(ms) for name, ms in retention_ms_by_endpoint.items()},
            value=operations.c.endpoint,
            else_=None,
        )
        retention = func.coalesce(retention, fallback)
    return operations.c.first_attempt_at + retention


def backlog(
    store: Store,
    *,
    now_ms: int,
    near_ms: int,
    retention_ms_by_endpoint: Mapping[str, int] | None = None,
) -> Backlog:
    """Per-endpoint backlog in one query over the live rows only (the partial index
    ``ix_outbox_operations_live``), however long the history.

    A key is *near expiry* when it expires after ``now_ms`` and at most ``near_ms``
    later; *expired* when it expired at or before ``now_ms``.
    """
    unsendable = and_(
        operations.c.state == State.PENDING.value, operations.c.last_error.is_not(None)
    )
    due_now = due_at(now_ms)
    expires = _key_expires_at(retention_ms_by_endpoint or {})
    attempted = operations.c.first_attempt_at.is_not(None)

    def count(*conditions: Any) -> Any:
        return func.sum(case((and_(*conditions), 1), else_=0))

    query = (
        select(
            operations.c.endpoint,
            operations.c.state,
            operations.c.reason,
            func.count().label("n"),
            count(due_now).label("due"),
            func.min(case((due_now, operations.c.next_attempt_at), else_=None)).label("oldest_due"),
            count(attempted, expires > now_ms, expires <= now_ms + near_ms).label("near"),
            count(attempted, expires <= now_ms).label("expired"),
            count(attempted, expires.is_(None)).label("unknown"),
            count(unsendable).label("unsendable"),
            func.min(operations.c.created_at).label("oldest_created"),
        )
        .where(operations.c.state.in_(_LIVE))
        .group_by(operations.c.endpoint, operations.c.state, operations.c.reason)
    )
    snapshot = Backlog(now_ms=now_ms)
    with store.read() as conn:
        rows = conn.execute(query).all()
    for r in rows:
        e = snapshot.endpoints.setdefault(r.endpoint, EndpointBacklog())
        n = int(r.n)
        if r.state == State.PENDING.value:
            e.pending += n
            oldest = snapshot.oldest_pending_created_ms
            if oldest is None or r.oldest_created < oldest:
                snapshot.oldest_pending_created_ms = int(r.oldest_created)
        elif r.state == State.IN_FLIGHT.value:
            e.in_flight += n
        else:
            e.unresolved += n
            key = r.reason or "unknown"
            snapshot.unresolved_by_reason[key] = snapshot.unresolved_by_reason.get(key, 0) + n
        e.due += int(r.due or 0)
        e.near_expiry += int(r.near or 0)
        e.key_expired += int(r.expired or 0)
        e.retention_unknown += int(r.unknown or 0)
        e.unsendable += int(r.unsendable or 0)
        if r.oldest_due is not None and (
            e.oldest_due_at_ms is None or r.oldest_due < e.oldest_due_at_ms
        ):
            e.oldest_due_at_ms = int(r.oldest_due)
    return snapshot


def settled_counts(store: Store, *, limit: int | None = None) -> dict[str, int] | None:
    """Settled operations by state: a count over ``ix_outbox_operations_state_updated``
    (on PostgreSQL, a scan of the table: ~0.2 s per million rows).

    With ``limit``, a probe first reads at most ``limit + 1`` settled rows; None when
    there are more (the count is not made), so the read is bounded however long the
    history: the live figures never depend on it.
    """
    settled = [s.value for s in State if s not in LIVE_STATES]
    where = operations.c.state.in_(settled)
    with store.read() as conn:
        if limit is not None:
            probe = select(literal(1)).where(where).limit(limit + 1).subquery()
            if conn.execute(select(func.count()).select_from(probe)).scalar_one() > limit:
                return None
        rows = conn.execute(
            select(operations.c.state, func.count().label("n"))
            .where(where)
            .group_by(operations.c.state)
        ).all()
    return {r.state: int(r.n) for r in rows}


def attempts_by_outcome(store: Store, *, since_ms: int) -> list[tuple[str, str, int]]:
    """(delivery, verdict, count) of the attempts started since ``since_ms``.

    ``open`` for an attempt without an outcome yet, ``none`` for one without a verdict.
    """
    with store.read() as conn:
        rows = conn.execute(
            select(attempts.c.delivery, attempts.c.verdict, func.count().label("n"))
            .where(attempts.c.started_at >= since_ms)
            .group_by(attempts.c.delivery, attempts.c.verdict)
        ).all()
    return sorted((r.delivery or "open", r.verdict or "none", int(r.n)) for r in rows)


def attempts_per_minute(store: Store, *, since_ms: int) -> list[tuple[int, str, int]]:
    """(minute since ``since_ms``, verdict, count) of the attempts started since then:
    one grouped read over ``ix_outbox_attempts_started_at`` (``open`` for an attempt
    without an outcome yet, ``none`` for one without a verdict)."""
    minute = ((attempts.c.started_at - since_ms) // 60_000).label("m")
    with store.read() as conn:
        rows = conn.execute(
            select(minute, attempts.c.delivery, attempts.c.verdict, func.count().label("n"))
            .where(attempts.c.started_at >= since_ms)
            .group_by(minute, attempts.c.delivery, attempts.c.verdict)
        ).all()
    return [
        (int(r.m), r.verdict or ("open" if r.delivery is None else "none"), int(r.n)) for r in rows
    ]


# -- heartbeats --------------------------------------------------------------------------


def heartbeat(
    store: Store,
    *,
    dispatcher_id: str,
    host: str,
    pid: int,
    version: str,
    concurrency: int,
    in_flight: int,
    started_at_ms: int,
    now_ms: int,
    wake_mode: str | None = None,
) -> None:
    """Write the dispatcher's row: created by its first heartbeat, updated by the next."""
    d = dispatchers
    with store.write() as conn:
        changed = conn.execute(
            update(d)
            .where(d.c.id == dispatcher_id)
            .values(last_seen_at=now_ms, in_flight=in_flight, stopped_at=None, wake_mode=wake_mode)
        ).rowcount
        if changed == 0:
            conn.execute(
                insert(d).values(
                    id=dispatcher_id,
                    host=host[:255],
                    pid=pid,
                    version=version[:64],
                    concurrency=concurrency,
                    in_flight=in_flight,
                    started_at=started_at_ms,
                    last_seen_at=now_ms,
                    stopped_at=None,
                    wake_mode=wake_mode,
                )
            )


def dispatcher_stopped(store: Store, *, dispatcher_id: str, now_ms: int) -> None:
    """A graceful exit: the row says so at once (no wait for it to age out)."""
    d = dispatchers
    with store.write() as conn:
        conn.execute(
            update(d)
            .where(d.c.id == dispatcher_id)
            .values(last_seen_at=now_ms, in_flight=0, stopped_at=now_ms)
        )


def prune_dispatchers(store: Store, *, seen_before_ms: int) -> int:
    """Delete the rows of dispatchers not seen since ``seen_before_ms`` (stopped or lost)."""
    d = dispatchers
    with store.write() as conn:
        return int(conn.execute(delete(d).where(d.c.last_seen_at < seen_before_ms)).rowcount)


def list_dispatchers(store: Store) -> list[DispatcherRow]:
    d = dispatchers
    with store.read() as conn:
        rows = conn.execute(select(d).order_by(d.c.last_seen_at.desc(), d.c.id)).all()
    return [
        from_row(
            DispatcherRow,
            r,
            started_at_ms=r.started_at,
            last_seen_at_ms=r.last_seen_at,
            stopped_at_ms=r.stopped_at,
        )
        for r in rows
    ]


# -- the overview's history charts -------------------------------------------------------


def queue_entries(store: Store, *, since_ms: int) -> tuple[int, list[tuple[int, int]]]:
    """The reconciliation queue now: how many operations are unresolved, and (minute
    since ``since_ms``, count) of those whose ``updated_at`` (entry into the queue) is at
    or after ``since_ms``. Two reads of ``ix_outbox_operations_state_updated``."""
    unresolved = operations.c.state == State.UNRESOLVED.value
    minute = ((operations.c.updated_at - since_ms) // 60_000).label("m")
    with store.read() as conn:
        total = conn.execute(select(func.count()).where(unresolved)).scalar_one()
        rows = conn.execute(
            select(minute, func.count().label("n"))
            .where(unresolved, operations.c.updated_at >= since_ms)
            .group_by(minute)
        ).all()
    return int(total), [(int(r.m), int(r.n)) for r in rows]


def queue_exits(store: Store, *, since_ms: int) -> list[tuple[int, int | None]]:
    """(when, entered) of each departure from the reconciliation queue since
    ``since_ms``: the audit rows that took an operation out of ``unresolved`` (every
    operator action and probe settlement writes one), each with the end of the
    operation's last attempt before it (its entry into the queue, as far as the tables
    still tell; None when it has none). Reads the audit rows of that period, and the
    attempts of those operations only."""
    from outbox.store.tables import audit

    entered = (
        select(func.max(attempts.c.finished_at))
        .where(
            attempts.c.operation_pk == operations.c.id,
            attempts.c.finished_at <= audit.c.at,
        )
        .scalar_subquery()
    )
    query = (
        select(audit.c.at, entered.label("entered"))
        .select_from(
            audit.outerjoin(
                operations,
                and_(
                    operations.c.tenant == audit.c.tenant,
                    operations.c.operation_id == audit.c.operation_id,
                ),
            )
        )
        .where(
            audit.c.at >= since_ms,
            audit.c.from_state == State.UNRESOLVED.value,
            audit.c.to_state != State.UNRESOLVED.value,
        )
    )
    with store.read() as conn:
        rows = conn.execute(query).all()
    return [(int(r.at), None if r.entered is None else int(r.entered)) for r in rows]


def latency_histogram(
    store: Store, *, since_ms: int, bounds_ms: tuple[int, ...]
) -> list[tuple[str, int, int, int, int]]:
    """(endpoint, bucket, count, total ms, max ms) of the attempts started since
    ``since_ms`` that have a duration: bucket ``i`` holds durations up to
    ``bounds_ms[i]`` (and above the one before), ``len(bounds_ms)`` those above the
    last. One grouped read over ``ix_outbox_attempts_started_at``, joined to each
    attempt's operation by its primary key."""
    duration = attempts.c.duration_ms
    bucket = case(
        *((duration <= bound, literal(i)) for i, bound in enumerate(bounds_ms)),
        else_=literal(len(bounds_ms)),
    ).label("b")
    query = (
        select(
            operations.c.endpoint,
            bucket,
            func.count().label("n"),
            func.sum(duration).label("total"),
            func.max(duration).label("top"),
        )
        .select_from(attempts.join(operations, operations.c.id == attempts.c.operation_pk))
        .where(attempts.c.started_at >= since_ms, duration.is_not(None))
        .group_by(operations.c.endpoint, bucket)
    )
    with store.read() as conn:
        rows = conn.execute(query).all()
    return [(r.endpoint, int(r.b), int(r.n), int(r.total or 0), int(r.top or 0)) for r in rows]
