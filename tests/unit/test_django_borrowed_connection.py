"""BorrowedConnection: SQLAlchemy may end its own use of the connection, never Django's
transaction. A real sqlite3 connection stands in for Django's DB-API connection."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.pool import NullPool

from outbox.contrib.django.connection import BorrowedConnection


def test_commit_rollback_and_close_from_sqlalchemy_never_reach_the_lent_connection(
    tmp_path: Path,
) -> None:
    raw = sqlite3.connect(tmp_path / "app.db", isolation_level=None)  # as Django has it
    raw.execute("CREATE TABLE t (x INTEGER)")
    raw.execute("BEGIN")  # Django's atomic()
    raw.execute("INSERT INTO t VALUES (1)")  # a model write before the enqueue
    engine = sa.create_engine(
        "sqlite://", creator=lambda: BorrowedConnection(raw), poolclass=NullPool
    )
    with engine.connect() as conn:  # first connect: SQLAlchemy's checks, then rollback
        conn.execute(sa.text("INSERT INTO t VALUES (2)"))
        conn.rollback()
    with engine.begin() as conn:  # ends with commit(), then close()
        conn.execute(sa.text("INSERT INTO t VALUES (3)"))
    engine.dispose()
    assert raw.in_transaction  # still Django's open transaction
    assert raw.execute("SELECT x FROM t ORDER BY x").fetchall() == [(1,), (2,), (3,)]
    raw.execute("ROLLBACK")  # Django decides: all of it goes
    assert raw.execute("SELECT count(*) FROM t").fetchone() == (0,)
    # SQLAlchemy's regexp() was not installed over the application's own functions.
    with pytest.raises(sqlite3.OperationalError, match=r"(?i)no such function: regexp"):
        raw.execute("SELECT 'a' REGEXP 'a'")
    raw.close()


def test_attributes_of_the_lent_connection_cannot_be_set() -> None:
    raw = sqlite3.connect(":memory:", isolation_level=None)
    borrowed = BorrowedConnection(raw)
    with pytest.raises(AttributeError, match="does not change Django's connection"):
        borrowed.isolation_level = ""
    assert raw.isolation_level is None
    assert borrowed.isolation_level is None  # reads pass through
    raw.close()
