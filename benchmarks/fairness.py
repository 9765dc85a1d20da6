"""Tenant B's lag behind tenant A's backlog (issue 23, section 3).

Per run: a fresh outbox; tenant A enqueues ``--backlog`` operations; a dispatcher
(``run_dispatcher``, ``--concurrency``) starts sending them to the real receiver, which
answers each request after ``--delay-ms``; one second later tenant B enqueues one
operation. The lag is B's arrival at the receiver (the receiver's own log) minus the
moment its enqueue returned. The run stops once B has arrived.

    python -m benchmarks.fairness --runs 20 --db sqlite
    python -m benchmarks.fairness --runs 20 --db postgresql

Prints one JSON line per run and a summary line (p50, p99, max, target met).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import sqlalchemy as sa

from outbox import Endpoint, Intent, Outbox, RetryPolicy
from outbox.store.migrate import upgrade
from outbox.testing.receiver import Receiver

TARGET_MS = 1000


def _pg_url(schema: str) -> str:
    base = os.environ.get(
        "OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    return f"{base}?options=-csearch_path%3D{schema}"


def _outbox(db: str, work: Path, receiver: Receiver) -> tuple[Outbox, str | None]:
    schema = None
    if db == "sqlite":
        url = f"sqlite:///{work / 'outbox.sqlite3'}"
    else:
        schema = f"bench_fair_{uuid.uuid4().hex[:8]}"
        admin = sa.create_engine(_pg_url("public"))
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
        url = _pg_url(schema)
        engine = sa.create_engine(url)
        upgrade(engine)
        engine.dispose()
    ob = Outbox(
        url,
        endpoints=[
            Endpoint(
                name="rx",
                base_url=receiver.url,
                timeout=5.0,
                retry=RetryPolicy(max_attempts=8, window=timedelta(seconds=60)),
                key_retention=timedelta(hours=1),
                tenant_header="X-Tenant",
            )
        ],
    )
    return ob, schema


def _drop(schema: str | None) -> None:
    if schema is None:
        return
    admin = sa.create_engine(_pg_url("public"))
    with admin.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def one_run(db: str, backlog: int, concurrency: int, delay_ms: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, Receiver(Path(tmp) / "rx.sqlite3") as receiver:
        receiver.faults.delay_after_commit(delay_ms / 1000, times=None)
        ob, schema = _outbox(db, Path(tmp), receiver)
        try:
            for start in range(0, backlog, 500):
                ob.enqueue_many(
                    [Intent("rx", "POST", "/orders", {"n": i}, None, f"a-{i}", "A")
                     for i in range(start, min(backlog, start + 500))]
                )  # fmt: skip
            stop = threading.Event()
            worker = threading.Thread(
                target=ob.run_dispatcher, kwargs={"concurrency": concurrency, "stop": stop}
            )
            worker.start()
            time.sleep(1.0)
            ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 0},
                       operation_id="b-0", tenant="B")  # fmt: skip
            enqueued_ms = time.time() * 1000
            deadline = time.monotonic() + 60
            arrived = []
            while not arrived and time.monotonic() < deadline:
                time.sleep(0.01)
                arrived = receiver.requests(key="b-0")
            a_before = len([r for r in receiver.requests(tenant="A")
                            if arrived and r.seq < arrived[0].seq])  # fmt: skip
            stop.set()
            worker.join(timeout=60)
        finally:
            ob.close()
            _drop(schema)
    lag = arrived[0].arrived_at_ms - enqueued_ms if arrived else float("inf")
    return {"lag_ms": round(lag, 1), "a_sent_before_b": a_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--backlog", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--delay-ms", type=int, default=20)
    args = parser.parse_args()
    lags = []
    for n in range(args.runs):
        result = one_run(args.db, args.backlog, args.concurrency, args.delay_ms)
        lags.append(result["lag_ms"])
        print(json.dumps({"run": n, "db": args.db, **result}), flush=True)
    ordered = sorted(lags)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    print(json.dumps({
        "db": args.db, "runs": args.runs, "backlog": args.backlog,
        "concurrency": args.concurrency, "delay_ms": args.delay_ms,
        "lag_p50_ms": statistics.median(lags), "lag_p99_ms": p99, "lag_max_ms": ordered[-1],
        "target_ms": TARGET_MS, "met": p99 <= TARGET_MS,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
