"""A pooled PostgreSQL connection is pinged before use once it has sat idle.

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

import time
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.exc import InvalidatePoolError

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
