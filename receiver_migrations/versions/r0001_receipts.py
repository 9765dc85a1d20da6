"""The receipts table of the receiver kit.

Revision ID: r0001
Revises:
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "r0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "outbox_receipts",
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("principal", sa.String(255), nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("route", sa.String(512), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("token", sa.String(36), nullable=False),
        sa.Column("lease_until_ms", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=True),
        sa.Column("headers", sa.Text(), nullable=True),
        sa.Column("body", sa.LargeBinary(), nullable=True),
        sa.Column("created_ms", sa.BigInteger(), nullable=False),
        sa.Column("completed_ms", sa.BigInteger(), nullable=True),
        sa.Column("expires_ms", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint(
            "tenant", "principal", "method", "route", "key", name="pk_outbox_receipts"
        ),
    )
    op.create_index("ix_outbox_receipts_lookup", "outbox_receipts", ["tenant", "principal", "key"])
    op.create_index("ix_outbox_receipts_created_ms", "outbox_receipts", ["created_ms"])


def downgrade() -> None:
    op.drop_index("ix_outbox_receipts_created_ms", table_name="outbox_receipts")
    op.drop_index("ix_outbox_receipts_lookup", table_name="outbox_receipts")
    op.drop_table("outbox_receipts")
