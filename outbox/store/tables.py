"""The schema: the single source for the code, the Alembic migrations and the tests.

Times are epoch milliseconds (UTC) in BIGINT columns: one representation on every
database, compared without time-zone surprises.
"""

from __future__ import annotations

import sys
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    event,
    text,
)
from sqlalchemy.engine import Connection

from outbox.model import DUE_STATES, state_values

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

# SQLite only aliases the rowid (and autoincrements) for a column typed exactly INTEGER.
_PK = BigInteger().with_variant(Integer(), "sqlite")

operations = Table(
    "outbox_operations",
    metadata,
    Column("id", _PK, primary_key=True, autoincrement=True),
    Column("tenant", String(255), nullable=False, server_default=""),
    Column("operation_id", String(255), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("method", String(16), nullable=False),
    Column("path", Text, nullable=False),
    Column("headers", Text, nullable=False),  # canonical JSON object, never credentials
    Column("body", Text, nullable=True),  # canonical JSON text
    Column("args_sha256", String(64), nullable=False),
    Column("ordering_key", String(255), nullable=True),
    Column("state", String(16), nullable=False),
    Column("reason", String(32), nullable=True),
    # Attempts that count towards max_attempts, and all attempts (409s included).
    Column("attempts_counted", Integer, nullable=False, server_default="0"),
    Column("attempts_total", Integer, nullable=False, server_default="0"),
    # What the attempt history says, kept up to date so no decision re-reads it.
    Column("maybe_delivered", Boolean, nullable=False, server_default=text("false")),
    Column("saw_refusal", Boolean, nullable=False, server_default=text("false")),
    # When the operation is next due. For in_flight rows: when the lease ends.
    Column("next_attempt_at", BigInteger, nullable=True),
    Column("first_attempt_at", BigInteger, nullable=True),
    Column("window_started_at", BigInteger, nullable=True),
    # Lease: the token of the claim that owns the row. Every write after a claim is
    # conditional on it (fencing).
    Column("lease_token", String(36), nullable=True),
    Column("lease_owner", String(255), nullable=True),
    Column("lease_until", BigInteger, nullable=True),
    # Bumped by every claim and every operator action: optimistic concurrency.
    Column("version", Integer, nullable=False, server_default="0"),
    Column("result_status", Integer, nullable=True),
    Column("result_headers", Text, nullable=True),
    Column("result_body", Text, nullable=True),
    Column("result_sha256", String(64), nullable=True),
    Column("result_size", Integer, nullable=True),
    Column("result_truncated", Boolean, nullable=True),
    Column("created_at", BigInteger, nullable=False),
    Column("updated_at", BigInteger, nullable=False),
    Column("finished_at", BigInteger, nullable=True),
    # 409 "still processing" answers: their own budget, apart from max_attempts.
    Column("attempts_in_progress", Integer, nullable=False, server_default="0"),
    # Why no dispatcher can send it now (say, an endpoint none registered). NULL: none.
    Column("last_error", Text, nullable=True),
    # The retry policy the operation lives under, snapshotted at enqueue (or at its
    # first claim for older rows), so operator tools need no application. NULL: unknown.
    Column("policy_window_ms", BigInteger, nullable=True),
    Column("policy_key_retention_ms", BigInteger, nullable=True),
    Column("policy_margin_ms", BigInteger, nullable=True),
    Column("policy_max_attempts", Integer, nullable=True),
    Column("policy_in_progress_budget", Integer, nullable=True),
    # W3C trace context active when the operation was enqueued (tracing on only).
    Column("traceparent", String(55), nullable=True),
    # Higher is claimed first within its tenant (claims stay fair across tenants).
    Column("priority", Integer, nullable=False, server_default="0"),
    # A scheduled send: not claimed before this time (epoch ms); NULL: as soon as due.
    Column("not_before", BigInteger, nullable=True),
    # The exact bytes of a form or raw body (content type: the stored content-type
    # header); NULL for a JSON body (``body``) or none. Migration 0005.
    Column("body_raw", LargeBinary, nullable=True),
    # Its own business deadline after enqueue (ms; ``enqueue(deliver_within=...)``);
    # NULL: the endpoint policy's ``deliver_within``. Migration 0009.
    Column("deliver_within_ms", BigInteger, nullable=True),
    UniqueConstraint("tenant", "operation_id"),
)

# Due work only: the index stays as small as the live backlog, however many finished
# operations the table holds.
_due = Index(
    "ix_outbox_operations_due",
    operations.c.next_attempt_at,
    sqlite_where=operations.c.state.in_(state_values(DUE_STATES)),
)
_ordering = Index(
    "ix_outbox_operations_ordering",
    operations.c.tenant,
    operations.c.ordering_key,
    operations.c.id,
    sqlite_where=operations.c.ordering_key.is_not(None),
)
# The fair claim (store.fairness): each tenant's due rows in claim order, and the
# tenants themselves, walked in order by a recursive skip scan.
_fair = Index(
    "ix_outbox_operations_fair",
    operations.c.tenant,
    operations.c.priority.desc(),
    operations.c.next_attempt_at,
    operations.c.id,
    sqlite_where=operations.c.state.in_(state_values(DUE_STATES)),
)
# In-flight rows per (tenant, endpoint): the per-tenant in-flight limit counts them.
_tenant_in_flight = Index(
    "ix_outbox_operations_tenant_in_flight",
    operations.c.tenant,
    operations.c.endpoint,
    sqlite_where=operations.c.state == "in_flight",
)
Index("ix_outbox_operations_state_updated", operations.c.state, operations.c.updated_at)

attempts = Table(
    "outbox_attempts",
    metadata,
    Column("id", _PK, primary_key=True, autoincrement=True),
    Column(
        "operation_pk",
        _PK,
        ForeignKey("outbox_operations.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("number", Integer, nullable=False),
    Column("request_id", String(36), nullable=False, unique=True),
    Column("dispatcher_id", String(255), nullable=False),
    Column("lease_token", String(36), nullable=False),
    Column("started_at", BigInteger, nullable=False),
    Column("lease_until", BigInteger, nullable=False),
    Column("finished_at", BigInteger, nullable=True),
    Column("delivery", String(16), nullable=True),  # NULL while the attempt is open
    Column("verdict", String(16), nullable=True),
    Column("counted", Boolean, nullable=False, server_default=text("true")),
    Column("status_code", Integer, nullable=True),
    Column("receiver_request_id", String(255), nullable=True),
    Column("error_class", String(255), nullable=True),
    Column("error_message", Text, nullable=True),
    Column("duration_ms", Integer, nullable=True),
    UniqueConstraint("operation_pk", "number"),
)
_open = Index(
    "ix_outbox_attempts_open",
    attempts.c.operation_pk,
    sqlite_where=attempts.c.delivery.is_(None),
)
Index("ix_outbox_attempts_started_at", attempts.c.started_at)

# The audit trail names operations by (tenant, operation_id), so it outlives a purge.
audit = Table(
    "outbox_audit",
    metadata,
    Column("id", _PK, primary_key=True, autoincrement=True),
    Column("tenant", String(255), nullable=False),
    Column("operation_id", String(255), nullable=False),
    Column("actor", String(255), nullable=False),
    Column("action", String(32), nullable=False),
    Column("from_state", String(16), nullable=True),
    Column("to_state", String(16), nullable=True),
    Column("note", Text, nullable=False),
    Column("details", Text, nullable=True),
    Column("at", BigInteger, nullable=False),
)
Index("ix_outbox_audit_operation", audit.c.tenant, audit.c.operation_id)

# Heartbeats: every running dispatcher writes its row every few seconds.
dispatchers = Table(
    "outbox_dispatchers",
    metadata,
    Column("id", String(255), primary_key=True),
    Column("host", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("version", String(64), nullable=False),
    Column("concurrency", Integer, nullable=False),
    Column("in_flight", Integer, nullable=False, server_default="0"),
    Column("started_at", BigInteger, nullable=False),
    Column("last_seen_at", BigInteger, nullable=False),
    Column("stopped_at", BigInteger, nullable=True),
    Column("wake_mode", String(16), nullable=True),
)
Index("ix_outbox_dispatchers_last_seen_at", dispatchers.c.last_seen_at)

# The state of each receiver endpoint the fleet shares (outbox.store.endpoints): its
# circuit breaker, an operator's pause. No row = closed, never failed.
endpoint_states = Table(
    "outbox_endpoints",
    metadata,
    Column("name", String(64), primary_key=True),
    #: closed | open | half_open
    Column("circuit", String(16), nullable=False, server_default="closed"),
    #: 1 while no ordinary claim may take its operations (open, half open or paused):
    #: the one column the claim's predicate reads.
    Column("blocked", Integer, nullable=False, server_default="0"),
    Column("paused", Integer, nullable=False, server_default="0"),
    Column("reason", Text, nullable=True),
    Column("since", BigInteger, nullable=False),
    #: Consecutive failures (not sent, 5xx, timeouts) the fleet saw while closed.
    Column("failures", Integer, nullable=False, server_default="0"),
    #: Half-open probes sent since the circuit opened (spaces the next one).
    Column("probes", Integer, nullable=False, server_default="0"),
    Column("next_probe_at", BigInteger, nullable=True),
    Column("probe_owner", String(255), nullable=True),
    Column("probe_until", BigInteger, nullable=True),
    Column("updated_at", BigInteger, nullable=False),
    #: The fleet's throttle (``outbox.store.limits``): requests per second while the
    #: receiver refuses with 429/503; NULL: not throttled.
    Column("rate", Float, nullable=True),
    #: Epoch ms of the throttle's last decrease or increase (one change per interval).
    Column("rate_changed_at", BigInteger, nullable=True),
    #: Epoch ms of the last refusal that throttled it (lifted after a quiet spell).
    Column("refused_at", BigInteger, nullable=True),
    #: Epoch microseconds up to which the rate budget is handed out to dispatchers.
    Column("rate_cursor_us", BigInteger, nullable=True),
)

#: The in-flight permits each dispatcher leases of an endpoint's ``max_in_flight``.
endpoint_slices = Table(
    "outbox_endpoint_slices",
    metadata,
    Column("endpoint", String(64), primary_key=True),
    Column("owner", String(255), primary_key=True),
    Column("permits", Integer, nullable=False, server_default="0"),
    #: How many it would hold: others above their fair share give some back.
    Column("wanted", Integer, nullable=False, server_default="0"),
    Column("until", BigInteger, nullable=False),
)


#: The partial indexes: the same predicate on every database. Naming a ``postgresql_*``
#: option loads SQLAlchemy's PostgreSQL dialect (tens of milliseconds), which a SQLite
#: process (the CLI's read commands) never needs; so the PostgreSQL copy of each
#: predicate is attached by :func:`attach_postgresql_options` once that dialect is in
#: use: by ``outbox.create_engine`` for a PostgreSQL URL, before any ``create_all`` on
#: PostgreSQL, and here at import if the dialect is already loaded. The predicate has
#: one source, so the two cannot drift (tests/integration/test_migrations.py compares
#: the migrated schema with this metadata on both databases).
PARTIAL_INDEXES = (_due, _ordering, _open, _fair, _tenant_in_flight)


def attach_postgresql_options() -> None:
    """Give each partial index its ``postgresql_where`` (idempotent; loads the dialect)."""
    for index in PARTIAL_INDEXES:
        options = index.dialect_options["postgresql"]
        if options["where"] is None:
            options["where"] = index.dialect_options["sqlite"]["where"]


@event.listens_for(metadata, "before_create")
def _before_create(target: MetaData, connection: Connection, **kw: Any) -> None:
    if connection.dialect.name == "postgresql":
        attach_postgresql_options()


if "sqlalchemy.dialects.postgresql" in sys.modules:
    attach_postgresql_options()
