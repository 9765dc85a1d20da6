"""``same_database``: whether a ``--db`` beside ``--app`` names the application's
database. Spellings of one database are one; another user, server, port or name is not."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from outbox.store.engine import same_database

PG = "postgresql+psycopg://shop@db.internal:5432/orders"


@pytest.mark.parametrize(
    "other",
    [
        "postgresql://shop@db.internal/orders",  # the driver and the default port implied
        "postgresql+psycopg://shop:secret@db.internal:5432/orders",  # a password
        "postgresql+psycopg://shop@db.internal:5432/orders?sslmode=require",  # an option
    ],
)
def test_spellings_of_one_postgres_database_are_one(other: str) -> None:
    assert same_database(PG, other)


@pytest.mark.parametrize(
    "other",
    [
        "postgresql+psycopg://shop@db.internal:6432/orders",  # pgbouncer's port
        "postgresql+psycopg://admin@db.internal:5432/orders",
        "postgresql+psycopg://shop@db-replica.internal:5432/orders",
        "postgresql+psycopg://shop@db.internal:5432/orders_staging",
        "postgresql+psycopg://shop@/orders?host=/run/postgresql",  # a socket, not TCP
        "sqlite:///orders",
    ],
)
def test_another_user_server_port_or_name_is_another_database(other: str) -> None:
    assert not same_database(PG, other)


def test_a_sqlite_file_is_known_by_its_resolved_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    absolute = f"sqlite:///{tmp_path / 'o.sqlite3'}"
    assert same_database("sqlite:///o.sqlite3", absolute)
    assert same_database(f"sqlite:///sub/..{os.sep}o.sqlite3", absolute)
    assert not same_database("sqlite:///sub/o.sqlite3", absolute)
    assert not same_database("sqlite://", "sqlite://")  # two in-memory databases
