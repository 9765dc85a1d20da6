"""Engines configured the way outbox needs them, for SQLite and PostgreSQL."""

from __future__ import annotations

import os
import re
import sqlite3
import stat
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection, Engine, event
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.util import asbool

from outbox.errors import ConfigurationError, SchemaError, StoreError
from outbox.store.busy import begin_write
from outbox.store.liveness import ping_when_idle
from outbox.store.sqlitefile import check_sqlite_file
from outbox.store.tables import attach_postgresql_options
from outbox.store.writelock import track

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: How long a SQLite writer waits for the lock before giving up, in milliseconds.
#: Long enough to ride out another process's short write transaction (ours are a few
#: milliseconds), short enough that a stuck writer becomes a clear error rather than a
#: silent stall of the caller's request.
SQLITE_BUSY_TIMEOUT_MS = 5000

DEFAULT_URL = "sqlite:///outbox.sqlite3"

_SCHEMA_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
#: The PostgreSQL schema each engine made here keeps the outbox tables in (None: the
#: server's search_path, usually ``public``).
_SCHEMAS: weakref.WeakKeyDictionary[Engine, str] = weakref.WeakKeyDictionary()


def check_schema_name(schema: str) -> str:
    """A PostgreSQL schema name outbox accepts: a plain identifier, 1-63 characters."""
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema must be a plain identifier (letters, digits, _; 1-63), got {schema!r}"
        )
    return schema


def schema_of(engine: Engine) -> str | None:
    """The schema given to :func:`create_engine` for this engine, if any."""
    return _SCHEMAS.get(engine)


def normalize_url(url: str | URL) -> URL:
    """Accept ``postgresql://`` and pick the psycopg 3 driver for it."""
    try:
        parsed = make_url(url)
    except ValueError as exc:  # SQLAlchemy's own parse: a port that is not a number
        raise ConfigurationError(f"not a database URL outbox can use ({exc})") from None
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise ConfigurationError(
            f"unsupported database {parsed.drivername!r}: use sqlite or postgresql"
        )
    if parsed.get_driver_name() in _ASYNC_DRIVERS:
        raise ConfigurationError(
            f"unsupported driver {parsed.drivername!r}: outbox needs a synchronous driver "
            "(its database calls run on a thread of its own): use sqlite:/// or "
            "postgresql+psycopg://"
        )
    return parsed


#: SQLAlchemy's asyncio drivers: their engines cannot be used by a plain Connection.
_ASYNC_DRIVERS = frozenset({"aiosqlite", "asyncpg", "psycopg_async", "pysqlite_async"})


def same_database(a: str | URL, b: str | URL) -> bool:
    """Whether two URLs name one database: a SQLite file by its resolved path; a
    PostgreSQL database by its user, server and name (the driver, the password and the
    connection options aside; the port 5432 when none is given)."""
    first, second = normalize_url(a), normalize_url(b)
    if first.get_backend_name() != second.get_backend_name():
        return False
    if first.get_backend_name() == "sqlite":
        one, other = sqlite_path(first), sqlite_path(second)
        if one is None or other is None:
            return False  # in memory: each engine's own database, never another's
        return one.resolve() == other.resolve()
    return _server(first) == _server(second)


def _server(url: URL) -> tuple[str | None, ...]:
    """What picks a PostgreSQL database, from the URL or libpq's query arguments."""
    query = {k: str(v) for k, v in url.query.items()}
    port = url.port or query.get("port") or 5432
    return (url.username or query.get("user"), url.host or query.get("host"), str(port),
            url.database or query.get("dbname"), query.get("service"))  # fmt: skip


def sqlite_path(url: URL) -> Path | None:
    """The file behind a SQLite URL, or None for an in-memory database."""
    database = url.database
    if not database or database == ":memory:" or database.startswith("file::memory:"):
        return None
    if database.startswith("file:"):
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(database)
        if url.query.get("mode") == "memory" or "mode=memory" in parts.query:
            return None
        return Path(unquote(parts.path))
    return Path(database)


def create_private_file(path: Path) -> None:
    """Create an empty database file readable and writable by its owner only (0600).

    SQLite gives the -wal and -shm files the same mode as the database file.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return
    os.close(fd)


def check_private_file(path: Path) -> None:
    """Refuse a database file that group or others can read or write."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise StoreError(
            f"refusing to use {path}: its mode is {mode:04o}, readable by group or others; "
            f"it holds request arguments. Run: chmod 600 {path}"
        )


#: libpq connection settings on PostgreSQL engines we create (each overridable by the
#: URL's query or ``connect_args``): give up connecting after 10 s; TCP keepalives so a
#: peer that vanished (network partition, host gone) is noticed within about a minute;
#: unacknowledged data for 30 s also ends the connection.
PG_CONNECT_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
}
#: The server gives up on one of our statements after this long (our statements take
#: milliseconds; a stuck one must not hold a lease, a lock or a shutdown forever).
#: Migrations lift it for their own transaction.
PG_STATEMENT_TIMEOUT_MS = 30_000


