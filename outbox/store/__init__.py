"""Persistence: the only package that speaks SQL."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from outbox.store.base import Store

if TYPE_CHECKING:
    from outbox.store.postgres import PostgresStore
    from outbox.store.sqlite import SqliteStore


def store_for(engine: Engine) -> Store:
    """The store implementation for the engine's dialect (only that dialect's module,
    and SQLAlchemy's, is imported: PostgreSQL's drivers cost a SQLite reader time)."""
    if engine.dialect.name == "postgresql":
        from outbox.store.postgres import PostgresStore

        return PostgresStore(engine)
    from outbox.store.sqlite import SqliteStore

    return SqliteStore(engine)


def __getattr__(name: str) -> Any:
    if name == "PostgresStore":
        from outbox.store.postgres import PostgresStore

        return PostgresStore
    if name == "SqliteStore":
        from outbox.store.sqlite import SqliteStore

        return SqliteStore
    raise AttributeError(f"module 'outbox.store' has no attribute {name!r}")


__all__ = ["PostgresStore", "SqliteStore", "Store", "store_for"]
