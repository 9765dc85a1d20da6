"""The exact bytes of form and raw request bodies.

* ``body_raw``: what ``enqueue(data=...)`` or ``enqueue(content=..., content_type=...)``
  stored, byte for byte, and the dispatcher sends; its content type is the stored
  ``content-type`` header. NULL for a JSON body (``body``, canonical JSON, as before) or
  no body. The query (``params=``) is part of ``path``.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.add_column(sa.Column("body_raw", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.drop_column("body_raw")