#: Engines made by create_engine (or adopted by an Outbox): safe for our own SQLite writes.
_CONFIGURED: weakref.WeakSet[Engine] = weakref.WeakSet()


def outbox_engine(
    db: str | URL | Engine | None, *, schema: str | None, create_file: bool
) -> tuple[Engine, bool]:
    """The engine an ``Outbox`` writes through, and whether it owns it (disposes it).

    A caller's SQLite engine not made by :func:`create_engine` is replaced by one of ours
    on the same file: our own writes need ``BEGIN IMMEDIATE`` and the pragmas
    (``enqueue(connection=...)`` still joins the caller's). Any other engine is used as
    it is.
    """
    if isinstance(db, Engine) and schema is not None:
        raise ConfigurationError(
            "schema= applies to a URL; for an engine of your own, give it the "
            "search_path (outbox.create_engine(url, schema=...))"
        )
    owned = True
    if isinstance(db, Engine):
        if db.dialect.name == "sqlite" and db not in _CONFIGURED:
            engine = create_engine(db.url)
        else:
            engine, owned = db, False
    else:
        engine = create_engine(
            db if db is not None else DEFAULT_URL, schema=schema, create_file=create_file
        )
    _CONFIGURED.add(engine)
    return engine, owned


def create_engine(
    url: str | URL = DEFAULT_URL,
    *,
    schema: str | None = None,
    create_file: bool = True,
    statement_timeout_ms: int | None = PG_STATEMENT_TIMEOUT_MS,
    **kwargs: Any,
) -> Engine:
    """An engine for outbox: SQLite with WAL, ``synchronous=FULL``, a busy timeout and
    ``BEGIN IMMEDIATE`` write transactions; PostgreSQL through psycopg 3 with a connect
    timeout, TCP keepalives and a statement timeout (``statement_timeout_ms``; None
    leaves the server's). Statement parameters never appear in error messages or logs
    (``hide_parameters=True``): they carry request bodies and results.

    Every default can be overridden: the URL's query and ``connect_args`` win over
    :data:`PG_CONNECT_DEFAULTS`; other keyword arguments go to SQLAlchemy. Engines you
    make yourself and pass to ``Outbox`` should set ``hide_parameters=True`` too.

    ``schema`` (PostgreSQL only) keeps every outbox table, index and the migrations'
    version table in that schema: each connection's ``search_path`` is set to it.
    ``create_file=False`` refuses a SQLite file that does not exist instead of creating
    it (and its directories): see :class:`~outbox.errors.SchemaError`. An existing
    SQLite file that is not an outbox database file (a directory, not SQLite, truncated,
    migrated by a newer outbox) is refused before SQLite opens it, so nothing is
    converted; a ``?mode=ro`` URL is opened as a real read-only SQLite URI.

    Applications that enqueue inside their own transactions on SQLite should use an
    engine made here (or configured alike), so their transactions take the write lock
    up front instead of failing to upgrade a read lock under contention.
    """
    parsed = normalize_url(url)
    kwargs.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "postgresql":
        attach_postgresql_options()
        # A pooled connection is pinged once it sat idle, not on every checkout
        # (outbox.store.liveness); pool_pre_ping=True asks for SQLAlchemy's ping instead.
        ping_idle = "pool_pre_ping" not in kwargs
        connect_args = {
            key: value for key, value in PG_CONNECT_DEFAULTS.items() if key not in parsed.query
        }
        connect_args.update(kwargs.pop("connect_args", {}))
        if schema is not None:
            # Set at connect time by the server itself: no statement to run, nothing a
            # pool reset can undo, and Alembic's DDL and version table follow it too.
            options = connect_args.get("options") or parsed.query.get("options") or ""
            options = f"{options} -csearch_path={check_schema_name(schema)}".strip()
            connect_args["options"] = options
        engine = sa_create_engine(parsed, connect_args=connect_args, **kwargs)
        if ping_idle:
            ping_when_idle(engine)
        if schema is not None:
            _SCHEMAS[engine] = schema
        if statement_timeout_ms is not None and "statement_timeout" not in str(
            parsed.query.get("options", "")
        ):
            _set_statement_timeout(engine, statement_timeout_ms)
    else:
        if schema is not None:
            raise ConfigurationError("a schema applies to PostgreSQL only, not to SQLite")
        parsed = _sqlite_uri(parsed)
        path = sqlite_path(parsed)
        read_only = parsed.query.get("mode") == "ro"
        _check_sqlite_args(parsed)
        if path is not None:
            check_sqlite_file(path, must_exist=read_only)
            if not read_only:
                if create_file:
                    create_private_file(path)
                elif not path.is_file():
                    raise SchemaError(
                        f"no outbox database at "
                        f"{parsed.render_as_string(hide_password=True)}: {path} does not exist",
                        missing=True,
                    )
        engine = sa_create_engine(parsed, **kwargs)
        configure_sqlite(engine, read_only=read_only)
    _dispose_in_forked_children(engine)
    return engine


