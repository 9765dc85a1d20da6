"""A plain SQLAlchemy application: an order row and its reservation intent, atomically.

The order and the outbox operation are written in ONE transaction on the application's
own database (``ob.enqueue(..., connection=conn)``): both commit, or neither does. A
dispatcher then sends the reservation to the inventory service (here a local test
receiver that loses the first response after committing it) under the operation ID
``order-17-reserve``, with a fresh request ID per attempt.

Run:  python examples/orders_sqlalchemy.py [-v]   (exit 0 only if every check held;
      -v shows the dispatcher's structured logs)
"""

from __future__ import annotations

import logging
import sys
import tempfile
import threading
from datetime import timedelta
from pathlib import Path

import structlog
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, func, select
from tenacity import wait_fixed

import outbox
from outbox import Endpoint, OperationNotFound, Outbox, RetryPolicy
from outbox.testing.receiver import Receiver

metadata = MetaData()
orders = Table(
    "orders",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("sku", String, nullable=False),
    Column("quantity", Integer, nullable=False),
)


class PaymentDeclined(Exception):
    pass


def place_order(engine: Engine, ob: Outbox, order_id: int, *, fail: bool = False) -> None:
    """The application's use case: one transaction for the order and its intent."""
    with engine.begin() as conn:
        conn.execute(orders.insert().values(id=order_id, sku="TEST-BOLT", quantity=2))
        ob.enqueue(
            endpoint="inventory",
            method="POST",
            path="/reservations",
            json={"order_id": order_id, "sku": "TEST-BOLT", "quantity": 2},
            operation_id=f"order-{order_id}-reserve",  # the caller's, kept across restarts
            connection=conn,  # join this transaction: enqueue never commits it
        )
        if fail:
            raise PaymentDeclined(f"order {order_id}: card declined")


def main() -> int:
    if "-v" not in sys.argv:  # the application decides what the library's logs show
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    checks: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp, Receiver(Path(tmp) / "inventory.db") as inventory:
        url = f"sqlite:///{Path(tmp) / 'app.db'}"
        # An engine configured for SQLite writers (WAL, BEGIN IMMEDIATE, a 0600 file);
        # on PostgreSQL a plain sqlalchemy.create_engine is fine.
        engine = outbox.create_engine(url)
        ob = Outbox(
            engine,
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
        try:
            metadata.create_all(engine)

            place_order(engine, ob, 17)
            print("order 17 placed: order row and reservation intent committed together")
            try:
                place_order(engine, ob, 18, fail=True)
            except PaymentDeclined as exc:
                print(f"order 18 rolled back ({exc})")

            with engine.connect() as conn:
                ids = conn.execute(select(orders.c.id).order_by(orders.c.id)).scalars().all()
            checks.append(("order rows: only 17", list(ids) == [17]))
            try:
                ob.get("order-18-reserve")
                rolled_back = False
            except OperationNotFound:
                rolled_back = True
            checks.append(("no intent for the rolled-back order 18", rolled_back))

            # The inventory service commits the first attempt, then the response is lost.
            inventory.faults.drop_after_commit(times=1)
            stop = threading.Event()
            worker = threading.Thread(target=ob.run_dispatcher, kwargs={"stop": stop})
            worker.start()
            try:
                op = ob.wait("order-17-reserve", timeout=20)
            finally:
                stop.set()
                worker.join(timeout=20)

            print(f"order-17-reserve: {op.state} after {op.attempts_total} attempts")
            for attempt in op.attempts:
                outcome = attempt.status_code or attempt.error_class
                print(f"  attempt {attempt.number}: request {attempt.request_id}"
                      f" -> {outcome} ({attempt.delivery})")  # fmt: skip
            effects = inventory.effects(key="order-17-reserve")
            print(f"inventory store: {len(effects)} reservation(s) for order-17-reserve")
            with engine.connect() as conn:
                count = conn.execute(select(func.count()).select_from(orders)).scalar_one()
            checks += [
                ("order-17-reserve succeeded", op.state == "succeeded"),
                ("two attempts, two request IDs", len({a.request_id for a in op.attempts}) == 2),
                ("one reservation at the inventory store", len(effects) == 1),
                ("nothing sent for order 18", inventory.effect_count(key="order-18-reserve") == 0),
                ("still one order row", count == 1),
            ]
        finally:
            ob.close()
            engine.dispose()

    for name, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
