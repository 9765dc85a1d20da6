"""Django's own database connection, lent to the outbox's SQL without giving up control.

An enqueue must run on the connection Django's ``transaction.atomic()`` runs on, or it
is not atomic with the model writes. The outbox's SQL is SQLAlchemy Core, so it gets a
SQLAlchemy engine whose connections are Django's DB-API connection of the calling
thread, wrapped in :class:`BorrowedConnection`:

* ``commit()``, ``rollback()`` and ``close()`` do nothing. SQLAlchemy calls them when a
  Connection ends, when its pool resets a connection and after its first-connect
  checks; passed through, any of them would end Django's transaction (a ``rollback``
  would silently discard the model writes made before the enqueue). The transaction is
  Django's: it commits or rolls back when ``atomic()`` exits, or each statement commits
  by itself in Django's autocommit mode.
* Per-connection set-up SQLAlchemy's dialects do (SQLite's ``regexp`` and ``floor``
  functions, which would replace Django's ``REGEXP``; psycopg notice handlers and the
  hstore adapter) is not applied, and no attribute of Django's connection can be set
  through the wrapper.
* No ``BEGIN`` is ever issued: the engine is a plain SQLAlchemy engine, without the
  ``BEGIN IMMEDIATE`` event of ``outbox.create_engine``; statements join whatever
  transaction Django has open.

The engine uses ``NullPool``: each checkout wraps the calling thread's Django connection
afresh (Django's connections are per thread and may be replaced between requests).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL
from sqlalchemy.pool import NullPool

from outbox.errors import ConfigurationError

#: Keys of a Django PostgreSQL ``OPTIONS`` that Django itself consumes (not libpq's).
_DJANGO_ONLY_OPTIONS = frozenset(
    {"isolation_level", "server_side_binding", "assume_role", "pool", "cursor_factory", "context"}
)
_engines: dict[str, Engine] = {}


class BorrowedConnection:
    """A Django DB-API connection as SQLAlchemy sees it: statements pass, the
    transaction and the connection's life stay Django's (see the module docstring)."""

    __slots__ = ("_dbapi",)

    def __init__(self, dbapi_connection: Any) -> None:
        object.__setattr__(self, "_dbapi", dbapi_connection)

    def cursor(self, *args: Any, **kwargs: Any) -> Any:
        return self._dbapi.cursor(*args, **kwargs)

    def commit(self) -> None:
        """Django commits (``atomic()`` exit or autocommit), never SQLAlchemy."""

    def rollback(self) -> None:
        """Django rolls back; a rollback from here would discard Django's own writes."""

    def close(self) -> None:
        """The connection is Django's to close."""

    def create_function(self, *args: Any, **kwargs: Any) -> None:
        """SQLAlchemy's SQLite set-up is skipped: it would replace Django's REGEXP."""

    def add_notice_handler(self, *args: Any, **kwargs: Any) -> None:
        """SQLAlchemy's psycopg set-up is skipped: one handler per checkout would pile up."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dbapi, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"outbox does not change Django's connection (tried to set {name})")


def _wrapper(alias: str) -> Any:
    from django.db import connections

    return connections[alias]


def _dialect_url(wrapper: Any) -> str:
    vendor = wrapper.vendor
    if vendor == "sqlite":
        return "sqlite://"
    if vendor == "postgresql":
        driver = "psycopg" if wrapper.Database.__name__ == "psycopg" else "psycopg2"
        return f"postgresql+{driver}://"
    raise ConfigurationError(
        f"outbox.contrib.django supports SQLite and PostgreSQL databases, not {vendor!r} "
        f"(DATABASES[{wrapper.alias!r}])"
    )


def borrowed_engine(alias: str = "default") -> Engine:
    """A SQLAlchemy engine over Django's connection ``alias`` (one per alias)."""
    engine = _engines.get(alias)
    if engine is None:

        def creator() -> BorrowedConnection:
            wrapper = _wrapper(alias)
            wrapper.ensure_connection()
            return BorrowedConnection(wrapper.connection)

        url = _dialect_url(_wrapper(alias))
        # No hstore: registering it would change how Django's connection loads values.
        options = {"use_native_hstore": False} if url.startswith("postgresql") else {}
        engine = create_engine(
            url, creator=creator, poolclass=NullPool, pool_reset_on_return=None, **options
        )
        _engines[alias] = engine
    return engine


def database_url(alias: str = "default") -> URL:
    """A URL for the outbox's own engine (dispatcher, reads) on Django's database."""
    wrapper = _wrapper(alias)
    settings = wrapper.settings_dict
    _dialect_url(wrapper)  # refuses other vendors
    if wrapper.vendor == "sqlite":
        name = str(settings["NAME"])
        if name == ":memory:" or "mode=memory" in name:
            raise ConfigurationError(
                f"DATABASES[{alias!r}] is an in-memory SQLite database, which only Django's "
                "own connection can see; the outbox dispatcher needs a file (for tests, set "
                "DATABASES[...]['TEST']['NAME'] to a file path)"
            )
        return URL.create("sqlite", database=name)
    query = {
        str(key): str(value)
        for key, value in (settings.get("OPTIONS") or {}).items()
        if key not in _DJANGO_ONLY_OPTIONS
    }
    return URL.create(
        "postgresql+psycopg",
        username=settings.get("USER") or None,
        password=settings.get("PASSWORD") or None,
        host=settings.get("HOST") or None,
        port=int(settings["PORT"]) if settings.get("PORT") else None,
        database=settings.get("NAME") or None,
        query=query,
    )


def migrate_schema(alias: str, revision: str) -> None:
    """Bring the outbox schema to ``revision`` on Django's connection ``alias``.

    Runs from this app's (non-atomic) Django migration: on SQLite it first switches the
    file to WAL, which needs no transaction to be open (the outbox's own engine would
    do it on connect, but then perhaps inside a request's transaction, where it cannot);
    then the migrations run in one transaction of Django's, ``atomic()``. Nothing to do
    where ``outbox migrate`` (or a later Django migration) already went as far.
    """
    from django.db import transaction

    from outbox.store.engine import enable_wal
    from outbox.store.migrate import current_revision, upgrade

    engine = borrowed_engine(alias)
    if engine.dialect.name == "sqlite":
        with engine.connect() as conn:
            enable_wal(conn)
    with transaction.atomic(using=alias):
        current = current_revision(engine)
        # Outbox revisions are numbered "0001", "0002", ...: a later one includes this one.
        if current is not None and int(current) >= int(revision):
            return
        upgrade(engine, revision)