#: The URL arguments SQLAlchemy's pysqlite dialect passes to the driver; without
#: ``uri=true`` it drops any other (with a warning).
_PYSQLITE_ARGS = frozenset(
    {"uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements"}
)


def _check_sqlite_args(url: URL) -> None:
    """Refuse a URL argument the driver would ignore: the operator meant something by it."""
    if asbool(url.query.get("uri", False)):
        return  # the rest are SQLite's own URI arguments
    ignored = sorted(set(url.query) - _PYSQLITE_ARGS)
    if ignored:
        raise ConfigurationError(
            f"{url.render_as_string(hide_password=True)}: the SQLite driver takes no "
            f"{', '.join(map(repr, ignored))} URL argument (SQLite's own URI arguments need "
            "uri=true in the URL)"
        )


def create_async_engine(url: str | URL = DEFAULT_URL, **kwargs: Any) -> AsyncEngine:
    """An ``AsyncEngine`` configured like :func:`create_engine`: SQLite through aiosqlite
    (WAL, ``synchronous=FULL``, busy timeout, ``BEGIN IMMEDIATE``, a 0600 file) or
    PostgreSQL through psycopg 3's async driver. ``sqlite://`` and ``postgresql://``
    URLs get those drivers.
    """
    from sqlalchemy.ext.asyncio import create_async_engine as sa_create_async_engine

    parsed = normalize_url(url)
    kwargs.setdefault("hide_parameters", True)
    if parsed.get_backend_name() == "postgresql":
        if parsed.drivername == "postgresql+psycopg":
            parsed = parsed.set(drivername="postgresql+psycopg_async")
        attach_postgresql_options()
        kwargs.setdefault("pool_pre_ping", True)
        connect_args = {
            key: value for key, value in PG_CONNECT_DEFAULTS.items() if key not in parsed.query
        }
        connect_args.update(kwargs.pop("connect_args", {}))
        engine = sa_create_async_engine(parsed, connect_args=connect_args, **kwargs)
    else:
        if parsed.drivername == "sqlite":
            parsed = parsed.set(drivername="sqlite+aiosqlite")
        path = sqlite_path(parsed)
        if path is not None and parsed.query.get("mode") != "ro":
            create_private_file(path)
        engine = sa_create_async_engine(parsed, **kwargs)
        configure_sqlite(engine.sync_engine)
    _dispose_in_forked_children(engine.sync_engine)
    return engine


def lock_key(url: URL) -> str | None:
    """The name under which write transactions on this SQLite file are tracked."""
    path = sqlite_path(url)
    return None if path is None else os.path.realpath(path)


def enable_wal(conn: Connection) -> None:
    """Switch a SQLite file to WAL (persistent; outside any transaction)."""
    conn.exec_driver_sql("PRAGMA journal_mode = WAL")


def _set_statement_timeout(engine: Engine, ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # A session setting, outside any transaction; psycopg needs autocommit for it
        # not to open one.
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            dbapi_connection.execute(f"SET statement_timeout = {int(ms)}")
        finally:
            dbapi_connection.autocommit = autocommit


def _sqlite_uri(url: URL) -> URL:
    """``sqlite:///x.db?mode=ro`` as the URI form SQLite obeys.

    Without ``uri=true`` the driver ignores ``mode``: a "read-only" open would create
    (and write) the file.
    """
    database = url.database or ""
    if "mode" not in url.query or url.query.get("uri") == "true" or not database:
        return url
    if not database.startswith("file:"):
        database = f"file:{database}"
    return url.set(database=database).update_query_dict({"uri": "true"})


def configure_sqlite(engine: Engine, *, read_only: bool = False) -> None:
    """Install the pragmas and the BEGIN IMMEDIATE behaviour on a SQLite engine."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" event, not the driver, decide how transactions start.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if not read_only:  # a read-only open changes nothing, not even the journal
                cursor.execute("PRAGMA journal_mode = WAL")
                # FULL: a commit is on disk before enqueue returns, even across power loss.
                cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        if connection.get_execution_options().get("outbox_read_only"):
            connection.exec_driver_sql("BEGIN")
            return
        raw = connection.connection.driver_connection
        if not isinstance(raw, sqlite3.Connection):  # aiosqlite (create_async_engine)
            connection.exec_driver_sql("BEGIN IMMEDIATE")
            return
        begin_write(raw, SQLITE_BUSY_TIMEOUT_MS,
                    lambda: connection.exec_driver_sql("BEGIN IMMEDIATE"))  # fmt: skip

    key = lock_key(engine.url)
    if key is not None:
        track(engine, key)


def _dispose_in_forked_children(engine: Engine) -> None:
    # A pooled connection carried across fork() is shared by two processes; SQLite and
    # libpq both corrupt state that way. The child starts with an empty pool instead.
    ref = weakref.ref(engine)

    def _after_fork() -> None:
        forked = ref()
        if forked is not None:
            forked.dispose(close=False)

    os.register_at_fork(after_in_child=_after_fork)
