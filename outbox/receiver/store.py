"""The receipts store's SQL (SQLite and PostgreSQL), each statement on a caller's
connection inside a transaction the caller began: the kit decides when to commit."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, and_, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from outbox.base.fields import from_row
from outbox.receiver.tables import receipts as t


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose key it is: tenant and principal from the application's own authentication
    (never a client header alone), plus the method and the route template."""

    tenant: str
    principal: str
    method: str
    route: str


@dataclass(frozen=True, slots=True)
class Row:
    fingerprint: str
    state: str
    token: str
    lease_until_ms: int
    status: int | None
    headers: dict[str, str]
    body: bytes
    created_ms: int
    expires_ms: int | None
    route: str = ""

    def expired(self, now_ms: int) -> bool:
        return self.expires_ms is not None and self.expires_ms <= now_ms


def _where(scope: Scope, key: str) -> Any:
    return and_(
        t.c.tenant == scope.tenant,
        t.c.principal == scope.principal,
        t.c.method == scope.method,
        t.c.route == scope.route,
        t.c.key == key,
    )


def _row(r: Any) -> Row:
    headers = json.loads(r.headers) if r.headers else {}
    return from_row(Row, r, headers=headers, body=bytes(r.body) if r.body is not None else b"")


def insert_claim(
    conn: Connection, scope: Scope, key: str, *, fp: str, token: str, now_ms: int, lease_ms: int
) -> bool:
    """Claim a key nobody holds; False when a row exists (then :func:`read_locked`)."""
    values = {
        "tenant": scope.tenant,
        "principal": scope.principal,
        "method": scope.method,
        "route": scope.route,
        "key": key,
        "fingerprint": fp,
        "state": "in_progress",
        "token": token,
        "lease_until_ms": now_ms + lease_ms,
        "created_ms": now_ms,
    }
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(t).values(**values).on_conflict_do_nothing().returning(t.c.token)
    # RETURNING, not rowcount: psycopg reports no reliable rowcount for this statement.
    return conn.execute(stmt).first() is not None


def read_locked(conn: Connection, scope: Scope, key: str) -> Row | None:
    """The key's row, locked against a concurrent takeover until the transaction ends
    (PostgreSQL ``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE`` already holds the lock)."""
    stmt = select(t).where(_where(scope, key))
    if conn.dialect.name == "postgresql":
        stmt = stmt.with_for_update()
    r = conn.execute(stmt).first()
    return _row(r) if r is not None else None


def take_over(
    conn: Connection,
    scope: Scope,
    key: str,
    *,
    old_token: str,
    fp: str,
    token: str,
    now_ms: int,
    lease_ms: int,
) -> bool:
    """Claim a key whose holder's lease ran out, or whose stored answer expired."""
    stmt = (
        update(t)
        .where(_where(scope, key), t.c.token == old_token)
        .values(
            fingerprint=fp,
            state="in_progress",
            token=token,
            lease_until_ms=now_ms + lease_ms,
            status=None,
            headers=None,
            body=None,
            created_ms=now_ms,
            completed_ms=None,
            expires_ms=None,
        )
    )
    return conn.execute(stmt).rowcount == 1


def complete(
    conn: Connection,
    scope: Scope,
    key: str,
    token: str,
    *,
    status: int,
    headers: dict[str, str],
    body: bytes,
    now_ms: int,
    expires_ms: int,
) -> bool:
    """Store the handler's response under the claim it still holds (fenced by token)."""
    stmt = (
        update(t)
        .where(_where(scope, key), t.c.token == token, t.c.state == "in_progress")
        .values(
            state="done",
            status=status,
            headers=json.dumps(headers, sort_keys=True),
            body=body,
            completed_ms=now_ms,
            expires_ms=expires_ms,
        )
    )
    return conn.execute(stmt).rowcount == 1


def release(conn: Connection, scope: Scope, key: str, token: str) -> None:
    """Free a claim whose handler failed: the next request with the key runs afresh."""
    conn.execute(
        delete(t).where(_where(scope, key), t.c.token == token, t.c.state == "in_progress")
    )


def lookup(conn: Connection, tenant: str, principal: str, key: str) -> Row | None:
    """The newest row under (tenant, principal, key) on any route: the status lookup."""
    stmt = (
        select(t)
        .where(t.c.tenant == tenant, t.c.principal == principal, t.c.key == key)
        .order_by(t.c.created_ms.desc())
        .limit(1)
    )
    r = conn.execute(stmt).first()
    return _row(r) if r is not None else None


def count(engine: Engine) -> int:
    with engine.connect() as conn:
        return len(conn.execute(select(t.c.key)).all())


def purge_batches(engine: Engine, before_ms: int, batch: int) -> Iterator[int]:
    """Delete receipts whose answer expired before ``before_ms`` (and abandoned claims
    created before it), ``batch`` rows per short transaction; yields each batch's count."""
    gone = and_(
        t.c.created_ms < before_ms,
        ((t.c.state == "done") & (t.c.expires_ms < before_ms))
        | ((t.c.state == "in_progress") & (t.c.lease_until_ms < before_ms)),
    )
    pk = (t.c.tenant, t.c.principal, t.c.method, t.c.route, t.c.key)
    while True:
        with engine.begin() as conn:
            rows = conn.execute(select(*pk).where(gone).limit(batch)).all()
            for r in rows:
                conn.execute(
                    delete(t).where(
                        _where(Scope(r.tenant, r.principal, r.method, r.route), r.key), gone
                    )
                )
        if not rows:
            return
        yield len(rows)


__all__ = [
    "Row",
    "Scope",
    "complete",
    "count",
    "insert_claim",
    "lookup",
    "purge_batches",
    "read_locked",
    "release",
    "take_over",
]
