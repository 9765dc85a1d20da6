"""Runs the bundled Alembic migrations and checks the schema version at start-up."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, inspect, text

from outbox.errors import SchemaError
from outbox.store.engine import schema_of

VERSION_TABLE = "outbox_alembic_version"
#: The newest revision this code expects.
HEAD = "0002"


def migrations_dir() -> Path:
    """The migrations bundled with the installed package, or the source checkout's."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "migrations", package.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise SchemaError(f"the outbox migrations are missing (looked beside {package})")


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


def current_revision(engine: Engine) -> str | None:
    # A read: on SQLite a plain BEGIN, not BEGIN IMMEDIATE, so it never waits for (or
    # blocks) a writer, e.g. a request's transaction in the same process.
    with engine.execution_options(outbox_read_only=True).connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        return conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (idempotent)."""
    from alembic import command

    schema = schema_of(engine)
    if schema is not None:
        with engine.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    with engine.begin() as conn:
        command.upgrade(_config(engine, conn), revision)  # type: ignore[arg-type]


def downgrade(engine: Engine, revision: str = "base") -> None:
    from alembic import command

    with engine.begin() as conn:
        command.downgrade(_config(engine, conn), revision)  # type: ignore[arg-type]


def ensure_schema(engine: Engine, *, create: bool) -> None:
    """Check the schema is at HEAD; on ``create``, migrate it there first."""
    revision = current_revision(engine)
    if revision == HEAD:
        return
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
