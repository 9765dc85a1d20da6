"""A business deadline of the operation's own.

* ``deliver_within_ms``: what ``enqueue(deliver_within=...)`` gave, in milliseconds
  after enqueue: how long a never-sent operation may still be tried before it goes to
  reconciliation as ``never_delivered``. NULL (every row enqueued before, and every
  enqueue without it): the endpoint policy's ``RetryPolicy.deliver_within``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.add_column(sa.Column("deliver_within_ms", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.drop_column("deliver_within_ms")
