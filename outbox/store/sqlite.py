"""SQLite: claim in one UPDATE ... WHERE id IN (SELECT ... LIMIT n) RETURNING statement.

Every write transaction starts with BEGIN IMMEDIATE (see ``engine.configure_sqlite``),
so the claim holds the single write lock for the few milliseconds it runs and no two
dispatchers can take the same row.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import (
    Connection,
    Engine,
    Select,
    Text,
    bindparam,
    func,
    literal_column,
    select,
    text,
    update,
)
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.dialects.sqlite.base import SQLiteCompiler, SQLiteDialect
from sqlalchemy.sql.elements import ColumnElement

from outbox.errors import StoreError
from outbox.store.base import Store
from outbox.store.changes import ChangeSource, SqliteWatch, local_key
from outbox.store.changes import announce as announce_change
from outbox.store.engine import check_private_file, lock_key, sqlite_path
from outbox.store.fairness import fair_claim_sql, fair_params
from outbox.store.liveness import GONE_LOOKUP_SECONDS, gone_holders
from outbox.store.statements import CLAIM_VALUES, claim_limits, claimable_ids
from outbox.store.tables import operations
from outbox.store.writelock import held_by_caller


class _HintingCompiler(SQLiteCompiler):
    """SQLite's compiler, rendering a table hint (SQLAlchemy's own drops them) and a
    bare ``LIMIT`` (SQLAlchemy's adds ``OFFSET`` with a parameter of its own)."""

    def get_from_hint_text(self, table: Any, text: str | None) -> str | None:
        return text

    def limit_clause(self, select: Any, **kw: Any) -> str:
        assert select._offset_clause is None
        return "\n LIMIT " + self.process(select._limit_clause, **kw)


def claim_sql() -> str:
    """:func:`~outbox.store.statements.claimable_ids` as SQLite text, pinned to the
    partial due index (``INDEXED BY``), with ``:now_ms`` and ``:limit`` parameters."""
    select_ids = claimable_ids(*claim_limits()).with_hint(
        operations, "INDEXED BY ix_outbox_operations_due", "sqlite"
    )
    return str(_HintingCompiler(SQLiteDialect(paramstyle="named"), select_ids))


_DUE_SQL = fair_claim_sql("sqlite")


class SqliteStore(Store):
    dialect = "sqlite"
    #: When gone lease holders were last looked up, and the JSON array found.
    _gone: tuple[float, str] = (float("-inf"), "[]")

    def _insert_ignoring_duplicate(self) -> Any:
        statement = sqlite_insert(operations)
        return statement.on_conflict_do_nothing(index_elements=["tenant", "operation_id"])

    def _claim_statement(self) -> Any:
        # INDEXED BY: SQLite never gathers planner statistics on its own, and without them
        # it walks ix_outbox_operations_state_updated and sorts every due row: 2 s per
        # claim at a million due rows, against 5 ms through the partial due index.
        # The fair claim (store.fairness), its indexes named for the same reason.
        sql = text(_DUE_SQL).bindparams(*claim_limits(), *fair_params())
        due = sql.columns(operations.c.id).scalar_subquery()
        return (
            update(operations)
            .where(operations.c.id.in_(due))
            .values(CLAIM_VALUES)
            .returning(*self._CLAIMED_COLUMNS)
        )

    @functools.cached_property
    def _probe_claim(self) -> Any:
        due = claimable_ids(*claim_limits(), probe=True).scalar_subquery()
        return (
            update(operations)
            .where(operations.c.id.in_(due))
            .values(CLAIM_VALUES)
            .returning(*self._CLAIMED_COLUMNS)
        )

    def _probe_claim_statement(self) -> Any:
        return self._probe_claim

    def _takeover_params(
        self, conn: Connection, now_ms: int, steady_ms: int | None
    ) -> dict[str, Any]:
        # The holders of the leases the steady rule holds back that are known gone:
        # looked up at most once a second (a holder that is gone stays gone; one that
        # died since waits a second more), not at every claim.
        at, gone = self._gone
        if steady_ms is None or time.monotonic() - at >= GONE_LOOKUP_SECONDS:
            gone = json.dumps(gone_holders(conn, now_ms=now_ms, steady_ms=steady_ms))
            self._gone = (time.monotonic(), gone)
        return {"gone": gone}

    def _pks_in(self, column: ColumnElement[Any], name: str) -> ColumnElement[bool]:
        # The keys as one JSON array: the same SQL text (and prepared statement) for
        # any number of keys, each looked up by primary key or index.
        keys: Select[Any] = select(literal_column("value")).select_from(
            func.json_each(bindparam(name, type_=Text))
        )
        return column.in_(keys)

    def _pks_value(self, pks: Iterable[int]) -> Any:
        return json.dumps(list(pks))

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self._lock_key = lock_key(engine.url)

    def caller_holds_write_lock(self) -> bool:
        return self._lock_key is not None and held_by_caller(self._lock_key)

    def preflight(self) -> None:
        """Refuse a world-readable file; run ``PRAGMA quick_check``."""
        path = sqlite_path(self.engine.url)
        if path is not None:
            check_private_file(path)
        result = self.quick_check()
        if result != "ok":
            raise StoreError(f"PRAGMA quick_check failed on {path}: {result}")

    @functools.cached_property
    def _wake_key(self) -> str | None:
        path = sqlite_path(self.engine.url)
        return local_key(path) if path is not None else None

    def announce(self) -> None:
        announce_change(self._wake_key)

    def change_source(
        self, *, application_name: str, interval: float, listen_url: str | None = None
    ) -> ChangeSource | None:
        path = sqlite_path(self.engine.url)
        return SqliteWatch(path, interval=interval) if path is not None else None

    def database_bytes(self) -> int | None:
        """The file's size plus its write-ahead log's."""
        path = sqlite_path(self.engine.url)
        if path is None:
            return None
        wal = path.with_name(path.name + "-wal")
        return sum(p.stat().st_size for p in (path, wal) if p.exists())

    def vacuum(self) -> None:
        """VACUUM, then fold the write-ahead log back in so the file itself shrinks."""
        with self.engine.connect() as conn:
            # VACUUM cannot run inside a transaction: on the raw driver connection,
            # whose isolation_level is None (autocommit; see configure_sqlite).
            raw = conn.connection.dbapi_connection
            assert raw is not None
            cursor = raw.cursor()
            try:
                cursor.execute("VACUUM")
                cursor.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                cursor.close()

    def seal_failed_commit(self) -> bool:
        """Commit one write transaction after a failed COMMIT (``outbox.store.commit``).

        A COMMIT whose WAL fsync failed has written its frames after the log's last
        committed one; the WAL index does not count them, but a recovery of the log (the
        next open after every process crashed, or a damaged index) would accept them.
        A later transaction that commits writes its own frames from that same place (or
        restarts the log with new salts), so the failed frames' checksum chain is
        broken and no recovery accepts them any more. This one rewrites the header's
        ``user_version`` with its own value: one page written, nothing changed."""
        with self.engine.begin() as conn:
            version = int(conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)
            conn.exec_driver_sql(f"PRAGMA user_version = {version}")
        return True

    def quick_check(self) -> str:
        with self.read() as conn:
            result = conn.exec_driver_sql("PRAGMA quick_check").scalar()
        return str(result)
