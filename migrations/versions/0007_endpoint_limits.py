"""The fleet's rate and in-flight limits of each receiver endpoint: the throttle and
the rate budget's cursor on ``outbox_endpoints``, and ``outbox_endpoint_slices`` (the
in-flight permits each dispatcher holds); see ``outbox.store.limits``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_endpoints") as batch:
        batch.add_column(sa.Column("rate", sa.Float(), nullable=True))
        batch.add_column(sa.Column("rate_changed_at", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("refused_at", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("rate_cursor_us", sa.BigInteger(), nullable=True))
    op.create_table(
        "outbox_endpoint_slices",
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("permits", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("wanted", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("until", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("endpoint", "owner", name="pk_outbox_endpoint_slices"),
    )


def downgrade() -> None:
    op.drop_table("outbox_endpoint_slices")
    with op.batch_alter_table("outbox_endpoints") as batch:
        batch.drop_column("rate_cursor_us")
        batch.drop_column("refused_at")
        batch.drop_column("rate_changed_at")
        batch.drop_column("rate")
