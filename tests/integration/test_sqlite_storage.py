"""The embedded SQLite store: private files, durable pragmas, refusal of a shared file."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import outbox
from outbox import Endpoint, Outbox, StoreError

INVENTORY = Endpoint(name="inventory", base_url="http://127.0.0.1:9")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """umask 000: a file is private only if outbox asks for it, not by luck of the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_new_database_and_its_wal_and_shm_files_are_private(
    tmp_path: Path, permissive_umask: None
) -> None:
    db = tmp_path / "sub" / "app.sqlite3"
    with Outbox(f"sqlite:///{db}", endpoints=[INVENTORY]) as ob:
        assert mode(db) == 0o600
        ob.enqueue(
            endpoint="inventory", method="POST", path="/r", json={"a": 1}, operation_id="op-1"
        )
        wal, shm = Path(f"{db}-wal"), Path(f"{db}-shm")
        assert wal.exists()
        assert shm.exists()
        assert {p.name: mode(p) for p in (db, wal, shm)} == {
            db.name: 0o600,
            wal.name: 0o600,
            shm.name: 0o600,
        }


def test_outbox_create_engine_makes_a_private_file(tmp_path: Path, permissive_umask: None) -> None:
    db = tmp_path / "caller.sqlite3"
    engine = outbox.create_engine(f"sqlite:///{db}")
    try:
        assert mode(db) == 0o600
    finally:
        engine.dispose()


def test_an_existing_file_keeps_its_mode(tmp_path: Path) -> None:
    db = tmp_path / "app.sqlite3"
    db.touch(mode=0o600)
    os.chmod(db, 0o640)
    engine = outbox.create_engine(f"sqlite:///{db}")
    engine.dispose()
    assert mode(db) == 0o640  # not silently changed: the dispatcher refuses it instead


@pytest.mark.parametrize("via", ["outbox", "create_engine"])
def test_connection_pragmas(sqlite_url: str, via: str) -> None:
    ob = Outbox(sqlite_url)
    engine = ob.engine if via == "outbox" else outbox.create_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            pragmas = {
                name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
                for name in ("journal_mode", "synchronous", "busy_timeout", "foreign_keys")
            }
        assert pragmas == {
            "journal_mode": "wal",
            "synchronous": 2,  # FULL
            "busy_timeout": 5000,
            "foreign_keys": 1,
        }
    finally:
        if engine is not ob.engine:
            engine.dispose()
        ob.close()


def test_write_transactions_take_the_lock_up_front(sqlite_url: str) -> None:
    """engine.begin() issues BEGIN IMMEDIATE: the write lock is held before any statement,
    so a second writer cannot start (busy) rather than failing later to upgrade a lock."""
    ob = Outbox(sqlite_url)
    other = sa.create_engine(sqlite_url, connect_args={"timeout": 0})
    try:
        with ob.engine.begin() as conn:
            assert conn.connection.driver_connection.in_transaction  # type: ignore[union-attr]
            with other.connect() as raw:
                with pytest.raises(sa.exc.OperationalError, match="locked"):
                    raw.exec_driver_sql("BEGIN IMMEDIATE")
                raw.rollback()
    finally:
        other.dispose()
        ob.close()


@pytest.mark.parametrize("file_mode", [0o644, 0o640, 0o604, 0o660], ids=oct)
def test_dispatcher_refuses_a_database_others_can_read(sqlite_url: str, file_mode: int) -> None:
    db = Path(sa.make_url(sqlite_url).database or "")
    with Outbox(sqlite_url, endpoints=[INVENTORY]) as ob:
        ob.enqueue(
            endpoint="inventory", method="POST", path="/r", json={"a": 1}, operation_id="op-1"
        )
        os.chmod(db, file_mode)
        before = snapshot(sqlite_url)

        with pytest.raises(StoreError, match=f"chmod 600 {db}"):
            ob.dispatch_once()

        assert snapshot(sqlite_url) == before
        assert mode(db) == file_mode
        op = ob.get("op-1")
        assert op.state == "pending"
        assert op.attempts == ()


def test_dispatcher_starts_on_a_private_database(sqlite_url: str) -> None:
    """The refusal above is about the mode: the same setup at 0600 dispatches."""
    with Outbox(sqlite_url, endpoints=[INVENTORY]) as ob:
        summary = ob.dispatch_once()  # nothing enqueued: claims nothing, sends nothing
    assert summary.claimed == 0


def snapshot(url: str) -> list[tuple[object, ...]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = [
                ("op", *r)
                for r in conn.exec_driver_sql("SELECT * FROM outbox_operations ORDER BY id")
            ]
            rows += [
                ("attempt", *r)
                for r in conn.exec_driver_sql("SELECT * FROM outbox_attempts ORDER BY id")
            ]
            rows += [
                ("audit", *r)
                for r in conn.exec_driver_sql("SELECT * FROM outbox_audit ORDER BY id")
            ]
        return rows
    finally:
        engine.dispose()
