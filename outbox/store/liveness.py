"""Liveness: of pooled connections (below), and of the dispatchers holding leases
(:func:`gone_holders`, at the end).

A pooled PostgreSQL connection is pinged before use once it has sat idle.

SQLAlchemy's ``pool_pre_ping`` pings on every checkout: a round trip before every
enqueue of its own transaction, on top of BEGIN, INSERT and COMMIT. A connection given
back to the pool a moment ago was alive a moment ago; one that sat idle may since have
been cut (a server restart, a failover, a firewall's idle timeout). So a connection idle
for :data:`PING_AFTER_IDLE_SECONDS` or more is pinged when it is checked out, and a dead
one is replaced before anyone uses it, with every other connection of that pool made
before it (the checkout event raises ``InvalidatePoolError``: the pool discards them and
checks out a fresh connection, as it does with ``pool_pre_ping``).

What that gives up: a connection cut within the last second is found dead by its next
statement instead. enqueue's own transaction retries once, on a fresh connection, when
its connection is lost before COMMIT is sent (nothing can have been stored; see
``outbox.store.commit``); the dispatcher reconnects on its own; a read in flight fails
once, and the pool has by then discarded every connection of the old server.

``outbox.create_engine(url, pool_pre_ping=True)`` keeps SQLAlchemy's ping on every
checkout.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from sqlalchemy import Connection, Engine, event, select
from sqlalchemy.exc import InvalidatePoolError

from outbox.model import State
from outbox.store.tables import dispatchers, operations

#: A pooled connection idle this long (seconds) is pinged before it is used again.
PING_AFTER_IDLE_SECONDS = 1.0

_IDLE_SINCE = "outbox_idle_since"


def ping_when_idle(engine: Engine) -> None:
    """Install the idle-connection ping on ``engine``'s pool."""
    dialect = engine.dialect

    @event.listens_for(engine.pool, "checkin")
    def _checked_in(dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info[_IDLE_SINCE] = time.monotonic()

    @event.listens_for(engine.pool, "checkout")
    def _checked_out(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        since = record.info.pop(_IDLE_SINCE, None)
        if since is None or time.monotonic() - since < PING_AFTER_IDLE_SECONDS:
            return  # just connected, or in use a moment ago
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as exc:
            if dialect.is_disconnect(exc, dbapi_connection, None):
                # Every connection made before now goes (the server they knew is gone,
                # as pool_pre_ping does); the pool checks out a fresh one.
                raise InvalidatePoolError(f"pooled connection found dead: {exc}") from exc
            raise


#: A clock steady this long takes any expired lease over: no need to look for holders.
_STEADY_ENOUGH_MS = 24 * 3_600_000
#: How often a store looks for gone holders (``SqliteStore``); a holder gone stays gone.
GONE_LOOKUP_SECONDS = 1.0


def gone_holders(conn: Connection, *, now_ms: int, steady_ms: int | None) -> list[str]:
    """The dispatchers holding an expired lease longer than ``steady_ms`` (the leases
    the claim's steady rule holds back, DESIGN-NOTES "Leases that survive a clock step")
    that are known to have exited: they ran on this host and no process has their pid.

    A dispatcher that exited sends nothing more, so its lease, expired by the wall
    clock, can be taken over even by a claimer whose clock is not yet steady: a
    dispatcher run by cron (``dispatch --once``) still recovers a crashed one's work.
    Host and pid come from the dispatcher's heartbeat row, else from the default
    dispatcher id (``host:pid:random``; ``--once`` writes no heartbeat). A live pid (or
    one reused since) or another host: not gone. This process's own: not gone.
    """
    if steady_ms is None or steady_ms >= _STEADY_ENOUGH_MS:
        return []
    t = operations.c
    rows = conn.execute(
        select(t.lease_owner, dispatchers.c.host, dispatchers.c.pid)
        .distinct()
        .select_from(operations.outerjoin(dispatchers, dispatchers.c.id == t.lease_owner))
        .where(
            t.state == State.IN_FLIGHT.value,
            t.next_attempt_at <= now_ms,
            t.lease_until - t.updated_at > steady_ms,
        )
    ).all()
    return [r[0] for r in rows if r[0] is not None and _exited(r[0], r[1], r[2])]


def _exited(dispatcher_id: str, host: str | None, pid: int | None) -> bool:
    if host is None or pid is None:
        parts = dispatcher_id.split(":")
        if len(parts) != 3 or not parts[1].isdigit():
            return False  # a dispatcher id of its own, and no heartbeat: unknown
        host, pid = parts[0], int(parts[1])
    if host != socket.gethostname() or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False  # alive, another user's (EPERM)
    return False
