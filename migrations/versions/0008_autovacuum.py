"""Autovacuum settings for the two queue tables (PostgreSQL only; nothing on SQLite).

Each operation is inserted once and updated three or four times (claimed, attempt
started, outcome recorded), each update leaving a dead row version; ``purge`` leaves
more. With autovacuum's defaults a table is vacuumed at ``50 + 0.2 x rows`` dead tuples:
2M of them at 10M rows of history, which the claim and the live figures walk past
meanwhile. These storage parameters vacuum (and analyze) the tables at a small fraction
of that, and vacuum the insert-mostly attempts table after inserts too. They are
storage parameters: setting them takes a SHARE UPDATE EXCLUSIVE lock, which blocks no
read or write (only other DDL and a vacuum of the table), and they do nothing where
autovacuum is off server-wide. The vacuum's I/O budget (``autovacuum_vacuum_cost_limit``)
is left to the server's operator (docs/guide/retention.md).

Revision ID: 0008
Revises: 0006
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: Per table: storage parameter -> value. Also in docs/guide/retention.md.
SETTINGS: dict[str, dict[str, str]] = {
    "outbox_operations": {
        "autovacuum_vacuum_scale_factor": "0.01",
        "autovacuum_vacuum_threshold": "5000",
        "autovacuum_analyze_scale_factor": "0.02",
        "autovacuum_analyze_threshold": "5000",
    },
    "outbox_attempts": {
        "autovacuum_vacuum_scale_factor": "0.02",
        "autovacuum_vacuum_threshold": "5000",
        "autovacuum_analyze_scale_factor": "0.05",
        "autovacuum_vacuum_insert_scale_factor": "0.05",
    },
}
#: Parameters a server older than this version number does not know (PostgreSQL 13).
_SINCE = {"autovacuum_vacuum_insert_scale_factor": 130000}


def _settings() -> dict[str, dict[str, str]]:
    bind = op.get_bind()
    version = int(bind.exec_driver_sql("SHOW server_version_num").scalar_one())
    return {
        table: {k: v for k, v in params.items() if version >= _SINCE.get(k, 0)}
        for table, params in SETTINGS.items()
    }


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, params in _settings().items():
        pairs = ", ".join(f"{k} = {v}" for k, v in params.items())
        op.execute(f"ALTER TABLE {table} SET ({pairs})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table, params in _settings().items():
        op.execute(f"ALTER TABLE {table} RESET ({', '.join(params)})")
