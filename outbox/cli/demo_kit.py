"""``outbox demo --receiver kit``: the same story against the real receiver kit.

* order-1001: the service commits, then the answer is lost. The retry (same key, new
  request ID) gets the stored answer, marked ``Idempotent-Replayed``: one reservation.
* order-1002: a plain success.
* order-1003: someone already used the key with other arguments: 422, ``key_conflict``.
* order-1004: every answer is lost; the outbox gives up as ``outcome_unknown`` and its
  status lookup (``GET /operations/{key}``, no configuration) settles it as succeeded.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import httpx
from rich.console import Console
from rich.table import Table
from tenacity import wait_random_exponential

from outbox.cli.demo import demo_files
from outbox.client import Outbox
from outbox.config import Endpoint, RetryPolicy, StatusLookup
from outbox.receiver.demo import KitService

ORDERS = {
    "order-1001-reserve": {"order": 1001, "sku": "TEST-BOLT", "quantity": 2},
    "order-1002-reserve": {"order": 1002, "sku": "TEST-NUT", "quantity": 5},
    "order-1003-reserve": {"order": 1003, "sku": "TEST-GEAR", "quantity": 1},
    "order-1004-reserve": {"order": 1004, "sku": "TEST-AXLE", "quantity": 3},
}


def run_kit_demo(directory: str | None, out: Console, *, deadline_seconds: float = 30.0) -> None:
    with demo_files(directory, out) as workdir:
        db_url = f"sqlite:///{workdir / 'outbox.sqlite3'}"
        with KitService(workdir / "service.sqlite3") as service:
            _story(service, db_url, out, deadline_seconds)


def _story(service: KitService, db_url: str, out: Console, deadline_seconds: float) -> None:
    service.lose_answer("order-1001-reserve", times=1)
    service.lose_answer("order-1004-reserve", times=2)
    taken = httpx.post(
        f"{service.url}/reservations",
        json={"order": 1003, "sku": "TEST-GEAR", "quantity": 9},
        headers={"Idempotency-Key": "order-1003-reserve"},
    )
    endpoint = Endpoint(
        name="inventory",
        base_url=service.url,
        timeout=2.0,
        retry=RetryPolicy(
            max_attempts=2,
            window=timedelta(seconds=10),
            wait=wait_random_exponential(multiplier=0.1, max=0.3),
        ),
        key_retention=timedelta(hours=24),  # what the kit declares
        status_lookup=StatusLookup(),
    )
    out.print(f"[bold]outbox demo[/bold] against the receiver kit at {service.url}\n", markup=True)
    out.print(f"(order-1003's key was already used with other arguments: {taken.status_code})")
    with Outbox(db_url, endpoints=[endpoint]) as ob:
        for op_id, body in ORDERS.items():
            ob.enqueue(endpoint="inventory", method="POST", path="/reservations", json=body,
                       operation_id=op_id)  # fmt: skip
        started = time.monotonic()
        while time.monotonic() - started < deadline_seconds:
            ob.dispatch_once()
            if all(ob.get(op).state.is_settled for op in ORDERS):
                break
            time.sleep(0.05)
        table = Table(title="\nwhat happened")
        for column in ("operation id", "state", "attempts", "reservations at the service"):
            table.add_column(column)
        for op_id in ORDERS:
            op = ob.get(op_id)
            state = op.state.value + (f" ({op.reason.value})" if op.reason else "")
            attempts = "\n".join(
                f"#{a.number} {a.request_id[:8]} {a.status_code or a.error_class or ''}"
                for a in op.attempts
            )
            table.add_row(op_id, state, attempts, str(service.effect_count(op_id)))
        out.print(table)
        status = service.receipts.status("", "demo", "order-1004-reserve")
        out.print(f"\nGET /operations/order-1004-reserve -> {status.status} "
                  f"{json.loads(status.body)['state']}")  # fmt: skip
