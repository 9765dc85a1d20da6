"""Enqueue throughput: own transaction, the caller's transaction vs a bare Core insert,
and enqueue_many of 1,000.

"Caller's transaction" is what an application does per business operation: one
transaction that inserts its own row and records the intent. The baseline writes the
same outbox row with a bare SQLAlchemy Core ``insert()`` in the same transaction. Two
shapes are timed: one operation per transaction (commit-bound, the realistic case) and
many operations in one transaction (CPU-bound: the per-call cost of ``enqueue`` itself).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, MetaData, String, Table

from benchmarks.common import endpoint, payload
from benchmarks.dispatch import enqueue_each

_meta = MetaData()
orders = Table(
    "bench_orders",
    _meta,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("sku", String(32), nullable=False),
    Column("quantity", Integer, nullable=False),
)


def _outbox(db_url: str) -> Any:
    from outbox import Outbox

    ob = Outbox(db_url, endpoints=[endpoint("http://127.0.0.1:9", concurrency=8)])
    _meta.create_all(ob.engine)  # the application's own table, in the same database
    return ob


def _bare_row(op_id: str, body: dict[str, Any], now_ms: int) -> dict[str, Any]:
    """The row ``enqueue`` writes (the store's own ``operation_row``, from the canonical
    arguments), without anything else ``enqueue`` does."""
    from outbox.canonical import canonicalize
    from outbox.store.rows import operation_row

    args = canonicalize(
        endpoint="rx",
        method="POST",
        path="/orders",
        json_body=body,
        headers=None,
        max_body_bytes=1 << 20,
    )
    return operation_row(tenant="", operation_id=op_id, args=args, ordering_key=None, now_ms=now_ms)


def own_transaction(db_url: str, n: int) -> float:
    ob = _outbox(db_url)
    prefix = f"own-{uuid.uuid4().hex[:8]}-"
    try:
        enqueue_each(ob, 20, f"{prefix}warm-")  # connections, pragmas, compiled statements
        start = time.perf_counter()
        enqueue_each(ob, n, prefix)
        return n / (time.perf_counter() - start)
    finally:
        ob.close()


def callers_transaction(db_url: str, n: int, *, per_tx: int) -> dict[str, float]:
    """ops/s of enqueue(connection=...) and of a bare insert, alternating in blocks."""
    from outbox.store.tables import operations

    ob = _outbox(db_url)
    engine = ob.engine
    results: dict[str, list[float]] = {"enqueue": [], "bare": []}
    try:
        for block in range(-2, 4):  # alternate so drift hits both alike; -2, -1 warm up
            n_block = n // 4 if block >= 0 else 20
            for kind in ("enqueue", "bare") if block % 2 == 0 else ("bare", "enqueue"):
                prefix = f"{kind}-{uuid.uuid4().hex[:8]}-"
                start = time.perf_counter()
                for t in range(0, n_block, per_tx):
                    with engine.begin() as conn:
                        for i in range(t, min(n_block, t + per_tx)):
                            body = payload(i)
                            conn.execute(
                                orders.insert(), {"sku": body["sku"], "quantity": body["quantity"]}
                            )
                            if kind == "enqueue":
                                ob.enqueue(
                                    endpoint="rx",
                                    method="POST",
                                    path="/orders",
                                    json=body,
                                    operation_id=f"{prefix}{i}",
                                    connection=conn,
                                )
                            else:
                                now = int(time.time() * 1000)
                                conn.execute(
                                    operations.insert(), _bare_row(f"{prefix}{i}", body, now)
                                )
                if block >= 0:
                    results[kind].append(n_block / (time.perf_counter() - start))
    finally:
        ob.close()
    enq = sum(results["enqueue"]) / len(results["enqueue"])
    bare = sum(results["bare"]) / len(results["bare"])
    return {"enqueue": enq, "bare": bare, "ratio": enq / bare}


def enqueue_many(db_url: str, n: int = 1000, repeats: int = 3) -> list[float]:
    """ops/s of ``repeats`` calls of enqueue_many(n intents), after one warm-up call."""
    from outbox import Intent

    ob = _outbox(db_url)
    rates: list[float] = []
    try:
        for r in range(repeats + 1):
            prefix = f"many-{uuid.uuid4().hex[:8]}-"
            intents = [
                Intent(
                    endpoint="rx",
                    method="POST",
                    path="/orders",
                    json=payload(i),
                    operation_id=f"{prefix}{i}",
                )
                for i in range(n if r else 10)
            ]
            start = time.perf_counter()
            ops = ob.enqueue_many(intents)
            seconds = time.perf_counter() - start
            if len(ops) != len(intents):
                raise RuntimeError(f"enqueue_many returned {len(ops)} of {len(intents)}")
            if r:
                rates.append(n / seconds)
        return rates
    finally:
        ob.close()
