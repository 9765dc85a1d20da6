"""Alembic environment for the receiver kit's receipts table.

Run through ``outbox.receiver.migrate.upgrade`` (or ``ReceiptStore.migrate()``), which
passes the connection in. The kit keeps its own version table,
``outbox_receiver_alembic_version``: neither a host's ``alembic_version`` nor the
outbox's own ``outbox_alembic_version`` is touched, so a service can hold both.
"""

from __future__ import annotations

from alembic import context

from outbox.receiver.tables import metadata

VERSION_TABLE = "outbox_receiver_alembic_version"

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run through outbox.receiver.migrate.upgrade (it passes a connection)")
context.configure(
    connection=connection,
    target_metadata=metadata,
    version_table=VERSION_TABLE,
    render_as_batch=connection.dialect.name == "sqlite",
    compare_type=True,
)
with context.begin_transaction():
    context.run_migrations()
