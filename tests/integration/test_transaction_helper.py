"""``ob.transaction()`` and the SQLite "enqueue outside your own transaction" guard.

Real SQLite files and a real PostgreSQL schema; rows are counted with a separate engine.
The cross-thread case is driven by observation, not timing: the main thread waits until
the other thread is inside its ``BEGIN IMMEDIATE`` (its stack says so) before releasing
the lock.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import outbox
from outbox import Endpoint, Intent, Operation, Outbox, ValidationError

INVENTORY = Endpoint(name="inventory", base_url="https://inventory.example")
metadata = sa.MetaData()
orders = sa.Table("orders", metadata, sa.Column("id", sa.Integer, primary_key=True))
ARGS: dict[str, Any] = {
    "endpoint": "inventory",
    "method": "POST",
    "path": "/reservations",
    "json": {"sku": "TEST-BOLT"},
    "operation_id": "order-17-reserve",
}
INSIDE = r"pass connection=… \(you are inside a transaction on this database\)"


def stored(url: str) -> tuple[list[int], list[str]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            ids = list(conn.execute(sa.select(orders.c.id).order_by(orders.c.id)).scalars())
            ops = list(
                conn.execute(sa.text("SELECT operation_id FROM outbox_operations ORDER BY id"))
                .scalars()
                .all()
            )
    finally:
        engine.dispose()
    return ids, ops


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = outbox.create_engine(db_url)
    metadata.create_all(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def ob(engine: sa.Engine) -> Iterator[Outbox]:
    with Outbox(engine, endpoints=[INVENTORY]) as box:
        yield box


def test_transaction_on_an_engine_commits_both(ob: Outbox, engine: sa.Engine, db_url: str) -> None:
    with ob.transaction(engine) as tx:
        tx.connection.execute(orders.insert().values(id=17))
        op = tx.enqueue(**ARGS)
    assert isinstance(op, Operation)
    assert stored(db_url) == ([17], ["order-17-reserve"])


def test_transaction_on_an_engine_rolls_back_both(
    ob: Outbox, engine: sa.Engine, db_url: str
) -> None:
    with pytest.raises(ZeroDivisionError), ob.transaction(engine) as tx:
        tx.connection.execute(orders.insert().values(id=17))
        tx.enqueue_many([Intent(**ARGS)])
        _ = 1 / 0
    assert stored(db_url) == ([], [])


def test_transaction_joins_a_connection_already_in_a_transaction(
    ob: Outbox, engine: sa.Engine, db_url: str
) -> None:
    with engine.connect() as conn:
        conn.execute(orders.insert().values(id=17))
        with ob.transaction(conn) as tx:
            assert tx.connection is conn
            tx.enqueue(**ARGS)
        assert conn.in_transaction()  # not committed by the helper
        conn.rollback()
    assert stored(db_url) == ([], [])


def test_transaction_begins_on_an_idle_connection_and_commits_it(
    ob: Outbox, engine: sa.Engine, db_url: str
) -> None:
    with engine.connect() as conn:
        with ob.transaction(conn) as tx:
            tx.connection.execute(orders.insert().values(id=17))
            tx.enqueue(**ARGS)
        assert not conn.in_transaction()
    assert stored(db_url) == ([17], ["order-17-reserve"])


def test_transaction_joins_an_orm_session(ob: Outbox, engine: sa.Engine, db_url: str) -> None:
    with Session(engine) as session:
        session.execute(orders.insert().values(id=17))
        with ob.transaction(session) as tx:
            tx.enqueue(**ARGS)
        session.commit()
    with Session(engine) as session, ob.transaction(session) as tx:
        session.execute(orders.insert().values(id=18))
        tx.enqueue(**{**ARGS, "operation_id": "order-18-reserve"})
    assert stored(db_url) == ([17, 18], ["order-17-reserve", "order-18-reserve"])


def test_transaction_refuses_what_is_not_a_connection(ob: Outbox) -> None:
    refused = pytest.raises(ValidationError, match="Engine, Connection or ORM Session")
    with refused, ob.transaction("sqlite:///x.db"):
        pass


def test_enqueue_on_a_connection_to_another_kind_of_database_is_refused(
    pg_url: str, sqlite_url: str
) -> None:
    from outbox.store.migrate import upgrade

    pg = outbox.create_engine(pg_url)
    upgrade(pg)
    lite = outbox.create_engine(sqlite_url)
    try:
        with (
            Outbox(pg, endpoints=[INVENTORY]) as on_pg,
            Outbox(lite, endpoints=[INVENTORY]) as on_sqlite,
        ):
            for box, other, kind in ((on_pg, lite, "sqlite"), (on_sqlite, pg, "postgresql")):
                with other.begin() as conn, pytest.raises(ValidationError, match=kind):
                    box.enqueue(**ARGS, connection=conn)
            assert on_pg.find("order-17-reserve") is None
            assert on_sqlite.find("order-17-reserve") is None
    finally:
        pg.dispose()
        lite.dispose()


# -- SQLite: own-transaction enqueue while this thread holds the write lock ---------


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[sa.Engine]:
    eng = outbox.create_engine(sqlite_url)
    metadata.create_all(eng)
    yield eng
    eng.dispose()


def test_own_transaction_enqueue_inside_ones_own_transaction_fails_at_once(
    sqlite_engine: sa.Engine, sqlite_url: str
) -> None:
    with Outbox(sqlite_engine, endpoints=[INVENTORY]) as box:
        with sqlite_engine.begin() as conn:
            conn.execute(orders.insert().values(id=17))
            with pytest.raises(ValidationError, match=INSIDE):
                box.enqueue(**ARGS)  # forgot connection=conn
            with pytest.raises(ValidationError, match=INSIDE):
                box.enqueue_many([Intent(**ARGS)])
            # The caller's transaction is untouched and still commits its own row.
        assert stored(sqlite_url) == ([17], [])
        # Once it ended, the same thread enqueues on its own without complaint...
        box.enqueue(**ARGS)
        # ...also after a rolled-back transaction, and after a read-only connection.
        with pytest.raises(KeyError), sqlite_engine.begin() as conn:
            conn.execute(orders.insert().values(id=18))
            raise KeyError
        with box.store.read() as read:
            read.execute(sa.select(orders.c.id)).all()
            box.enqueue(**{**ARGS, "operation_id": "order-19-reserve"})
    assert stored(sqlite_url) == ([17], ["order-17-reserve", "order-19-reserve"])


def test_the_guard_also_sees_a_second_engine_and_a_plain_sqlalchemy_url(
    sqlite_engine: sa.Engine, sqlite_url: str
) -> None:
    """The outbox on its own engine (made from the URL); the caller on another engine
    made by outbox.create_engine for the same file: still one file, one lock."""
    with Outbox(sqlite_url, endpoints=[INVENTORY]) as box, sqlite_engine.begin() as conn:
        conn.execute(orders.insert().values(id=17))
        with pytest.raises(ValidationError, match=INSIDE):
            box.enqueue(**ARGS)
        box.enqueue(**ARGS, connection=conn)  # the right way, same transaction
    assert stored(sqlite_url) == ([17], ["order-17-reserve"])


def test_the_guard_forgets_a_transaction_ended_by_invalidation_or_close(
    sqlite_engine: sa.Engine, sqlite_url: str
) -> None:
    with Outbox(sqlite_engine, endpoints=[INVENTORY]) as box:
        conn = sqlite_engine.connect()
        conn.execute(orders.insert().values(id=17))
        with pytest.raises(ValidationError, match=INSIDE):
            box.enqueue(**ARGS)
        conn.invalidate()  # the DB-API connection is closed: its lock is gone
        box.enqueue(**ARGS)
        conn.close()
        conn = sqlite_engine.connect()
        conn.execute(orders.insert().values(id=18))
        conn.close()  # rolls back without a commit() call
        box.enqueue(**{**ARGS, "operation_id": "order-18-reserve"})
    assert stored(sqlite_url) == ([], ["order-17-reserve", "order-18-reserve"])


def _in_begin_immediate(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside enqueue's BEGIN IMMEDIATE: SQLAlchemy's ``begin``
    event, or the driver-level transaction of ``outbox.store.direct`` (its first
    statement; it cannot pass it while another connection holds the lock)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_on_begin" or (
            code.co_name == "run" and code.co_filename.endswith("direct.py")
        ):
            return True
        frame = frame.f_back
    return False


def test_the_guard_never_fires_for_another_thread(
    sqlite_engine: sa.Engine, sqlite_url: str
) -> None:
    """Thread A holds the write lock; thread B's own-transaction enqueue must wait for
    it (the busy timeout) and then succeed — never be refused."""
    results: list[object] = []
    with Outbox(sqlite_engine, endpoints=[INVENTORY]) as box:

        def other_thread() -> None:
            try:
                results.append(box.enqueue(**ARGS))
            except BaseException as exc:
                results.append(exc)

        with sqlite_engine.begin() as conn:
            conn.execute(orders.insert().values(id=17))
            b = threading.Thread(target=other_thread)
            b.start()
            # B got past the guard and is waiting inside BEGIN IMMEDIATE for our lock.
            while not _in_begin_immediate(b) and b.is_alive():
                threading.Event().wait(0.005)
            assert b.is_alive(), results
        b.join(timeout=30)
    assert len(results) == 1
    assert isinstance(results[0], Operation), results
    assert stored(sqlite_url) == ([17], ["order-17-reserve"])


def test_find_returns_none_where_get_raises(ob: Outbox) -> None:
    assert ob.find("order-17-reserve") is None
    with ob.transaction(ob.engine) as tx:
        op = tx.enqueue(**ARGS)
    found = ob.find("order-17-reserve")
    assert found is not None
    assert found.pk == op.pk
    assert ob.find("order-17-reserve", tenant="other") is None
