"""Persistence: the only package that speaks SQL."""

from __future__ import annotations

from sqlalchemy import Engine

from outbox.store.base import Store
from outbox.store.postgres import PostgresStore
from outbox.store.sqlite import SqliteStore


def store_for(engine: Engine) -> Store:
    """The store implementation for the engine's dialect."""
    if engine.dialect.name == "postgresql":
        return PostgresStore(engine)
    return SqliteStore(engine)


__all__ = ["PostgresStore", "SqliteStore", "Store", "store_for"]
