"""The fleet's shared state of each receiver endpoint: its circuit breaker and an
operator's pause (``outbox_endpoints``; see ``outbox.store.endpoints``).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_endpoints",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("circuit", sa.String(16), nullable=False, server_default="closed"),
        sa.Column("blocked", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("paused", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("since", sa.BigInteger(), nullable=False),
        sa.Column("failures", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("probes", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_probe_at", sa.BigInteger(), nullable=True),
        sa.Column("probe_owner", sa.String(255), nullable=True),
        sa.Column("probe_until", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_outbox_endpoints"),
    )


def downgrade() -> None:
    op.drop_table("outbox_endpoints")
