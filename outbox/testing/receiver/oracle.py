"""Reading a receiver's SQLite file directly: what was applied, not what was answered."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

from outbox.testing.receiver.records import BUSY_TIMEOUT_SECONDS, Effect, Receipt, RequestRecord

_R = TypeVar("_R", Effect, RequestRecord, Receipt)
#: The column a record's field reads, where the names differ.
_COLUMNS = {"key": "idempotency_key"}


class Oracle:
    """Reads a receiver's SQLite file directly: effects, receipts and the request log."""

    _db_path: Path

    @property
    def db_path(self) -> Path:
        """The receiver's SQLite file."""
        return self._db_path

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        # mode=rw: a missing file is an error, not a new empty database.
        uri = self._db_path.resolve().as_uri() + "?mode=rw"
        with contextlib.closing(
            sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_SECONDS)
        ) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()

    @staticmethod
    def _where(filters: Mapping[str, Any]) -> tuple[str, list[Any]]:
        used = {column: value for column, value in filters.items() if value is not None}
        if not used:
            return "", []
        return " WHERE " + " AND ".join(f"{c} = ?" for c in used), list(used.values())

    def _records(
        self, record: type[_R], table: str, order: str, filters: Mapping[str, Any]
    ) -> list[_R]:
        """``table``'s rows in ``order`` as ``record``s: a field reads the column of its
        name (``key`` reads ``idempotency_key``); a bool field is made one."""
        where, params = self._where(filters)
        rows = self._query(f"SELECT * FROM {table}{where} ORDER BY {order}", params)
        columns = [(f.name, _COLUMNS.get(f.name, f.name), f.type == "bool") for f in fields(record)]
        return [record(**_values(r, columns)) for r in rows]

    def effects(self, tenant: str | None = None, key: str | None = None) -> list[Effect]:
        """Effect rows in id order, optionally narrowed to a tenant and/or a key."""
        return self._records(Effect, "effects", "id", {"tenant": tenant, "idempotency_key": key})

    def effect_count(self, key: str | None = None, tenant: str | None = None) -> int:
        """How many effects exist, optionally for one key and/or tenant."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        return int(self._query(f"SELECT count(*) FROM effects{where}", params)[0][0])

    def requests(self, key: str | None = None, tenant: str | None = None) -> list[RequestRecord]:
        """The request log in arrival order (admin routes are never logged)."""
        filters = {"tenant": tenant, "idempotency_key": key}
        return self._records(RequestRecord, "requests", "seq", filters)

    def receipts(self, key: str | None = None, tenant: str | None = None) -> list[Receipt]:
        """Current receipts (expired ones may still be listed until touched)."""
        filters = {"tenant": tenant, "idempotency_key": key}
        return self._records(Receipt, "receipts", "created_at_ms", filters)


def _values(row: sqlite3.Row, columns: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    """A record's keyword arguments: (field, column, is a bool) read from ``row``."""
    return {name: bool(row[column]) if flag else row[column] for name, column, flag in columns}
