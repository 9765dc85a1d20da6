"""Operations, attempts and the audit trail.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_LIVE = "state IN ('pending', 'in_flight')"


def upgrade() -> None:
    op.create_table(
        "outbox_operations",
        sa.Column("id", _PK, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(255), nullable=False, server_default=""),
        sa.Column("operation_id", sa.String(255), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("method", sa.String(16), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("headers", sa.Text(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("args_sha256", sa.String(64), nullable=False),
        sa.Column("ordering_key", sa.String(255), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(32), nullable=True),
        sa.Column("attempts_counted", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("attempts_total", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("maybe_delivered", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("saw_refusal", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("next_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("first_attempt_at", sa.BigInteger(), nullable=True),
        sa.Column("window_started_at", sa.BigInteger(), nullable=True),
        sa.Column("lease_token", sa.String(36), nullable=True),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_until", sa.BigInteger(), nullable=True),
        sa.Column("version", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("result_status", sa.Integer(), nullable=True),
        sa.Column("result_headers", sa.Text(), nullable=True),
        sa.Column("result_body", sa.Text(), nullable=True),
        sa.Column("result_sha256", sa.String(64), nullable=True),
        sa.Column("result_size", sa.Integer(), nullable=True),
        sa.Column("result_truncated", sa.Boolean(), nullable=True),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_operations"),
        sa.UniqueConstraint(
            "tenant", "operation_id", name="uq_outbox_operations_tenant_operation_id"
        ),
    )
    op.create_index(
        "ix_outbox_operations_due",
        "outbox_operations",
        ["next_attempt_at"],
        sqlite_where=sa.text(_LIVE),
        postgresql_where=sa.text(_LIVE),
    )
    op.create_index(
        "ix_outbox_operations_ordering",
        "outbox_operations",
        ["tenant", "ordering_key", "id"],
        sqlite_where=sa.text("ordering_key IS NOT NULL"),
        postgresql_where=sa.text("ordering_key IS NOT NULL"),
    )
    op.create_index(
        "ix_outbox_operations_state_updated", "outbox_operations", ["state", "updated_at"]
    )
    op.create_table(
        "outbox_attempts",
        sa.Column("id", _PK, primary_key=True, autoincrement=True),
        sa.Column("operation_pk", _PK, nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("request_id", sa.String(36), nullable=False),
        sa.Column("dispatcher_id", sa.String(255), nullable=False),
        sa.Column("lease_token", sa.String(36), nullable=False),
        sa.Column("started_at", sa.BigInteger(), nullable=False),
        sa.Column("lease_until", sa.BigInteger(), nullable=False),
        sa.Column("finished_at", sa.BigInteger(), nullable=True),
        sa.Column("delivery", sa.String(16), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=True),
        sa.Column("counted", sa.Boolean(), nullable=False, server_default=sa.text("true")),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("receiver_request_id", sa.String(255), nullable=True),
        sa.Column("error_class", sa.String(255), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("duration_ms", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_attempts"),
        sa.ForeignKeyConstraint(
            ["operation_pk"],
            ["outbox_operations.id"],
            name="fk_outbox_attempts_operation_pk_outbox_operations",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("request_id", name="uq_outbox_attempts_request_id"),
        sa.UniqueConstraint(
            "operation_pk", "number", name="uq_outbox_attempts_operation_pk_number"
        ),
    )
    op.create_index(
        "ix_outbox_attempts_open",
        "outbox_attempts",
        ["operation_pk"],
        sqlite_where=sa.text("delivery IS NULL"),
        postgresql_where=sa.text("delivery IS NULL"),
    )
    op.create_index("ix_outbox_attempts_started_at", "outbox_attempts", ["started_at"])
    op.create_table(
        "outbox_audit",
        sa.Column("id", _PK, primary_key=True, autoincrement=True),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("operation_id", sa.String(255), nullable=False),
        sa.Column("actor", sa.String(255), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("from_state", sa.String(16), nullable=True),
        sa.Column("to_state", sa.String(16), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("details", sa.Text(), nullable=True),
        sa.Column("at", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_outbox_audit"),
    )
    op.create_index("ix_outbox_audit_operation", "outbox_audit", ["tenant", "operation_id"])


def downgrade() -> None:
    op.drop_table("outbox_audit")
    op.drop_table("outbox_attempts")
    op.drop_table("outbox_operations")
