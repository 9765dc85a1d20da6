"""Which caller holds a SQLite write lock, for engines made by ``outbox.create_engine``.

SQLite has one writer per file. A thread (or an asyncio task) that holds a write
transaction on a file and then calls ``enqueue`` *without* ``connection=`` asks for a
second write transaction on that file from a second connection: it waits for a lock that
only it can release, and fails after the busy timeout. That is always the mistake of
forgetting ``connection=conn``, so enqueue refuses it at once.

Engines configured here start every write transaction with ``BEGIN IMMEDIATE``, so a
transaction holds the write lock from its first statement to its end. Their ``begin``
event records (connection, file, owner) and their commit, rollback and pool check-in
events forget it. The owner is the asyncio task the transaction began in, when one is
running in this thread (async engines run their events inside the caller's task), else
the thread: the check is per owner and never fires for another thread or task.
Transactions on engines not made by outbox (deferred ``BEGIN``, no events) are not
seen; neither is a lock held by another process, which is a wait, not a deadlock.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from typing import Any

from sqlalchemy import Engine, event

_lock = threading.Lock()
#: id(DB-API connection) -> (owner, file): write transactions open in this process.
_open: dict[int, tuple[weakref.ref[Any], str]] = {}


def _owner() -> Any:
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop running in this thread
        task = None
    return task if task is not None else threading.current_thread()


def held_by_caller(path: str) -> bool:
    """Whether the calling thread or task has a write transaction open on ``path``."""
    if not _open:
        return False
    me = _owner()
    with _lock:
        return any(ref() is me and held == path for ref, held in _open.values())


def track(engine: Engine, path: str) -> None:
    """Install the events that record write transactions of ``engine`` on ``path``.

    Call after the engine's own ``begin`` listener (which issues ``BEGIN IMMEDIATE``),
    so a BEGIN that failed is never recorded.
    """

    @event.listens_for(engine, "begin")
    def _began(connection: Any) -> None:
        if connection.get_execution_options().get("outbox_read_only"):
            return
        key = id(connection.connection.dbapi_connection)
        with _lock:
            _open[key] = (weakref.ref(_owner()), path)

    def _ended_sql(connection: Any) -> None:
        try:
            dbapi = connection.connection.dbapi_connection
        except Exception:  # closed or invalidated: the pool events below forget it
            return
        _forget(dbapi)

    event.listen(engine, "commit", _ended_sql)
    event.listen(engine, "rollback", _ended_sql)

    def _ended_pool(dbapi_connection: Any, *_: Any) -> None:
        _forget(dbapi_connection)

    for name in ("checkin", "reset", "invalidate", "close"):
        event.listen(engine.pool, name, _ended_pool)


def _forget(dbapi_connection: Any) -> None:
    if dbapi_connection is None or not _open:
        return
    with _lock:
        _open.pop(id(dbapi_connection), None)
