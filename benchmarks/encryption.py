"""The cost of encryption at rest per operation (issue 27, section 3).

Per round and mode (plain, then sealed, interleaved so drift hits both alike): a fresh
outbox; ``--ops`` enqueues of a ~1 KB JSON body, each in its own transaction (timed);
then ``run_dispatcher(until_empty=True)`` sends them all to the real receiver over
127.0.0.1 and records the outcomes, results sealed too (timed). Medians over rounds.

    python -m benchmarks.encryption --ops 300 --rounds 3 --db sqlite
    python -m benchmarks.encryption --ops 300 --rounds 3 --db postgresql

Prints one JSON line per round and mode and a summary line with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from outbox import Endpoint, Outbox
from outbox.base.keys import KeyRing
from outbox.store.migrate import upgrade
from outbox.testing.receiver import Receiver

RING = KeyRing({"k1": os.urandom(32)}, current="k1", fingerprint_key=os.urandom(32))
BODY = {
    "customer": {"name": "Ada Lovelace", "address": "12 St James's Square, London"},
    "card": "4111111111111111",
    "lines": [{"sku": f"SKU-{i:04d}", "quantity": i, "note": "x" * 40} for i in range(12)],
}


def _pg_url(schema: str) -> str:
    base = os.environ.get(
        "OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    return f"{base}?options=-csearch_path%3D{schema}"


def one_round(db: str, ops: int, sealed: bool) -> dict[str, float]:
    schema = None
    with tempfile.TemporaryDirectory() as tmp, Receiver(Path(tmp) / "rx.sqlite3") as rx:
        url = f"sqlite:///{Path(tmp) / 'outbox.sqlite3'}"
        if db == "postgresql":
            schema = f"bench_enc_{uuid.uuid4().hex[:8]}"
            admin = sa.create_engine(_pg_url("public"))
            with admin.begin() as conn:
                conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
            admin.dispose()
            url = _pg_url(schema)
            engine = sa.create_engine(url)
            upgrade(engine)
            engine.dispose()
        try:
            ob = Outbox(url, endpoints=[Endpoint(name="rx", base_url=rx.url)],
                        keys=RING if sealed else None)  # fmt: skip
            with ob:
                t0 = time.perf_counter()
                for i in range(ops):
                    ob.enqueue(endpoint="rx", method="POST", path="/orders", json=BODY,
                               operation_id=f"op-{i}")  # fmt: skip
                t1 = time.perf_counter()
                ob.run_dispatcher(until_empty=True)
                t2 = time.perf_counter()
                assert rx.effect_count() == ops, "not every operation arrived"
        finally:
            if schema is not None:
                admin = sa.create_engine(_pg_url("public"))
                with admin.begin() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
                admin.dispose()
    return {"enqueue_us": (t1 - t0) / ops * 1e6, "dispatch_us": (t2 - t1) / ops * 1e6}


def crypto_us(n: int = 2000) -> dict[str, float]:
    """The CPU cost alone: seal a request row and a result, and open all four values."""
    from outbox.store.sealing import Sealer, request_aad, result_aad

    sealer = Sealer(RING)
    body = json.dumps(BODY, sort_keys=True, separators=(",", ":"))
    row = {"tenant": "", "operation_id": "op-1", "headers": '{"x-a":"b"}', "body": body}
    t0 = time.perf_counter()
    for _ in range(n):
        sealed = sealer.seal_request(row)
        res = sealer.seal_result(7, {"result_headers": '{"a":"b"}', "result_body": body})
    t1 = time.perf_counter()
    for _ in range(n):
        sealer.open(sealed["body"], request_aad("", "op-1", "body"))
        sealer.open(sealed["headers"], request_aad("", "op-1", "headers"))
        sealer.open(res["result_body"], result_aad(7, "result_body"))
        sealer.open(res["result_headers"], result_aad(7, "result_headers"))
    t2 = time.perf_counter()
    return {"seal_us": (t1 - t0) / n * 1e6, "open_us": (t2 - t1) / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    args = parser.parse_args()
    got: dict[str, list[dict[str, float]]] = {"plain": [], "sealed": []}
    for r in range(args.rounds):
        for mode in ("plain", "sealed"):
            m = one_round(args.db, args.ops, mode == "sealed")
            got[mode].append(m)
            print(json.dumps({"round": r, "mode": mode, "db": args.db, **m}), flush=True)
    med = {
        mode: {k: statistics.median(x[k] for x in rows) for k in ("enqueue_us", "dispatch_us")}
        for mode, rows in got.items()
    }
    total = {mode: m["enqueue_us"] + m["dispatch_us"] for mode, m in med.items()}
    print(json.dumps({
        "summary": True, "db": args.db, "ops": args.ops, "rounds": args.rounds, **{
            f"{mode}_{k}": round(v, 1) for mode, m in med.items() for k, v in m.items()},
        "enqueue_ratio": round(med["sealed"]["enqueue_us"] / med["plain"]["enqueue_us"], 3),
        "dispatch_ratio": round(med["sealed"]["dispatch_us"] / med["plain"]["dispatch_us"], 3),
        "total_ratio": round(total["sealed"] / total["plain"], 3),
        "sealed_extra_us_per_op": round(total["sealed"] - total["plain"], 1),
        **{f"cpu_{k}_per_op": round(v, 1) for k, v in crypto_us().items()},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
