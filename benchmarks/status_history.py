"""``outbox status`` against months of history: N settled operations (each with its
attempt row) plus a small live backlog, on SQLite and PostgreSQL.

    python -m benchmarks.status_history --rows 1000000 [--dialect sqlite|postgresql]

The history is written by one ``INSERT ... SELECT`` per table (a recursive CTE on
SQLite, ``generate_series`` on PostgreSQL): seconds, not minutes. Then ``outbox status``
runs as its own process (the way an operator or a cron check runs it) ``--repeat``
times, interleaved with ``outbox status --settled`` (every settled row counted) and
``outbox --version`` (the process's start-up alone); the median wall times are printed
with the library's figures for one read, and the median of ``Reconciler.status()`` in
this process (the database's part alone: defaults, and ``settled=False``). The
processes may cache bytecode (under a temporary ``PYTHONPYCACHEPREFIX``), as an installed
package has, even where the environment says ``PYTHONDONTWRITEBYTECODE``. The issue-27
target is <= 0.5 s at 1M settled rows on both databases.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

import sqlalchemy
from sqlalchemy import text

from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade

_NOW_MS = int(time.time() * 1000)
_DAY_MS = 86_400_000

_COLUMNS = (
    "tenant, operation_id, endpoint, method, path, headers, args_sha256, state, "
    "attempts_counted, attempts_total, next_attempt_at, first_attempt_at, created_at, "
    "updated_at, finished_at, policy_key_retention_ms"
)


def _settled_select(series: str, n_expr: str) -> str:
    # Settled across 90 days; two of three succeeded, the rest failed or cancelled.
    return (
        f"SELECT '', 'hist-' || {n_expr}, 'payments', 'POST', '/pay', '{{}}', 'x', "
        f"CASE {n_expr} % 3 WHEN 0 THEN 'failed' WHEN 1 THEN 'succeeded' "
        f"ELSE 'succeeded' END, 1, 1, NULL, "
        f"{_NOW_MS} - {n_expr} * 7776, {_NOW_MS} - {n_expr} * 7776, {_NOW_MS} - {n_expr} * 7776, "
        f"{_NOW_MS} - {n_expr} * 7776 + 5, 86400000 FROM {series}"
    )


def populate(url: str, rows: int, *, schema: str | None = None) -> None:
    outbox_engine = create_engine(url, schema=schema)
    upgrade(outbox_engine)
    outbox_engine.dispose()
    # A plain engine: the outbox's own sets a statement timeout an operator read wants.
    engine = sqlalchemy.create_engine(url)
    pg = engine.dialect.name == "postgresql"
    with engine.begin() as conn:
        if schema:
            conn.execute(text(f"SET LOCAL search_path TO {schema}"))
        if pg:
            series = f"generate_series(1::bigint, {rows}) AS g(n)"
            conn.execute(text(f"INSERT INTO outbox_operations ({_COLUMNS}) "
                              + _settled_select(series, "g.n")))  # fmt: skip
        else:
            cte = (
                f"WITH RECURSIVE s(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < {rows}) "
            )
            conn.execute(text(f"INSERT INTO outbox_operations ({_COLUMNS}) " + cte
                              + _settled_select("s", "s.n")))  # fmt: skip
        uuid_expr = "gen_random_uuid()::text" if pg else "lower(hex(randomblob(16)))"
        conn.execute(
            text(
                "INSERT INTO outbox_attempts (operation_pk, number, request_id, dispatcher_id, "
                "lease_token, started_at, lease_until, finished_at, delivery, verdict, counted, "
                f"status_code, duration_ms) SELECT id, 1, {uuid_expr}, 'd', 't', first_attempt_at, "
                "first_attempt_at + 30000, finished_at, 'sent', "
                "CASE state WHEN 'failed' THEN 'failed' ELSE 'success' END, true, 200, 5 "
                "FROM outbox_operations"
            )
        )
        # The live backlog: 50 pending, 20 unresolved (10 of them past key expiry).
        for i in range(70):
            state = "pending" if i < 50 else "unresolved"
            first = _NOW_MS - (2 * _DAY_MS if i >= 60 else 60_000)
            conn.execute(
                text(
                    f"INSERT INTO outbox_operations ({_COLUMNS}, reason) VALUES ('', :oid, "
                    "'payments', 'POST', '/pay', '{}', 'x', :state, 1, 1, :due, :first, "
                    ":first, :first, NULL, 86400000, :reason)"
                ),
                {
                    "oid": f"live-{i}",
                    "state": state,
                    "due": _NOW_MS if state == "pending" else None,
                    "first": first,
                    "reason": "retries_exhausted" if state == "unresolved" else None,
                },
            )
    # Autocommit: an ANALYZE in a transaction that is never committed leaves no
    # statistics (the planner then takes a million rows for a few dozen).
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if pg:
            if schema:  # else the URL's own search_path stands
                conn.execute(text(f"SET search_path TO {schema}"))
            conn.execute(text("ANALYZE outbox_operations"))
            conn.execute(text("ANALYZE outbox_attempts"))
    engine.dispose()


#: What is timed, by its key in the output: ``outbox`` arguments.
RUNS = {
    "status": ["status", "--json"],
    "status_all_settled": ["status", "--json", "--settled"],
    "startup": ["--version"],
}


def time_library(url: str, *, schema: str | None, repeat: int) -> dict[str, Any]:
    from outbox import Outbox

    result: dict[str, Any] = {}
    with Outbox(url, endpoints=[], schema=schema) as ob:
        for name, kwargs in (("library_status", {}), ("library_live_only", {"settled": False})):
            ob.reconcile.status(**kwargs)  # warm: connection, statements
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                ob.reconcile.status(**kwargs)
                times.append(time.perf_counter() - started)
            result[f"{name}_ms_median"] = round(statistics.median(times) * 1000, 1)
    return result


def time_status(url: str, *, schema: str | None, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="outbox-pyc-") as pycache:
        return _time_status(url, schema=schema, repeat=repeat, pycache=pycache)


def _time_status(url: str, *, schema: str | None, repeat: int, pycache: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(OUTBOX_DB=url, PYTHONPYCACHEPREFIX=pycache)
    if schema:
        env["OUTBOX_SCHEMA"] = schema
    # One run first writes the bytecode cache (an installed package has one).
    subprocess.run(
        [sys.executable, "-m", "outbox", "status"], env=env, capture_output=True, check=True
    )
    times: dict[str, list[float]] = {name: [] for name in RUNS}
    out = ""
    for _ in range(repeat):
        for name, args in RUNS.items():
            started = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "outbox", *args],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            times[name].append(time.perf_counter() - started)
            if name == "status":
                out = done.stdout
    figures = json.loads(out)
    result: dict[str, Any] = {}
    for name, ts in times.items():
        result[f"{name}_seconds_median"] = round(statistics.median(ts), 3)
        result[f"{name}_seconds"] = [round(t, 3) for t in ts]
    result["counts"] = figures["counts"]
    result["settled_over_limit"] = figures.get("figures", {}).get("settled_over_limit")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dialect", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    schema = None
    scratch = tempfile.mkdtemp(prefix="outbox-hist-")
    if args.dialect == "sqlite":
        url = f"sqlite:///{scratch}/history.db"
    else:
        url = os.environ.get(
            "OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        )
        schema = f"bench_hist_{uuid.uuid4().hex[:8]}"
        engine = create_engine(url)
        with engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        engine.dispose()
    try:
        started = time.perf_counter()
        populate(url, args.rows, schema=schema)
        loaded = time.perf_counter() - started
        result = {"dialect": args.dialect, "rows": args.rows, "load_seconds": round(loaded, 1)}
        result.update(time_status(url, schema=schema, repeat=args.repeat))
        result.update(time_library(url, schema=schema, repeat=args.repeat))
        print(json.dumps(result))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if schema:
            engine = create_engine(url)
            with engine.begin() as conn:
                conn.execute(text(f"DROP SCHEMA {schema} CASCADE"))
            engine.dispose()


if __name__ == "__main__":
    main()
