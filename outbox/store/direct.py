"""One new operation's own transaction, on the driver's own connection.

An ``enqueue`` without ``connection=`` is BEGIN, one INSERT … RETURNING and COMMIT. Run
through SQLAlchemy's ``Connection`` that costs ~300 µs of Python per enqueue (the
checkout, the ``begin`` event, the execution context and result, the commit, the
checkin) where SQLite spends ~50 µs on the statement and its ``synchronous=FULL``
commit. :class:`DirectInsert` sends the store's own INSERT — compiled once by
SQLAlchemy, for the engine's dialect — on the pooled DBAPI connection: the pool's events
run as for any checkout (the idle-connection ping, the connect pragmas), and the rows
and the locks are the same (``BEGIN IMMEDIATE`` on SQLite).

It reports a failure for :func:`outbox.store.commit.insert_and_commit` to tell apart,
as ``write_and_commit`` does on the SQLAlchemy path: :class:`LostBeforeCommit` (the
connection died before COMMIT was sent: nothing is stored), ``NotStoredError`` (any
other failure before COMMIT), :class:`CommitFailed` (the COMMIT itself; the connection is
closed and discarded first, so its transaction can no longer commit from this side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from outbox.errors import NotStoredError
from outbox.store.busy import begin_write
from outbox.store.engine import SQLITE_BUSY_TIMEOUT_MS
from outbox.store.marker import COLUMN as MARKER_COLUMN
from outbox.store.tables import operations

if TYPE_CHECKING:
    from sqlalchemy import Engine


class LostBeforeCommit(Exception):
    """The connection died before COMMIT was sent: nothing is stored."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class CommitFailed(Exception):
    """The COMMIT failed: its outcome must be established. ``marker`` names the
    transaction where the database can say what became of it (PostgreSQL)."""

    def __init__(self, error: BaseException, pk: int, marker: str | None) -> None:
        super().__init__(str(error))
        self.error = error
        self.pk = pk
        self.marker = marker


class DirectInsert:
    """The store's single-row enqueue INSERT, compiled once, run on a DBAPI connection."""

    def __init__(self, engine: Engine, statement: Any, columns: tuple[str, ...]) -> None:
        dialect = engine.dialect
        compiled = statement.compile(dialect=dialect, column_keys=list(columns))
        self._engine = engine
        self._columns = columns
        self._sql = compiled.string
        # Constants of the statement itself (PostgreSQL's NOTIFY channel), then the row.
        self._constants = {
            k: v for k, v in compiled.construct_params(dict.fromkeys(columns)).items()
            if k not in columns
        }  # fmt: skip
        self._positions = tuple(compiled.positiontup) if compiled.positiontup else None
        processors = {name: operations.c[name].type.bind_processor(dialect) for name in columns}
        self._processors: dict[str, Callable[[Any], Any]] = {
            name: p for name, p in processors.items() if p is not None
        }
        self._sqlite = dialect.name == "sqlite"
        self._dialect = dialect

    def accepts(self, row: dict[str, Any]) -> bool:
        return tuple(row) == self._columns

    def _parameters(self, row: dict[str, Any]) -> Any:
        params = {**self._constants, **row}
        for name, process in self._processors.items():
            params[name] = process(params[name])
        if self._positions is not None:
            return tuple(params[name] for name in self._positions)
        return params

    def run(self, row: dict[str, Any]) -> int | None:
        """Insert ``row`` and commit: its primary key, or None when its key is already
        stored (nothing written). Raises as the module docstring says."""
        params = self._parameters(row)
        try:
            fairy = self._engine.raw_connection()
        except DBAPIError as exc:  # wrapped (the pool's checkout events)
            raise NotStoredError.because(exc.orig) from exc
        except self._dialect.loaded_dbapi.Error as exc:  # the pool's connect: the driver's own
            raise NotStoredError.because(exc) from exc
        healthy = True
        try:
            dbapi = fairy.driver_connection
            assert dbapi is not None
            cursor = None
            try:
                cursor = dbapi.cursor()
                if self._sqlite:
                    begin_write(dbapi, SQLITE_BUSY_TIMEOUT_MS,
                                lambda: cursor.execute("BEGIN IMMEDIATE"))  # fmt: skip
                cursor.execute(self._sql, params)
                rows = cursor.fetchall()  # to the statement's end: nothing left running
                names = [d[0] for d in cursor.description or ()]
                cursor.close()
            except self._dialect.loaded_dbapi.Error as exc:
                if self._dialect.is_disconnect(exc, dbapi, cursor):
                    healthy = False
                    raise LostBeforeCommit(exc) from exc
                raise NotStoredError.because(exc) from exc
            if not rows:
                return None  # already stored: nothing written; the pool rolls back
            inserted = rows[0]
            pk = int(inserted[0])
            try:
                dbapi.commit()
            except self._dialect.loaded_dbapi.Error as exc:
                healthy = False
                marker = inserted[names.index(MARKER_COLUMN)] if MARKER_COLUMN in names else None
                raise CommitFailed(exc, pk, None if marker is None else str(marker)) from exc
            return pk
        finally:
            if healthy:
                fairy.close()
            else:
                fairy.invalidate()  # closed: a failed transaction cannot commit later
