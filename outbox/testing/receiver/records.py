"""The receiver's SQLite file: its tables, the rows read from them, and opening it.

See :mod:`outbox.testing.receiver` for the tables' meaning; the soak's checker reads them
with plain SQL, so they are stable."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Another process (a checker, a RemoteReceiver reading effects) may hold the file briefly;
# wait for it instead of failing a request with "database is locked".
BUSY_TIMEOUT_SECONDS = 10.0

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY,
    arrived_at_ms INTEGER NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    tenant TEXT NOT NULL,
    idempotency_key TEXT,
    request_id TEXT,
    body_sha256 TEXT NOT NULL,
    outcome TEXT NOT NULL,
    status INTEGER,
    traceparent TEXT
);
CREATE INDEX IF NOT EXISTS requests_by_key ON requests (idempotency_key);
CREATE TABLE IF NOT EXISTS receipts (
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    payload_hash TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('processing', 'complete')),
    response_status INTEGER,
    response_body TEXT,
    created_at_ms INTEGER NOT NULL,
    stuck INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY,
    tenant TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    body TEXT NOT NULL,
    body_sha256 TEXT NOT NULL,
    client_operation_id TEXT,
    request_id TEXT,
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_by_key ON effects (tenant, idempotency_key);
"""


@dataclass(frozen=True, slots=True)
class Effect:
    """One applied operation, as recorded by the receiver (the oracle)."""

    id: int
    tenant: str
    key: str
    method: str
    path: str
    #: The request body as text (UTF-8, undecodable bytes replaced).
    body: str
    body_sha256: str
    #: The JSON body's top-level ``operation_id`` (as text), if present.
    client_operation_id: str | None
    #: ``X-Request-ID`` of the request that applied it.
    request_id: str | None
    created_at_ms: int


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One row of the receiver's request log (admin routes excluded)."""

    seq: int
    arrived_at_ms: int
    method: str
    path: str
    tenant: str
    key: str | None
    request_id: str | None
    body_sha256: str
    #: ``applied``, ``replayed``, ``conflict``, ``in_progress``, ``fault:<kind>``, ...
    outcome: str
    #: The response status; None when the connection was dropped or held open.
    status: int | None
    #: The request's W3C ``traceparent`` header, if any.
    traceparent: str | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    """An idempotency receipt for ``(tenant, key)``."""

    tenant: str
    key: str
    payload_hash: str
    #: ``processing`` or ``complete``.
    state: str
    response_status: int | None
    response_body: str | None
    created_at_ms: int
    #: Left "processing" on purpose by :meth:`Faults.stuck_in_progress`.
    stuck: bool


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def connect(db_path: Path, *, writer: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(
        db_path,
        timeout=BUSY_TIMEOUT_SECONDS,
        isolation_level=None,
        check_same_thread=not writer,
    )
    conn.row_factory = sqlite3.Row
    return conn


def init_db(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA)


def mark_stuck(conn: sqlite3.Connection, tenant: str, key: str) -> None:
    conn.execute(
        "INSERT INTO receipts (tenant, idempotency_key, payload_hash, state, created_at_ms,"
        " stuck) VALUES (?, ?, '', 'processing', ?, 1) ON CONFLICT (tenant, idempotency_key)"
        " DO UPDATE SET state = 'processing', stuck = 1",
        (tenant, key, now_ms()),
    )
