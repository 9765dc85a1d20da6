"""Alembic environment for the outbox tables.

Run through ``outbox migrate`` (or ``outbox.store.migrate.upgrade``), which passes the
connection in. Applications with their own Alembic can instead add
``outbox.store.tables.metadata`` to their ``target_metadata``; the outbox keeps its own
version table, ``outbox_alembic_version``, so a host's ``alembic_version`` is untouched.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine

from outbox.store.tables import metadata

VERSION_TABLE = "outbox_alembic_version"


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no connection given and sqlalchemy.url is not set")
    engine = create_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
