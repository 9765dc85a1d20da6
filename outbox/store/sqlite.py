"""SQLite: claim in one UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING statement.

Every write transaction starts with BEGIN IMMEDIATE (see ``engine.configure_sqlite``),
so the claim holds the single write lock for the few milliseconds it runs and no two
dispatchers can take the same row.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from outbox.errors import StoreError
from outbox.store.base import Store
from outbox.store.engine import check_private_file, sqlite_path
from outbox.store.tables import operations as o


class SqliteStore(Store):
    dialect = "sqlite"

    def _insert_ignoring_duplicate(self, values: dict[str, Any]) -> Any:
        return (
            sqlite_insert(o)
            .values(values)
            .on_conflict_do_nothing(index_elements=["tenant", "operation_id"])
            .returning(o.c.id)
        )

    def _claim_statement(self, *, now_ms: int, limit: int, values: dict[str, Any]) -> Any:
        due = self._due_ids(now_ms, limit).scalar_subquery()
        return update(o).where(o.c.id.in_(due)).values(values).returning(*self._CLAIMED_COLUMNS)

    def preflight(self) -> None:
        """Refuse a world-readable file; run ``PRAGMA quick_check``."""
        path = sqlite_path(self.engine.url)
        if path is not None:
            check_private_file(path)
        result = self.quick_check()
        if result != "ok":
            raise StoreError(f"PRAGMA quick_check failed on {path}: {result}")

    def quick_check(self) -> str:
        with self.read() as conn:
            result = conn.exec_driver_sql("PRAGMA quick_check").scalar()
        return str(result)
