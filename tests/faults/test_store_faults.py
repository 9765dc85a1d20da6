"""The database misbehaving, for real: SQLite locked by another writer past the busy
timeout, a read-only database, PostgreSQL terminating the dispatcher's connections.

"PostgreSQL server restarted" is not here: the server is shared with concurrently
running test sessions, and a restart would break theirs. Terminating this test's own
backends (by application_name) exercises the same reconnect path without touching
anyone else.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.engine import make_url
from tenacity import wait_fixed

from outbox import (
    Delivery,
    DispatcherSettings,
    Endpoint,
    FakeClock,
    NotStoredError,
    Outbox,
    RetryPolicy,
    State,
    StoreError,
)
from outbox.dispatch import failpoints
from outbox.store.engine import SQLITE_BUSY_TIMEOUT_MS
from outbox.testing.receiver import Receiver
from tests.faults.support import dispatchers, open_outbox, terminate_backends, until

BUSY_SECONDS = SQLITE_BUSY_TIMEOUT_MS / 1000


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture(autouse=True)
def _no_failpoints() -> Iterator[None]:
    failpoints.clear()
    yield
    failpoints.clear()


def _db_path(url: str) -> str:
    database = make_url(url).database
    assert database
    return database


def _count(path: str, table: str = "outbox_operations") -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])


class WriteLock:
    """Another process's writer holding the SQLite write lock (BEGIN IMMEDIATE)."""

    def __init__(self, path: str) -> None:
        # Waits for the dispatcher's own short transactions, then holds the lock.
        self.conn = sqlite3.connect(path, timeout=10, isolation_level=None)

    def __enter__(self) -> WriteLock:
        self.conn.execute("BEGIN IMMEDIATE")
        return self

    def release(self) -> None:
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")

    def __exit__(self, *exc: object) -> None:
        self.release()
        self.conn.close()


def _enqueue(ob: Outbox, op_id: str, **kw: Any) -> None:
    ob.enqueue(endpoint="receiver", method="POST", path="/orders",
               json={"operation_id": op_id}, operation_id=op_id, **kw)  # fmt: skip


# --------------------------------------------------------------------------- SQLite locked


def test_enqueue_while_another_writer_holds_the_lock_fails_clearly_and_writes_nothing(
    sqlite_url: str, receiver: Receiver
) -> None:
    ob = open_outbox(sqlite_url, receiver.url)
    path = _db_path(sqlite_url)
    try:
        with WriteLock(path):
            started = time.monotonic()
            with pytest.raises(StoreError, match="locked"):
                _enqueue(ob, "while-locked")
            waited = time.monotonic() - started
        assert BUSY_SECONDS - 0.5 <= waited <= BUSY_SECONDS + 5  # the busy timeout, no more
        assert _count(path) == 0
        _enqueue(ob, "while-locked")  # once the lock is gone, the same call works
        assert _count(path) == 1
    finally:
        ob.close()


def test_enqueue_under_lock_raises_not_stored_error(sqlite_url: str, receiver: Receiver) -> None:
    ob = open_outbox(sqlite_url, receiver.url)
    try:
        with WriteLock(_db_path(sqlite_url)), pytest.raises(NotStoredError):
            _enqueue(ob, "while-locked")
    finally:
        ob.close()


