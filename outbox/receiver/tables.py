"""The receipts table: the single schema source for the kit's code and its migrations."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

#: One row per idempotency key under its scope. ``state`` is ``in_progress`` while a
#: handler holds the claim (until ``lease_until_ms``) and ``done`` once the handler's
#: transaction committed its effect and this row's response together.
receipts = Table(
    "outbox_receipts",
    metadata,
    Column("tenant", String(255), primary_key=True),
    Column("principal", String(255), primary_key=True),
    Column("method", String(16), primary_key=True),
    Column("route", String(512), primary_key=True),
    Column("key", String(255), primary_key=True),
    Column("fingerprint", String(64), nullable=False),
    Column("state", String(16), nullable=False),
    Column("token", String(36), nullable=False),
    Column("lease_until_ms", BigInteger, nullable=False),
    Column("status", Integer, nullable=True),
    Column("headers", Text, nullable=True),
    Column("body", LargeBinary, nullable=True),
    Column("created_ms", BigInteger, nullable=False),
    Column("completed_ms", BigInteger, nullable=True),
    Column("expires_ms", BigInteger, nullable=True),
    Index("ix_outbox_receipts_lookup", "tenant", "principal", "key"),
    Index("ix_outbox_receipts_created_ms", "created_ms"),
)

__all__ = ["metadata", "receipts"]
