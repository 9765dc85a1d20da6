"""Claim cost against a growing backlog of due operations (1k, 100k, 1M rows).

Rows are bulk-loaded with the driver's fastest path (sqlite3 ``executemany`` in one
transaction; PostgreSQL ``COPY``). Each measured claim takes 100 operations through
``Store.claim`` (its own transaction, commit included); the claimed rows are then put
back, untimed, so every claim sees the same backlog. The query plan of the claim is
checked for the partial index ``ix_outbox_operations_fair`` (the fair claim's index).
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

from benchmarks.common import payload

INDEX = "ix_outbox_operations_fair"
_COLUMNS = (
    "tenant",
    "operation_id",
    "endpoint",
    "method",
    "path",
    "headers",
    "body",
    "args_sha256",
    "state",
    "attempts_counted",
    "attempts_total",
    "maybe_delivered",
    "saw_refusal",
    "next_attempt_at",
    "version",
    "created_at",
    "updated_at",
)


def _rows(start: int, stop: int, now_ms: int, prefix: str) -> Iterator[tuple[Any, ...]]:
    for i in range(start, stop):
        body = json.dumps(payload(i), sort_keys=True, separators=(",", ":"))
        due = now_ms - 3_600_000 + (i * 7919) % 3_600_000  # due within the last hour
        yield (
            "",
            f"{prefix}{i}",
            "rx",
            "POST",
            "/orders",
            "{}",
            body,
            hashlib.sha256(body.encode()).hexdigest(),
            "pending",
            0,
            0,
            False,
            False,
            due,
            0,
            due,
            due,
        )


def bulk_load(engine: Any, start: int, stop: int, now_ms: int, prefix: str) -> float:
    """Insert due pending operations [start, stop); returns seconds taken."""
    t0 = time.perf_counter()
    raw = engine.raw_connection()
    try:
        dbapi = raw.driver_connection
        if engine.dialect.name == "sqlite":
            cols = ", ".join(_COLUMNS)
            marks = ", ".join("?" for _ in _COLUMNS)
            dbapi.execute("BEGIN IMMEDIATE")
            dbapi.executemany(
                f"INSERT INTO outbox_operations ({cols}) VALUES ({marks})",
                _rows(start, stop, now_ms, prefix),
            )
            dbapi.execute("COMMIT")
        else:
            with dbapi.cursor() as cur:
                copy_sql = f"COPY outbox_operations ({', '.join(_COLUMNS)}) FROM STDIN"
                with cur.copy(copy_sql) as copy:
                    for row in _rows(start, stop, now_ms, prefix):
                        copy.write_row(row)
            dbapi.commit()
    finally:
        raw.close()
    return time.perf_counter() - t0


def _put_back(engine: Any, pks: list[int], now_ms: int) -> None:
    from sqlalchemy import update

    from outbox.store.tables import operations as o

    with engine.begin() as conn:
        conn.execute(
            update(o)
            .where(o.c.id.in_(pks))
            .values(
                state="pending",
                lease_token=None,
                lease_owner=None,
                lease_until=None,
                next_attempt_at=o.c.created_at,
            )
        )


def claim_plan(store: Any, now_ms: int) -> str:
    """The database's plan for the claim statement, as text."""
    params = {"now_ms": now_ms, "limit": 100, "c_token": "t", "c_owner": "o",
              "c_until": now_ms + 30_000, "c_now": now_ms, "cursor": "", "caps": "{}",
              "steady_ms": 2**62, "gone": "[]"}  # fmt: skip
    compiled = store._claim_statement().compile(dialect=store.engine.dialect)
    bound = compiled.construct_params(params)
    sql = str(compiled)
    with store.engine.connect() as conn:
        if store.engine.dialect.name == "sqlite":
            args = tuple(bound[name] for name in compiled.positiontup)
            rows = conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, args).all()
            plan = "\n".join(str(r[-1]) for r in rows)
        else:
            rows = conn.exec_driver_sql("EXPLAIN " + sql, bound).all()
            plan = "\n".join(str(r[0]) for r in rows)
        conn.rollback()
    return plan


def measure_claims(store: Any, clock_ms: int, repeats: int, budget_s: float = 8.0) -> list[float]:
    """ms per claim of 100 (own transaction), the claimed rows put back after each.

    Stops early (after at least 3) once ``budget_s`` of claiming has passed: a plan that
    sorts a million rows takes seconds per claim.
    """
    times: list[float] = []
    spent = 0.0
    for _ in range(repeats + 1):
        if len(times) >= 4 and spent > budget_s:
            break
        token = str(uuid.uuid4())
        t0 = time.perf_counter()
        claimed, _recovered = store.claim(
            owner="bench", token=token, now_ms=clock_ms, lease_ms=30_000, limit=100
        )
        elapsed = (time.perf_counter() - t0) * 1000
        if len(claimed) != 100:
            raise RuntimeError(f"claim returned {len(claimed)} rows, expected 100")
        _put_back(store.engine, [c.pk for c in claimed], clock_ms)
        times.append(elapsed)
        spent += elapsed / 1000
    return times[1:]  # the first one warms the statement cache


def _drop_sqlite_stats(engine: Any) -> None:
    with engine.begin() as conn:
        has = conn.exec_driver_sql(
            "SELECT 1 FROM sqlite_master WHERE name = 'sqlite_stat1'"
        ).first()
        if has:
            conn.exec_driver_sql("DELETE FROM sqlite_stat1")
    engine.dispose()  # the planner reads the statistics when a connection opens


def _analyze(engine: Any) -> None:
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")
    engine.dispose()


def run_claim_bench(db_url: str, sizes: list[int], repeats: int = 15) -> list[dict[str, Any]]:
    """Per backlog size: ms per claim of 100 and the plan, with and without statistics.

    SQLite never gathers planner statistics by itself, so it is measured both as it runs
    by default (no ``sqlite_stat1``) and after ``ANALYZE``. PostgreSQL's autovacuum
    analyzes a table soon after a bulk load, so it is measured after ``ANALYZE``.
    """
    from outbox.store import store_for
    from outbox.store.engine import create_engine

    engine = create_engine(db_url)
    store = store_for(engine)
    prefix = f"claim-{uuid.uuid4().hex[:6]}-"
    now_ms = int(time.time() * 1000)
    loaded = 0
    out: list[dict[str, Any]] = []
    modes = ["no_stats", "analyzed"] if engine.dialect.name == "sqlite" else ["analyzed"]
    try:
        for size in sizes:
            load_s = bulk_load(engine, loaded, size, now_ms, prefix)
            loaded = size
            for mode in modes:
                if mode == "no_stats":
                    _drop_sqlite_stats(engine)
                else:
                    _analyze(engine)
                times = measure_claims(store, now_ms + 1, repeats)
                plan = claim_plan(store, now_ms + 1)
                out.append(
                    {
                        "backlog": size,
                        "mode": mode,
                        "load_seconds": round(load_s, 2),
                        "ms_per_claim_100": round(statistics.median(times), 3),
                        "ms_values": [round(t, 3) for t in times],
                        "uses_due_index": INDEX in plan,
                        "plan": plan,
                    }
                )
    finally:
        engine.dispose()
    return out
