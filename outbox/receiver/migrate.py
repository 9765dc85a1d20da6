"""Runs the receiver kit's own Alembic migrations (its own version table)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import DBAPIError

from outbox.errors import SchemaError, StoreError

VERSION_TABLE = "outbox_receiver_alembic_version"
#: The newest receipts revision this code expects.
HEAD = "r0001"
#: PostgreSQL advisory lock serialising concurrent upgrades ("receipt").
MIGRATION_LOCK_KEY = 0x72656365697074


def migrations_dir() -> Path:
    """The receipts migrations bundled with the package, or the source checkout's."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "migrations", here.parent.parent / "receiver_migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise SchemaError(f"the receiver kit's migrations are missing (looked beside {here})")


def current_revision(engine: Engine) -> str | None:
    """The receipts schema's revision in ``engine``'s database, None before the first."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        value = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
        return str(value) if value is not None else None


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply the receipts migrations up to ``revision`` (idempotent, concurrency-safe)."""
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SET LOCAL statement_timeout = 0"))
                conn.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_KEY})"))
            config.attributes["connection"] = conn
            command.upgrade(config, revision)
    except DBAPIError as exc:
        where = engine.url.render_as_string(hide_password=True)
        raise StoreError(f"cannot migrate the receipts in {where}: {exc.orig!r}") from exc


def downgrade(engine: Engine, revision: str = "base") -> None:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    with engine.begin() as conn:
        config.attributes["connection"] = conn
        command.downgrade(config, revision)


__all__ = ["HEAD", "VERSION_TABLE", "current_revision", "downgrade", "migrations_dir", "upgrade"]
