"""Reading a receiver's SQLite file directly: what was applied, not what was answered."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from outbox.testing.receiver.records import BUSY_TIMEOUT_SECONDS, Effect, Receipt, RequestRecord


class Oracle:
    """Reads a receiver's SQLite file directly: effects, receipts and the request log."""

    _db_path: Path

    @property
    def db_path(self) -> Path:
        """The receiver's SQLite file."""
        return self._db_path

    def _query(self, sql: str, params: Sequence[Any] = ()) -> list[sqlite3.Row]:
        # mode=rw: a missing file is an error, not a new empty database.
        uri = self._db_path.resolve().as_uri() + "?mode=rw"
        with contextlib.closing(
            sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_SECONDS)
        ) as conn:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, params).fetchall()

    @staticmethod
    def _where(filters: Mapping[str, Any]) -> tuple[str, list[Any]]:
        used = {column: value for column, value in filters.items() if value is not None}
        if not used:
            return "", []
        return " WHERE " + " AND ".join(f"{c} = ?" for c in used), list(used.values())

    def effects(self, tenant: str | None = None, key: str | None = None) -> list[Effect]:
        """Effect rows in id order, optionally narrowed to a tenant and/or a key."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM effects{where} ORDER BY id", params)
        return [
            Effect(
                id=r["id"],
                tenant=r["tenant"],
                key=r["idempotency_key"],
                method=r["method"],
                path=r["path"],
                body=r["body"],
                body_sha256=r["body_sha256"],
                client_operation_id=r["client_operation_id"],
                request_id=r["request_id"],
                created_at_ms=r["created_at_ms"],
            )
            for r in rows
        ]

    def effect_count(self, key: str | None = None, tenant: str | None = None) -> int:
        """How many effects exist, optionally for one key and/or tenant."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        return int(self._query(f"SELECT count(*) FROM effects{where}", params)[0][0])

    def requests(self, key: str | None = None, tenant: str | None = None) -> list[RequestRecord]:
        """The request log in arrival order (admin routes are never logged)."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM requests{where} ORDER BY seq", params)
        return [
            RequestRecord(
                seq=r["seq"],
                arrived_at_ms=r["arrived_at_ms"],
                method=r["method"],
                path=r["path"],
                tenant=r["tenant"],
                key=r["idempotency_key"],
                request_id=r["request_id"],
                body_sha256=r["body_sha256"],
                outcome=r["outcome"],
                status=r["status"],
                traceparent=r["traceparent"],
            )
            for r in rows
        ]

    def receipts(self, key: str | None = None, tenant: str | None = None) -> list[Receipt]:
        """Current receipts (expired ones may still be listed until touched)."""
        where, params = self._where({"tenant": tenant, "idempotency_key": key})
        rows = self._query(f"SELECT * FROM receipts{where} ORDER BY created_at_ms", params)
        return [
            Receipt(
                tenant=r["tenant"],
                key=r["idempotency_key"],
                payload_hash=r["payload_hash"],
                state=r["state"],
                response_status=r["response_status"],
                response_body=r["response_body"],
                created_at_ms=r["created_at_ms"],
                stuck=bool(r["stuck"]),
            )
            for r in rows
        ]