@pytest.mark.slow
def test_dispatcher_backs_off_while_locked_and_recovers(
    sqlite_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    ob = open_outbox(sqlite_url, receiver.url)
    path = _db_path(sqlite_url)
    try:
        with dispatchers(tmp_path) as start:
            d = start(sqlite_url, receiver.url, name="d")
            until(lambda: d.saw("dispatcher_started"), 20, "the dispatcher to start")
            with WriteLock(path):
                until(lambda: d.saw("store_unavailable"), BUSY_SECONDS + 10, "a failed claim")
                time.sleep(1.0)
                assert d.alive(), d.log.read_text()[-2000:]
            _enqueue(ob, "after-lock")
            until(lambda: ob.get("after-lock").state.is_settled, 30, "delivery after the lock")
            assert d.alive()
            d.stop()
        assert ob.get("after-lock").state is State.SUCCEEDED
        assert receiver.effect_count(key="after-lock") == 1
    finally:
        ob.close()


@pytest.mark.slow
def test_lock_during_the_outcome_write_is_recovered_with_one_effect(
    sqlite_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    """The request is on the wire when another writer takes the lock past the busy
    timeout: the outcome cannot be written; the lease expires; the retry is replayed."""
    ob = open_outbox(sqlite_url, receiver.url)
    path = _db_path(sqlite_url)
    receiver.faults.delay_after_commit(1.0, key="lock-mid")
    try:
        with dispatchers(tmp_path) as start:
            d = start(sqlite_url, receiver.url, name="d", lease=3.0)
            until(lambda: d.saw("dispatcher_started"), 20, "the dispatcher to start")
            _enqueue(ob, "lock-mid")
            until(lambda: receiver.requests(key="lock-mid"), 10, "the request on the wire")
            with WriteLock(path):
                until(lambda: d.saw("outcome_write_failed"), BUSY_SECONDS + 10,
                      "the failed outcome write")  # fmt: skip
            until(lambda: ob.get("lock-mid").state.is_settled, 30, "recovery")
            assert d.alive()
            d.stop()
        op = ob.get("lock-mid")
        assert op.state is State.SUCCEEDED
        # The first attempt's outcome was lost: closed as unknown by the next claim.
        # (A claim that itself waited out the lock may burn one more attempt: it reads
        # the clock before taking the lock, so its lease can be spent on arrival; the
        # pre-send check then refuses to send. Safe, and not asserted either way.)
        assert op.attempts[0].delivery is Delivery.UNKNOWN
        assert op.attempts[-1].delivery is Delivery.SENT
        assert receiver.effect_count(key="lock-mid") == 1
        seen = receiver.requests(key="lock-mid")
        assert [r.outcome for r in seen] == ["fault:delay_after_commit", "replayed"]
        assert {r.request_id for r in seen} <= {a.request_id for a in op.attempts}
    finally:
        ob.close()


# --------------------------------------------------------------------------- read-only


def _read_only_url(path: str) -> str:
    return f"sqlite:///file:{path}?mode=ro&uri=true"


def test_read_only_database_refuses_enqueue_and_sends_nothing(
    sqlite_url: str, receiver: Receiver, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # whatever a URI-style URL makes, it makes here
    path = _db_path(sqlite_url)
    seed = open_outbox(sqlite_url, receiver.url)
    _enqueue(seed, "stored-before")
    seed.close()

    ro = open_outbox(_read_only_url(path), receiver.url)
    try:
        with pytest.raises(NotStoredError, match="readonly"):
            _enqueue(ro, "while-read-only")
        with pytest.raises(StoreError):
            ro.dispatch_once()
    finally:
        ro.close()
    assert _count(path) == 1
    assert _count(path, "outbox_attempts") == 0
    assert receiver.requests() == []  # nothing sent without an attempt row


def test_read_only_in_the_callers_transaction_leaves_nothing_half_written(
    sqlite_url: str, receiver: Receiver
) -> None:
    ob = open_outbox(sqlite_url, receiver.url)
    path = _db_path(sqlite_url)
    try:
        with ob.engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        with ob.engine.connect() as conn:
            trans = conn.begin()
            conn.exec_driver_sql("INSERT INTO orders VALUES ('o-1')")
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.execute("PRAGMA query_only = ON")  # the database turns read-only
            try:
                with pytest.raises(NotStoredError):
                    _enqueue(ob, "order-1", connection=conn)
            finally:
                trans.rollback()
                driver.execute("PRAGMA query_only = OFF")
    finally:
        ob.close()
    assert _count(path) == 0
    assert _count(path, "orders") == 0


def test_database_refusing_writes_after_the_claim_sends_nothing(
    sqlite_url: str, receiver: Receiver
) -> None:
    """The claim's UPDATE has run, then the database refuses writes before the attempt
    rows are written (they share the claim's transaction): the request must not go out,
    and the claim rolls back with them, so the operation is due again at once, with no
    attempt. Later, with the database writable, it is sent once, recorded."""
    clock = FakeClock()
    ob = Outbox(
        sqlite_url,
        endpoints=[Endpoint(name="receiver", base_url=receiver.url, timeout=1.0,
                            retry=RetryPolicy(window=timedelta(minutes=5), wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=clock,
    )  # fmt: skip
    armed = threading.Event()
    read_only = threading.Event()
    claims_seen: list[str] = []

    @event.listens_for(ob.engine, "begin")
    def _maybe_read_only(conn: Any) -> None:
        conn.exec_driver_sql(f"PRAGMA query_only = {'ON' if read_only.is_set() else 'OFF'}")

    @event.listens_for(ob.engine, "before_cursor_execute")
    def _refuse_after_claim(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if read_only.is_set() and not statement.startswith("PRAGMA"):
            cursor.execute("PRAGMA query_only = ON")

    @event.listens_for(ob.engine, "after_cursor_execute")
    def _claimed(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if armed.is_set() and "ix_outbox_operations_fair" in statement:
            claims_seen.append(statement)
            read_only.set()  # the claim ran; every statement after it is refused

    try:
        _enqueue(ob, "ro-after-claim")
        armed.set()
        with pytest.raises(StoreError, match="readonly"):
            ob.dispatch_once()
        armed.clear()
        assert len(claims_seen) == 1
        assert receiver.requests() == []
        op = ob.get("ro-after-claim")
        assert (op.state, op.attempts) == (State.PENDING, ())

        read_only.clear()  # no lease to wait for: the claim never committed
        assert ob.dispatch_once().succeeded == 1
        op = ob.get("ro-after-claim")
        assert op.state is State.SUCCEEDED
        assert [r.request_id for r in receiver.requests()] == [a.request_id for a in op.attempts]
        assert receiver.effect_count() == 1
    finally:
        ob.close()


def test_outcomes_written_alone_when_the_claim_they_carry_is_refused(
    sqlite_url: str, receiver: Receiver
) -> None:
    """The transaction that writes outcomes and claims the next batch has written the
    outcomes when the database refuses the claim: all of it rolls back, then the
    outcomes are written on their own. Nothing is lost, nothing is sent twice."""
    ob = Outbox(
        sqlite_url,
        endpoints=[Endpoint(name="receiver", base_url=receiver.url, timeout=1.0,
                            retry=RetryPolicy(window=timedelta(minutes=5), wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=FakeClock(),
    )  # fmt: skip
    refusals = [1]  # how many claims to refuse after an outcome write
    wrote_outcome = threading.local()
    refused: list[str] = []

    @event.listens_for(ob.engine, "begin")
    def _new_transaction(conn: Any) -> None:
        wrote_outcome.seen = False

    @event.listens_for(ob.engine, "handle_error")
    def _writable_again(context: Any) -> None:
        # Refuse that one statement only (BEGIN IMMEDIATE itself fails while read-only).
        if context.connection is not None:
            context.connection.connection.driver_connection.execute("PRAGMA query_only = OFF")

    @event.listens_for(ob.engine, "before_cursor_execute")
    def _refuse_claim(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE outbox_attempts SET finished_at"):
            wrote_outcome.seen = True
        elif (getattr(wrote_outcome, "seen", False) and refusals[0]
              and "ix_outbox_operations_fair" in statement):  # fmt: skip
            refusals[0] -= 1
            refused.append(statement)
            cursor.execute("PRAGMA query_only = ON")

    try:
        for i in range(3):
            _enqueue(ob, f"carried-{i}")
        dispatcher = ob.dispatcher(DispatcherSettings(concurrency=1, batch_size=1))
        summary = asyncio.run(dispatcher.run(until_empty=True))
        assert len(refused) == 1
        assert summary.succeeded == 3
        for i in range(3):
            op = ob.get(f"carried-{i}")
            assert op.state is State.SUCCEEDED and len(op.attempts) == 1
            assert receiver.effect_count(key=f"carried-{i}") == 1
        assert len(receiver.requests()) == 3
    finally:
        ob.close()


# --------------------------------------------------------------------------- PostgreSQL


@pytest.mark.postgres
@pytest.mark.slow
def test_postgres_backend_terminated_mid_dispatch(
    pg_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    """pg_terminate_backend on every connection of the dispatcher (and only of it),
    once while a request is on the wire and then repeatedly during a batch."""
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade
    from tests.conftest import POSTGRES_URL

    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    name = f"outbox-fault-{uuid.uuid4().hex[:8]}"
    dispatcher_url = (
        make_url(pg_url)
        .update_query_dict({"application_name": name})
        .render_as_string(hide_password=False)
    )
    ob = open_outbox(pg_url, receiver.url)
    receiver.faults.delay_after_commit(1.0, key="pg-mid")
    try:
        with dispatchers(tmp_path) as start:
            d = start(dispatcher_url, receiver.url, name="d", lease=4.0)
            until(lambda: d.saw("dispatcher_started"), 20, "the dispatcher to start")
            _enqueue(ob, "pg-mid")
            until(lambda: receiver.requests(key="pg-mid"), 10, "the request on the wire")
            assert terminate_backends(POSTGRES_URL, name) >= 1
            until(lambda: ob.get("pg-mid").state.is_settled, 30, "pg-mid to settle")

            ids = [f"pg-storm-{i}" for i in range(30)]
            for op_id in ids:
                _enqueue(ob, op_id)
            killed = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                killed += terminate_backends(POSTGRES_URL, name)
                time.sleep(0.03)
            until(lambda: all(ob.get(i).state.is_settled for i in ids), 40, "the storm to settle")
            alive = d.alive()
            d.stop()
        assert alive, d.log.read_text()[-3000:]
        assert killed >= 1
        for op_id in ["pg-mid", *ids]:
            op = ob.get(op_id)
            assert op.state is State.SUCCEEDED, (op_id, op.state, op.attempts)
            assert receiver.effect_count(key=op_id) == 1
            requests = receiver.requests(key=op_id)
            recorded = {a.request_id for a in op.attempts}
            assert {r.request_id for r in requests} <= recorded
    finally:
        ob.close()
