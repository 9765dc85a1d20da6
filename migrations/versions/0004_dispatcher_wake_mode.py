"""``outbox_dispatchers.wake_mode``: how each dispatcher wakes when idle ("listen",
"poll", "starting"), shown by ``outbox status`` so a dispatcher that silently polls
(LISTEN through pgbouncer in transaction pooling) is visible. NULL: an older dispatcher.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_dispatchers") as batch:
        batch.add_column(sa.Column("wake_mode", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("outbox_dispatchers") as batch:
        batch.drop_column("wake_mode")
