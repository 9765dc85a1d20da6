"""An asyncio application: SQLAlchemy's AsyncEngine (aiosqlite) and the async dispatcher.

Request handlers write an order and enqueue its reservation in one transaction of the
application's AsyncConnection: ``await ob.enqueue_async(..., connection=conn)`` joins
that transaction and never commits it. The dispatcher runs in the same
event loop (``await ob.run_dispatcher_async(stop=...)``) and is stopped with an Event;
requests in flight finish first. The inventory service, a local test receiver, loses
the response of the first reservation it commits.

Needs aiosqlite:  pip install "http-outbox[asyncio]"
Run:  python examples/async_caller.py [-v]   (exit 0 only if every check held)
"""

from __future__ import annotations

import asyncio
import logging
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import structlog
from sqlalchemy import Column, Integer, MetaData, String, Table, select
from sqlalchemy.ext.asyncio import AsyncEngine
from tenacity import wait_fixed

import outbox
from outbox import Endpoint, Outbox, RetryPolicy, State
from outbox.testing.receiver import Receiver

metadata = MetaData()
orders = Table(
    "orders",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("sku", String, nullable=False),
    Column("quantity", Integer, nullable=False),
)


class OutOfStock(Exception):
    pass


async def place_order(app: AsyncEngine, ob: Outbox, order_id: int, *, fail: bool = False) -> str:
    """One request handler: the order row and its intent commit together or not at all."""
    operation_id = f"order-{order_id}-reserve"
    async with app.begin() as conn:
        await conn.execute(orders.insert().values(id=order_id, sku="TEST-BOLT", quantity=2))
        await ob.enqueue_async(
            endpoint="inventory",
            method="POST",
            path="/reservations",
            json={"order_id": order_id, "sku": "TEST-BOLT", "quantity": 2},
            operation_id=operation_id,
            connection=conn,  # joins this transaction; never commits it
        )
        if fail:
            raise OutOfStock(f"order {order_id}: validation failed after enqueue")
    return operation_id


async def run(tmp: Path) -> list[tuple[str, bool]]:
    checks: list[tuple[str, bool]] = []
    with Receiver(tmp / "inventory.db") as inventory:
        inventory.faults.drop_after_commit(times=1)
        db_file = tmp / "app.db"
        # The outbox first: it creates the SQLite file private (0600) and migrates it.
        ob = Outbox(
            f"sqlite:///{db_file}",
            endpoints=[
                Endpoint(
                    name="inventory",
                    base_url=inventory.url,
                    timeout=2.0,
                    retry=RetryPolicy(max_attempts=5, window=timedelta(seconds=30),
                                      wait=wait_fixed(0.2)),
                    key_retention=timedelta(hours=1),
                )
            ],
        )  # fmt: skip
        # An AsyncEngine configured like outbox.create_engine (WAL, BEGIN IMMEDIATE).
        app = outbox.create_async_engine(f"sqlite:///{db_file}")
        try:
            async with app.begin() as conn:
                await conn.run_sync(metadata.create_all)

            stop = asyncio.Event()
            dispatcher = asyncio.create_task(ob.run_dispatcher_async(stop=stop))

            placed = list(await asyncio.gather(*(place_order(app, ob, n) for n in (1, 2, 3))))
            try:
                await place_order(app, ob, 4, fail=True)
            except OutOfStock as exc:
                print(f"order 4 rolled back ({exc})")
            print(f"placed {placed}")

            # wait_async polls without blocking the loop, so the dispatcher keeps going.
            ops = [await ob.wait_async(op_id, timeout=20) for op_id in placed]
            stop.set()
            summary = await dispatcher
            print(f"dispatcher stopped: {summary.as_dict()}")

            for op in ops:
                print(f"{op.operation_id}: {op.state}, {op.attempts_total} attempt(s), "
                      f"{inventory.effect_count(key=op.operation_id)} reservation(s)")  # fmt: skip
            async with app.connect() as conn:
                ids = (await conn.execute(select(orders.c.id).order_by(orders.c.id))).scalars()
                order_ids = list(ids)
            intent_4 = await ob.find_async("order-4-reserve") is not None
            checks += [
                ("every placed order's reservation succeeded",
                 all(op.state is State.SUCCEEDED for op in ops)),
                ("one reservation per order at the inventory store",
                 all(inventory.effect_count(key=op_id) == 1 for op_id in placed)),
                ("the lost response was retried under the same operation ID",
                 any(op.attempts_total == 2 for op in ops)),
                ("order rows 1-3 only", order_ids == [1, 2, 3]),
                ("no intent and no reservation for the rolled-back order 4",
                 not intent_4 and inventory.effect_count(key="order-4-reserve") == 0),
            ]  # fmt: skip
        finally:
            await app.dispose()
            ob.close()
    return checks


def main() -> int:
    if "-v" not in sys.argv:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with tempfile.TemporaryDirectory() as tmp:
        checks = asyncio.run(run(Path(tmp)))
    for name, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    return 0 if checks and all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
