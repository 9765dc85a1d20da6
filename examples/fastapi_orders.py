"""A FastAPI service: an order and its reservation intent in ONE async transaction.

``POST /orders`` writes the order row and enqueues the reservation in one transaction of
the app's ``AsyncEngine`` (``async with ob.transaction_async(engine) as tx``); an order
refused after the enqueue (quantity over the limit) rolls back both. The dispatcher runs
in the app's lifespan, in the same event loop (``ob.run_dispatcher_async(stop=...)``);
shutting the server down stops it after the requests in flight. ``GET
/orders/{id}/reservation`` reports the operation's state (``ob.find_async``).

The app reads ORDERS_DATABASE_URL (``sqlite:///…`` or ``postgresql://…``; on PostgreSQL
run ``outbox migrate`` first) and INVENTORY_URL. Serve it with
``uvicorn examples.fastapi_orders:app``.

Run as a script, it is its own demo and check: a local test receiver as the inventory
service (it loses the first response after committing), the app under uvicorn in a
subprocess, an HTTP client placing orders against it, then SIGTERM.

    python examples/fastapi_orders.py                # SQLite
    python examples/fastapi_orders.py --postgres     # OUTBOX_EXAMPLE_POSTGRES_URL
                                                     # (default: the local server)

Exit 0 only if every check held; 2 if PostgreSQL is unreachable.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import structlog
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from tenacity import wait_fixed

import outbox
from outbox import Endpoint, Outbox, RetryPolicy

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("sku", sa.String(64), nullable=False),
    sa.Column("quantity", sa.Integer, nullable=False),
)
MAX_QUANTITY = 100


class OrderIn(BaseModel):
    id: int
    sku: str
    quantity: int


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    import asyncio

    url = os.environ.get("ORDERS_DATABASE_URL", "sqlite:///orders.db")
    ob = Outbox(
        url,
        endpoints=[
            Endpoint(
                name="inventory",
                base_url=os.environ["INVENTORY_URL"],
                timeout=5.0,
                retry=RetryPolicy(max_attempts=5, window=timedelta(minutes=1),
                                  wait=wait_fixed(0.2)),
                key_retention=timedelta(hours=1),
            )
        ],
    )  # fmt: skip
    engine = outbox.create_async_engine(url)  # aiosqlite or psycopg's async driver
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    app.state.ob, app.state.engine = ob, engine
    stop = asyncio.Event()
    dispatcher = asyncio.create_task(ob.run_dispatcher_async(stop=stop))
    try:
        yield
    finally:
        stop.set()  # stop claiming; requests in flight finish and are recorded
        summary = await dispatcher
        print(f"dispatcher drained: {summary.as_dict()}", flush=True)
        await engine.dispose()
        ob.close()


app = FastAPI(lifespan=lifespan)


@app.post("/orders", status_code=201)
async def place_order(order: OrderIn) -> dict[str, Any]:
    ob: Outbox = app.state.ob
    operation_id = f"order-{order.id}-reserve"
    async with ob.transaction_async(app.state.engine) as tx:
        await tx.connection.execute(orders.insert().values(**order.model_dump()))
        await tx.enqueue(
            endpoint="inventory",
            method="POST",
            path="/reservations",
            json={"order_id": order.id, "sku": order.sku, "quantity": order.quantity},
            operation_id=operation_id,
        )
        if order.quantity > MAX_QUANTITY:  # refused after the enqueue: both roll back
            raise HTTPException(422, f"at most {MAX_QUANTITY} per order")
    return {"order_id": order.id, "operation_id": operation_id}


@app.get("/orders/{order_id}/reservation")
async def reservation(order_id: int) -> dict[str, Any]:
    op = await app.state.ob.find_async(f"order-{order_id}-reserve")
    if op is None:
        raise HTTPException(404, "no reservation for this order")
    return {"operation_id": op.operation_id, "state": op.state.value,
            "attempts": op.attempts_total}  # fmt: skip


@app.get("/health")
async def health() -> dict[str, bool]:
    return {"ok": True}


# -- the demo: serve the app, drive it over HTTP, check the effects --------------------

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def serve(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """uvicorn in a subprocess on a socket bound here (no port race); output to ``log``."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    with log.open("wb") as sink:
        server = subprocess.Popen(
            [sys.executable, "-W", "error", "-m", "uvicorn", "examples.fastapi_orders:app",
             "--fd", str(sock.fileno()), "--log-level", "warning"],
            cwd=ROOT, env=env, pass_fds=[sock.fileno()], stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    sock.close()
    return server, f"http://127.0.0.1:{port}"


def run(tmp: Path, database_url: str) -> list[tuple[str, bool]]:
    from outbox.testing import Receiver

    with Receiver(tmp / "inventory.db") as inventory:
        inventory.faults.drop_after_commit(times=1)  # the first reservation's answer is lost
        env = {**os.environ, "ORDERS_DATABASE_URL": database_url, "INVENTORY_URL": inventory.url}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        log = tmp / "server.log"
        server, base = serve(env, log)
        try:
            with httpx.Client(base_url=base, timeout=10) as client:
                deadline = time.monotonic() + 60
                while True:  # until the app has started (its lifespan ran)
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the app did not start (exit {server.poll()})")
                    time.sleep(0.1)
                order = {"sku": "TEST-BOLT", "quantity": 2}
                placed = [client.post("/orders", json={**order, "id": n}) for n in (1, 2, 3)]
                refused = client.post("/orders", json={**order, "id": 4, "quantity": 500})
                print("POST /orders:", [r.status_code for r in placed], refused.status_code)
                states: dict[int, Any] = {}
                while time.monotonic() < deadline:
                    states = {n: client.get(f"/orders/{n}/reservation").json() for n in (1, 2, 3)}
                    if all(s["state"] == "succeeded" for s in states.values()):
                        break
                    time.sleep(0.1)
                missing = client.get("/orders/4/reservation").status_code
            print("reservations:", states)
        finally:
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=60)
        output = log.read_text()
        # uvicorn shuts down gracefully on SIGTERM (the lifespan's exit runs), then
        # re-raises the signal, so the exit status is 0 or -SIGTERM.
        stopped = code in (0, -signal.SIGTERM) and "dispatcher drained" in output
        print(f"server exited {code} after SIGTERM")
        if not stopped or "Traceback" in output:
            print(output)
        check_engine = sa.create_engine(database_url)
        try:
            with check_engine.connect() as conn:
                order_ids = list(conn.execute(sa.select(orders.c.id).order_by(orders.c.id))
                                 .scalars())  # fmt: skip
        finally:
            check_engine.dispose()
        return [
            ("three orders accepted (201)", [r.status_code for r in placed] == [201] * 3),
            ("the order over the limit refused (422)", refused.status_code == 422),
            ("order rows 1-3 only: the refused one rolled back", order_ids == [1, 2, 3]),
            ("no reservation for the refused order", missing == 404),
            ("every reservation succeeded",
             all(s.get("state") == "succeeded" for s in states.values()) and len(states) == 3),
            ("one reservation per order at the inventory service",
             all(inventory.effect_count(key=f"order-{n}-reserve") == 1 for n in (1, 2, 3))),
            ("nothing sent for the refused order",
             inventory.effect_count(key="order-4-reserve") == 0),
            ("the lost answer was retried under the same operation ID",
             any(s.get("attempts") == 2 for s in states.values())),
            ("SIGTERM: the lifespan drained the dispatcher and the server exited", stopped),
        ]  # fmt: skip


