"""Columns and tables for the receivers, operator, observability work.

* ``attempts_in_progress``: "still processing" answers (409 in progress) have their own
  bounded budget, counted apart from the attempts that spend ``max_attempts``.
* ``last_error``: why no dispatcher can send the operation right now (an endpoint no
  running dispatcher registered, ...), shown to operators and counted by ``status``.
* ``policy_*``: the retry policy the operation was enqueued (or first claimed) under,
  so operator tools decide requeue safety from the database alone. NULL = unknown.
* ``traceparent``: the W3C trace context active at enqueue, when tracing is on.
* ``outbox_dispatchers``: heartbeats of running dispatchers.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_NEW_OPERATION_COLUMNS = (
    "attempts_in_progress",
    "last_error",
    "policy_window_ms",
    "policy_key_retention_ms",
    "policy_margin_ms",
    "policy_max_attempts",
    "policy_in_progress_budget",
    "traceparent",
)


def upgrade() -> None:
    with op.batch_alter_table("outbox_operations") as batch:
        batch.add_column(
            sa.Column("attempts_in_progress", sa.Integer(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("last_error", sa.Text(), nullable=True))
        batch.add_column(sa.Column("policy_window_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("policy_key_retention_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("policy_margin_ms", sa.BigInteger(), nullable=True))
        batch.add_column(sa.Column("policy_max_attempts", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("policy_in_progress_budget", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("traceparent", sa.String(55), nullable=True))
    op.create_table(
        "outbox_dispatchers",
        sa.Column("id", sa.String(255), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("in_flight", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("last_seen_at", sa.BigInteger(), nullable=False),
        sa.Column("stopped_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_dispatchers"),
    )
    op.create_index(
        "ix_outbox_dispatchers_last_seen_at", "outbox_dispatchers", ["last_seen_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_dispatchers_last_seen_at", table_name="outbox_dispatchers")
    op.drop_table("outbox_dispatchers")
    with op.batch_alter_table("outbox_operations") as batch:
        for name in reversed(_NEW_OPERATION_COLUMNS):
            batch.drop_column(name)
