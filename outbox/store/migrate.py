"""Runs the bundled Alembic migrations and checks the schema version at start-up."""

from __future__ import annotations

from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from outbox.errors import SchemaError, StoreError
from outbox.store.engine import schema_of
from outbox.store.revisions import (
    HEAD,
    VERSION_TABLE,
    check_known,
    migrations_dir,
)


def _config(engine: Engine, connection: object | None = None) -> object:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    # Alembic's Config is a ConfigParser: a literal '%' (percent-encoded passwords,
    # ``options=-csearch_path%3D...``) must be doubled or interpolation rejects it.
    url = engine.url.render_as_string(hide_password=False)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


#: Key of the PostgreSQL advisory lock that serialises concurrent upgrades
#: (``outbox migrate`` started by several deploy steps at once).
MIGRATION_LOCK_KEY = 0x6F7574626F78  # "outbox"


def _where(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)


def current_revision(engine: Engine) -> str | None:
    try:
        # A read: on SQLite a plain BEGIN, not BEGIN IMMEDIATE, so it never waits for
        # (or blocks) a writer, e.g. a request's transaction in the same process.
        with engine.execution_options(outbox_read_only=True).connect() as conn:
            return _revision(conn)
    except DBAPIError as exc:
        raise StoreError(f"cannot read {_where(engine)}: {_first_line(exc)}") from exc


def _revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table(VERSION_TABLE):
        return None
    return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def _first_line(exc: DBAPIError) -> str:
    text_ = str(exc.orig or exc).strip()
    return text_.splitlines()[0] if text_ else type(exc.orig or exc).__name__


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (idempotent; safe to run concurrently).

    On PostgreSQL the upgrade holds a transaction-scoped advisory lock, so concurrent
    runs queue up and all but the first find nothing to do; SQLite serialises writers
    on its own. A database at a revision this code does not know is refused untouched.
    """
    from alembic import command

    schema = schema_of(engine)
    try:
        if schema is not None:
            with engine.begin() as conn:
                conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                # Migrations may take longer than the statement timeout our engines set.
                conn.execute(text("SET LOCAL statement_timeout = 0"))
                conn.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))
            check_known(_revision(conn), _where(engine))
            command.upgrade(_config(engine, conn), revision)  # type: ignore[arg-type]
    except DBAPIError as exc:
        raise StoreError(f"cannot migrate {_where(engine)}: {_first_line(exc)}") from exc


def downgrade(engine: Engine, revision: str = "base") -> None:
    from alembic import command

    with engine.begin() as conn:
        command.downgrade(_config(engine, conn), revision)  # type: ignore[arg-type]


def ensure_schema(engine: Engine, *, create: bool) -> None:
    """Check the schema is at HEAD; on ``create``, migrate it there first."""
    revision = current_revision(engine)
    if revision == HEAD:
        return
    check_known(revision, _where(engine))
    if create:
        upgrade(engine)
        return
    where = "is missing" if revision is None else f"is at revision {revision}, not {HEAD}"
    schema = schema_of(engine)
    place = engine.url.render_as_string(hide_password=True)
    if schema is not None:
        place += f" (schema {schema})"
    raise SchemaError(
        f"the outbox schema {where} in {place}; run: outbox migrate --db URL",
        missing=revision is None,
    )


__all__ = [
    "HEAD",
    "VERSION_TABLE",
    "check_known",
    "current_revision",
    "downgrade",
    "ensure_schema",
    "migrations_dir",
    "upgrade",
]
