"""Waiting for SQLite's write lock in small steps (``outbox.store.busy``): a writer gets
the lock once the holder lets go, gives up with SQLite's own "database is locked" at
the timeout, and the connection keeps its busy timeout. Real SQLite files, real
threads."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from outbox.store.busy import begin_immediate, last_try
from outbox.store.engine import create_engine


def _connect(path: Path, timeout_ms: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute(f"PRAGMA busy_timeout = {timeout_ms}")
    return conn


def _busy_timeout(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA busy_timeout").fetchone()[0])


def test_a_writer_begins_once_the_holder_commits(tmp_path: Path) -> None:
    path = tmp_path / "x.sqlite3"
    holder, waiter = _connect(path, 5000), _connect(path, 5000)
    holder.execute("CREATE TABLE t (n INTEGER)")
    holder.execute("BEGIN IMMEDIATE")
    holder.execute("INSERT INTO t VALUES (1)")
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(begin_immediate(waiter, 5000)))
    thread.start()
    time.sleep(0.05)  # the waiter tries, finds the lock held, tries again
    assert thread.is_alive()
    holder.execute("COMMIT")
    thread.join(10)
    assert result == [None]  # it began
    waiter.execute("INSERT INTO t VALUES (2)")
    waiter.execute("COMMIT")
    assert [r[0] for r in holder.execute("SELECT n FROM t ORDER BY n")] == [1, 2]
    assert _busy_timeout(waiter) == 5000


def test_at_the_timeout_the_last_try_reports_sqlites_own_error(tmp_path: Path) -> None:
    path = tmp_path / "x.sqlite3"
    holder, waiter = _connect(path, 300), _connect(path, 300)
    holder.execute("BEGIN IMMEDIATE")
    started = time.monotonic()
    left = begin_immediate(waiter, 300)
    assert left is not None and 0 <= left < 300
    with pytest.raises(sqlite3.OperationalError, match="database is locked"):
        last_try(waiter, left, lambda: waiter.execute("BEGIN IMMEDIATE"), 300)
    waited = time.monotonic() - started
    assert 0.25 <= waited < 3.0  # about the timeout, once (not twice)
    assert _busy_timeout(waiter) == 300
    holder.execute("ROLLBACK")


def test_through_the_engine_a_held_lock_is_the_usual_operational_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's write transactions: same error class and message as before, and a
    connection that still waits its usual timeout afterwards."""
    import outbox.store.engine as engine_module

    monkeypatch.setattr(engine_module, "SQLITE_BUSY_TIMEOUT_MS", 300)
    engine = create_engine(f"sqlite:///{tmp_path / 'x.sqlite3'}")
    holder = _connect(tmp_path / "x.sqlite3", 300)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with pytest.raises(OperationalError, match="database is locked"), engine.begin() as c:
            c.execute(text("SELECT 1"))
        holder.execute("ROLLBACK")
        with engine.begin() as conn:
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 300
    finally:
        engine.dispose()
