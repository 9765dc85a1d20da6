"""Waiting for SQLite's write lock in steps of a fraction of a millisecond.

SQLite's own busy handler (``PRAGMA busy_timeout``) sleeps 1, 2, 5, 10, 15, 20, 25, 25,
25, 50, 50, 100 ms between its tries, so a writer that finds the lock held for two
milliseconds by another writer of the same file often sleeps for tens of them. The
outbox's write transactions hold the lock for a few milliseconds (an enqueue; a
dispatcher's claim with its outcome writes), so with an application enqueuing while
its dispatcher writes, most of the waiting was the handler's sleeping: enqueues of an
in-process dispatcher's application had a p99 of 85 ms.

``BEGIN IMMEDIATE``, the statement of a write transaction that waits for the lock, is
tried here with the handler off and again after 0.1 ms, 0.2 ms, … at most 2 ms apart,
for as long as the busy timeout allows. What is left of it goes to one last ordinary
try by the caller, with the handler on, so that giving up (or any other failure of
BEGIN) is reported as SQLite's own error, as before.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from typing import Any

#: The longest pause between two tries.
_MAX_STEP = 0.002
_BUSY = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


def begin_immediate(dbapi_connection: Any, timeout_ms: int) -> int | None:
    """``BEGIN IMMEDIATE`` on a ``sqlite3`` connection, waiting for the lock in small
    steps. None when the transaction began; otherwise the milliseconds left of
    ``timeout_ms`` for the caller's last, ordinary try (the lock stayed held, or BEGIN
    failed for another reason, which that try reports)."""
    deadline = time.monotonic() + timeout_ms / 1000
    step = 0.0001
    dbapi_connection.execute("PRAGMA busy_timeout = 0")
    try:
        while True:
            try:
                dbapi_connection.execute("BEGIN IMMEDIATE")
                return None
            except sqlite3.OperationalError as exc:
                if getattr(exc, "sqlite_errorcode", None) not in _BUSY:
                    return max(0, int((deadline - time.monotonic()) * 1000))
            left = deadline - time.monotonic()
            if left <= step:
                return max(0, int(left * 1000))
            time.sleep(step)
            step = min(step * 2, _MAX_STEP)
    finally:
        dbapi_connection.execute(f"PRAGMA busy_timeout = {timeout_ms}")


def begin_write(dbapi_connection: Any, timeout_ms: int, ordinary: Callable[[], Any]) -> None:
    """Begin a write transaction: :func:`begin_immediate`, then, if the lock stayed held
    (or BEGIN failed otherwise), ``ordinary()`` (the caller's own ``BEGIN IMMEDIATE``)
    once with the busy handler waiting for what is left of ``timeout_ms`` (:func:`last_try`),
    so its error is the one the caller's path has always raised. A connection too broken
    for the pragmas is left for ``ordinary()`` to report."""
    try:
        left = begin_immediate(dbapi_connection, timeout_ms)
    except sqlite3.Error:
        left = timeout_ms
    if left is not None:
        last_try(dbapi_connection, left, ordinary, timeout_ms)


def last_try(dbapi_connection: Any, left_ms: int, begin: Any, timeout_ms: int) -> None:
    """Run ``begin()`` (the ordinary BEGIN IMMEDIATE) with the busy handler waiting at
    most ``left_ms``, then give the connection its usual ``timeout_ms`` back. A broken
    connection is left for ``begin()`` to report."""
    with contextlib.suppress(sqlite3.Error):
        dbapi_connection.execute(f"PRAGMA busy_timeout = {left_ms}")
    try:
        begin()
    finally:
        with contextlib.suppress(sqlite3.Error):
            dbapi_connection.execute(f"PRAGMA busy_timeout = {timeout_ms}")
