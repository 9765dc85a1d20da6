"""The claim's order: priority and scheduled sends, and the fair claim's indexes.

* ``priority``: higher is claimed first within its tenant (default 0).
* ``not_before``: a scheduled send, epoch ms (NULL: none); enqueue also sets
  ``next_attempt_at`` to it, so the claim needs no extra test.
* ``ix_outbox_operations_fair``: (tenant, priority DESC, next_attempt_at, id) over due
  rows: the fair claim walks the tenants and each tenant's next rows through it.
* ``ix_outbox_operations_tenant_in_flight``: in-flight rows per (tenant, endpoint), for
  the per-tenant in-flight limit.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DUE = sa.text("state IN ('pending', 'in_flight')")
_IN_FLIGHT = sa.text("state = 'in_flight'")


def upgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.add_column(sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("not_before", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_outbox_operations_fair",
        "outbox_operations",
        ["tenant", sa.text("priority DESC"), "next_attempt_at", "id"],
        sqlite_where=_DUE,
        postgresql_where=_DUE,
    )
    op.create_index(
        "ix_outbox_operations_tenant_in_flight",
        "outbox_operations",
        ["tenant", "endpoint"],
        sqlite_where=_IN_FLIGHT,
        postgresql_where=_IN_FLIGHT,
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_operations_tenant_in_flight", table_name="outbox_operations")
    op.drop_index("ix_outbox_operations_fair", table_name="outbox_operations")
    with op.batch_alter_table("outbox_operations") as batch:
        batch.drop_column("not_before")
        batch.drop_column("priority")
