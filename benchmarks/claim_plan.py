"""The fair claim's plan on PostgreSQL at a large due backlog (issue 23, section 3).

Fills a throwaway schema with ``--rows`` due operations (90% in one tenant, the rest
spread over ``--tenants`` others, a tenth of them with a priority, some scheduled for
later), runs ANALYZE, then ``EXPLAIN (ANALYZE, BUFFERS)`` of the claim's selection (its
row locks rolled back) and prints the plan and the time.

    python -m benchmarks.claim_plan --rows 1000000
"""

from __future__ import annotations

import argparse
import os
import time
import uuid

import sqlalchemy as sa

from outbox.store.fairness import fair_claim_sql
from outbox.store.migrate import upgrade

_FILL = """
INSERT INTO outbox_operations (tenant, operation_id, endpoint, method, path, headers,
    args_sha256, state, next_attempt_at, priority, not_before, created_at, updated_at)
SELECT CASE WHEN g % 10 = 0 THEN 't' || lpad((g % :tenants)::text, 5, '0') ELSE 'big' END,
       'op-' || g, 'rx', 'POST', '/o', '{}', md5(g::text), 'pending',
       CASE WHEN g % 50 = 0 THEN :now + 3600000 ELSE :now - g END,
       CASE WHEN g % 10 = 3 THEN 5 ELSE 0 END,
       CASE WHEN g % 50 = 0 THEN :now + 3600000 END,
       :now, :now
FROM generate_series(1, :rows) AS g
"""


def _url(schema: str) -> str:
    base = os.environ.get(
        "OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    return f"{base}?options=-csearch_path%3D{schema}"


def fill(engine: sa.Engine, rows: int, tenants: int, now: int) -> float:
    started = time.monotonic()
    with engine.begin() as conn:
        conn.execute(sa.text(_FILL), {"rows": rows, "tenants": tenants, "now": now})
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text("ANALYZE outbox_operations"))
    return time.monotonic() - started


def explain(engine: sa.Engine, now: int, limit: int = 32) -> list[str]:
    """The claim selection's plan, executed (EXPLAIN ANALYZE) and its locks rolled back."""
    sql = "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) " + fair_claim_sql("postgresql")
    with engine.connect() as conn:
        conn.exec_driver_sql("SET LOCAL jit = off")  # as the claim runs (PostgresStore)
        lines = [
            str(r[0])
            for r in conn.execute(
                sa.text(sql),
                {"now_ms": now, "limit": limit, "cursor": "", "caps": "{}", "steady_ms": 2**62},
            )
        ]
        conn.rollback()
    return lines


def make_schema(rows: int, tenants: int, now: int) -> tuple[str, sa.Engine, float]:
    schema = f"bench_plan_{uuid.uuid4().hex[:8]}"
    admin = sa.create_engine(_url("public"))
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    admin.dispose()
    engine = sa.create_engine(_url(schema))
    upgrade(engine)
    return schema, engine, fill(engine, rows, tenants, now)


def drop_schema(schema: str, engine: sa.Engine) -> None:
    engine.dispose()
    admin = sa.create_engine(_url("public"))
    with admin.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    args = parser.parse_args()
    now = int(time.time() * 1000)
    schema, engine, seconds = make_schema(args.rows, args.tenants, now)
    try:
        print(f"filled {args.rows} due rows, {args.tenants + 1} tenants, in {seconds:.1f} s")
        explain(engine, now)  # warm the cache once
        for line in explain(engine, now):
            print(line)
    finally:
        drop_schema(schema, engine)


if __name__ == "__main__":
    main()
