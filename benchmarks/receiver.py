"""The receiver kit's own cost: one FastAPI handler served with receipts and without.

The same service (``examples/receiver_fastapi.py``'s reservation insert) on one uvicorn
process exposes ``POST /reservations`` (receipted: a claim transaction, then the handler's
transaction carrying the receipt) and ``POST /plain`` (the same insert in one
transaction, no receipts). N POSTs with fresh ``Idempotency-Key``s at a fixed
concurrency are timed against each, interleaved over the repetitions; the ratio
receipted / plain is the figure (target >= 0.7). SQLite runs with ``synchronous=FULL``
(``outbox.create_engine``), PostgreSQL on ``OUTBOX_BENCH_POSTGRES_URL`` or the test URL.

    python -m benchmarks.receiver                 # n=2000, concurrency 32, 3 repetitions
    python -m benchmarks.receiver --n 300 --reps 1   # a short run
"""

# No postponed annotations: FastAPI evaluates the /plain route's own.

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PG_URL = os.environ.get(
    "OUTBOX_BENCH_POSTGRES_URL",
    os.environ.get("OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
HEADERS = {"Authorization": "Bearer orders-app-token", "Content-Type": "application/json"}


def app_factory() -> Any:
    """The benchmark's service (``uvicorn --factory``), on ``RECEIVER_BENCH_DB``."""
    sys.path.insert(0, str(ROOT))
    from typing import Annotated

    from fastapi import Depends
    from fastapi.responses import JSONResponse
    from sqlalchemy import insert

    from examples.receiver_fastapi import Reservation, build_app, identity, reservations
    from outbox.receiver import Identity

    app = build_app(os.environ["RECEIVER_BENCH_DB"])
    engine = app.state.receipts.engine

    @app.post("/plain", status_code=201)
    def plain(body: Reservation, who: Annotated[Identity, Depends(identity)]) -> JSONResponse:
        with engine.begin() as conn:
            new_id = conn.execute(
                insert(reservations)
                .values(tenant=who.tenant, sku=body.sku, quantity=body.quantity)
                .returning(reservations.c.id)
            ).scalar_one()
        return JSONResponse({"reservation_id": new_id}, status_code=201)

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _drive(url: str, n: int, concurrency: int) -> float:
    import httpx

    body = {"sku": "TEST-BOLT", "quantity": 2}
    todo = iter(range(n))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            for _ in todo:
                headers = {**HEADERS, "Idempotency-Key": f"bench-{uuid.uuid4().hex}"}
                r = await client.post(url, json=body, headers=headers)
                if r.status_code != 201:
                    raise RuntimeError(f"{url} answered {r.status_code}: {r.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - start)


def _pg_schema_url() -> tuple[str, str] | None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    schema = f"bench_rx_{uuid.uuid4().hex[:8]}"
    try:
        admin = create_engine(PG_URL)
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        admin.dispose()
    except Exception as exc:
        print(f"postgresql skipped: {exc!r}", file=sys.stderr)
        return None
    url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    return url.render_as_string(hide_password=False), schema


def _drop_schema(schema: str) -> None:
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_URL)
    with admin.begin() as conn:
        conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
    admin.dispose()


def measure(db_url: str, *, n: int, concurrency: int, reps: int) -> dict[str, Any]:
    port = _free_port()
    env = {**os.environ, "RECEIVER_BENCH_DB": db_url, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "uvicorn", "benchmarks.receiver:app_factory", "--factory",
           "--port", str(port), "--log-level", "warning", "--no-access-log"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the benchmark service did not start") from None
                time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(_drive(f"{base}/reservations", min(50, n), concurrency))  # warm-up
        asyncio.run(_drive(f"{base}/plain", min(50, n), concurrency))
        with_receipts: list[float] = []
        without: list[float] = []
        for _ in range(reps):
            with_receipts.append(asyncio.run(_drive(f"{base}/reservations", n, concurrency)))
            without.append(asyncio.run(_drive(f"{base}/plain", n, concurrency)))
    finally:
        proc.terminate()
        proc.wait(10)
    rx, plain = statistics.median(with_receipts), statistics.median(without)
    return {"with_receipts_ops_s": round(rx, 1), "without_ops_s": round(plain, 1),
            "ratio": round(rx / plain, 3), "target": 0.7, "met": rx / plain >= 0.7}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="receiver kit: receipts vs none")
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["sqlite", "postgresql"], default=None)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"n": args.n, "concurrency": args.concurrency, "reps": args.reps}
    if args.only in (None, "sqlite"):
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'bench.sqlite3'}"
            results["sqlite_full"] = measure(url, n=args.n, concurrency=args.concurrency,
                                             reps=args.reps)  # fmt: skip
    if args.only in (None, "postgresql"):
        made = _pg_schema_url()
        if made is not None:
            try:
                results["postgresql"] = measure(made[0], n=args.n, concurrency=args.concurrency,
                                                reps=args.reps)  # fmt: skip
            finally:
                _drop_schema(made[1])
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