def postgres_schema(base_url: str) -> tuple[str, str]:
    """A fresh schema (and a URL using it) on the PostgreSQL server, migrated."""
    schema = f"fastapi_example_{uuid.uuid4().hex[:10]}"
    admin = outbox.create_engine(base_url)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    finally:
        admin.dispose()
    url = sa.make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
    url_text = url.render_as_string(hide_password=False)
    # PostgreSQL schema changes are a deliberate step: outbox migrate, before the app.
    subprocess.run([sys.executable, "-m", "outbox.cli", "--db", url_text, "migrate"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return schema, url_text


def main() -> int:
    if "-v" not in sys.argv:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        if "--postgres" not in sys.argv:
            checks = run(Path(tmp), f"sqlite:///{Path(tmp) / 'orders.db'}")
        else:
            base_url = os.environ.get("OUTBOX_EXAMPLE_POSTGRES_URL", DEFAULT_POSTGRES)
            try:
                schema, url = postgres_schema(base_url)
            except Exception as exc:
                print(f"PostgreSQL at {base_url} is unreachable: {type(exc).__name__}: {exc}")
                return 2
            try:
                checks = run(Path(tmp), url)
            finally:
                admin = outbox.create_engine(base_url)
                with admin.begin() as conn:
                    conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
                admin.dispose()
    for name, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
