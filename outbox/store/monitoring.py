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
    #: Live operations whose key the receiver forgets soon (see ``backlog``).
    near_expiry: int = 0
    #: Pending operations no dispatcher can send now (``last_error`` set).
    unsendable: int = 0


@dataclass
class Backlog:
    """One snapshot of the live operations: per endpoint, and unresolved per reason."""

    now_ms: int
    endpoints: dict[str, EndpointBacklog] = field(default_factory=dict)
    unresolved_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def due(self) -> int:
        return sum(e.due for e in self.endpoints.values())

    @property
    def unsendable(self) -> int:
        return sum(e.unsendable for e in self.endpoints.values())


def backlog(store: Store, *, now_ms: int, near_expiry_before_ms: Mapping[str, int]) -> Backlog:
    """Per-endpoint backlog in one query.

    ``near_expiry_before_ms`` maps an endpoint to the first-attempt time before which
    its key counts as near expiry (endpoints not in it count none).
    """
    unsendable = and_(
        operations.c.state == State.PENDING.value, operations.c.last_error.is_not(None)
    )
    due_now = due_at(now_ms)
    if near_expiry_before_ms:
        cutoff: Any = case(
            {name: literal(ms) for name, ms in near_expiry_before_ms.items()},
            value=operations.c.endpoint,
            else_=None,
        )
        first = operations.c.first_attempt_at
        near: Any = func.sum(case((and_(first.is_not(None), first <= cutoff), 1), else_=0))
    else:
        near = literal(0)
    query = (
        select(
            operations.c.endpoint,
            operations.c.state,
            operations.c.reason,
            func.count().label("n"),
            func.sum(case((due_now, 1), else_=0)).label("due"),
            func.min(case((due_now, operations.c.next_attempt_at), else_=None)).label("oldest_due"),
            near.label("near"),
            func.sum(case((unsendable, 1), else_=0)).label("unsendable"),
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
        elif r.state == State.IN_FLIGHT.value:
            e.in_flight += n
        else:
            e.unresolved += n
            key = r.reason or "unknown"
            snapshot.unresolved_by_reason[key] = snapshot.unresolved_by_reason.get(key, 0) + n
        e.due += int(r.due or 0)
        e.near_expiry += int(r.near or 0)
        e.unsendable += int(r.unsendable or 0)
        if r.oldest_due is not None and (
            e.oldest_due_at_ms is None or r.oldest_due < e.oldest_due_at_ms
        ):
            e.oldest_due_at_ms = int(r.oldest_due)
    return snapshot


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
            .values(
                last_seen_at=now_ms, in_flight=in_flight, stopped_at=None, wake_mode=wake_mode
            )
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
        DispatcherRow(
            id=r.id,
            host=r.host,
            pid=r.pid,
            version=r.version,
            concurrency=r.concurrency,
            in_flight=r.in_flight,
            started_at_ms=r.started_at,
            last_seen_at_ms=r.last_seen_at,
            stopped_at_ms=r.stopped_at,
            wake_mode=r.wake_mode,
        )
        for r in rows
    ]
