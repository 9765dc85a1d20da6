"""``outbox demo``: the whole story in a few seconds, against a real local receiver.

Four orders each reserve stock at an inventory service through the outbox:

* order-1001: the receiver commits the reservation, then the connection drops before
  the answer. The dispatcher retries under the same operation ID with a new request
  ID; the receiver replays its stored answer. One reservation, two request IDs.
* order-1002: a plain success.
* order-1003: the receiver is briefly overloaded (503 with Retry-After), then accepts.
* order-1004: the receiver commits, then never answers. The retry window closes with
  the outcome unknown, and the operation waits in the reconciliation queue.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tenacity import wait_random_exponential

from outbox.base import logs
from outbox.client import Outbox
from outbox.config import DispatcherSettings, Endpoint, RetryPolicy
from outbox.model import State
from outbox.reconcile import explain
from outbox.testing.receiver import Receiver

ORDERS = {
    "order-1001-reserve": ("/reservations", {"order": 1001, "sku": "TEST-BOLT", "quantity": 2}),
    "order-1002-reserve": ("/reservations", {"order": 1002, "sku": "TEST-NUT", "quantity": 5}),
    "order-1003-reserve": ("/reservations", {"order": 1003, "sku": "TEST-GEAR", "quantity": 1}),
    "order-1004-reserve": (
        "/reservations/slow",
        {"order": 1004, "sku": "TEST-AXLE", "quantity": 3},
    ),
}


@contextlib.contextmanager
def demo_files(directory: str | None, out: Console) -> Iterator[Path]:
    """A demo's working directory: ``directory`` if given (kept, and its place printed
    at the end), else a temporary one removed afterwards. Quiets the library's logs."""
    logs.configure("error")
    keep = directory is not None
    workdir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="outbox-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        yield workdir
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if keep:
        out.print(f"\nfiles kept in {workdir}")


def run_demo(directory: str | None, out: Console, *, deadline_seconds: float = 30.0) -> None:
    """Run the demo; keep its files in ``directory`` if given, else in a removed temp dir."""
    with demo_files(directory, out) as workdir:
        db_url = f"sqlite:///{workdir / 'outbox.sqlite3'}"
        with Receiver(workdir / "receiver.sqlite3") as receiver:
            _story(receiver, db_url, out, deadline_seconds, keep=directory is not None)


def _story(
    receiver: Receiver, db_url: str, out: Console, deadline_seconds: float, *, keep: bool
) -> None:
    receiver.faults.drop_after_commit(times=1, key="order-1001-reserve")
    receiver.faults.fail_before_work(503, retry_after="1", times=1, key="order-1003-reserve")
    receiver.faults.hang_after_commit(path="/reservations/slow", replays=True)
    endpoint = Endpoint(
        name="inventory",
        base_url=receiver.url,
        timeout=1.0,
        retry=RetryPolicy(
            max_attempts=4,
            window=timedelta(seconds=5),
            wait=wait_random_exponential(multiplier=0.2, max=1.0),
        ),
        key_retention=timedelta(hours=1),
    )
    out.print(
        f"[bold]outbox demo[/bold]: receiver at {receiver.url}, outbox at {db_url}\n", markup=True
    )
    with Outbox(
        db_url, endpoints=[endpoint], dispatcher=DispatcherSettings(idle_poll_seconds=0.05)
    ) as ob:
        for op_id, (path, body) in ORDERS.items():
            ob.enqueue(
                endpoint="inventory", method="POST", path=path, json=body, operation_id=op_id
            )
            out.print(f"enqueued {op_id}: POST {path} {body}", markup=False)
        out.print("\ndispatching (a background dispatcher thread)...")
        stop = threading.Event()
        worker = threading.Thread(target=lambda: ob.run_dispatcher(concurrency=8, stop=stop))
        worker.start()
        started = time.monotonic()
        try:
            last = ""
            while time.monotonic() - started < deadline_seconds:
                states = {op_id: ob.get(op_id).state for op_id in ORDERS}
                line = "  ".join(f"{k.split('-')[1]}={v.value}" for k, v in states.items())
                if line != last:
                    out.print(f"  {time.monotonic() - started:4.1f}s  {line}")
                    last = line
                if all(s.is_settled for s in states.values()):
                    break
                time.sleep(0.1)
        finally:
            stop.set()
            worker.join()
        _report(ob, receiver, out, db_url, keep=keep)


def _report(ob: Outbox, receiver: Receiver, out: Console, db_url: str, *, keep: bool) -> None:
    table = Table(title="\nwhat happened")
    for column in ("operation id", "state", "attempts (request ids)", "effects at receiver"):
        table.add_column(column)
    for op_id in ORDERS:
        op = ob.get(op_id)
        ids = "\n".join(
            f"#{a.number} {a.request_id[:8]} {a.status_code or a.error_class or ''}"
            for a in op.attempts
        )
        state = op.state.value + (f" ({op.reason.value})" if op.reason else "")
        table.add_row(op_id, state, ids, str(receiver.effect_count(key=op_id)))
    out.print(table)

    lost = ob.get("order-1001-reserve")
    replays = [r for r in receiver.requests(key="order-1001-reserve")]
    out.print(
        "\n[bold]order-1001[/bold]: the first answer was lost after the receiver committed.",
        markup=True,
    )
    out.print(f"  one operation ID (Idempotency-Key): {lost.operation_id}")
    for a in lost.attempts:
        out.print(
            f"  attempt {a.number}: X-Request-ID {a.request_id} -> {a.status_code or a.error_class}"
        )
    out.print(
        f"  requests seen by the receiver: {len(replays)}; reservations made: "
        f"{receiver.effect_count(key='order-1001-reserve')} (the retry got the stored answer)"
    )

    unresolved = [ob.get(op_id) for op_id in ORDERS if ob.get(op_id).state is State.UNRESOLVED]
    if unresolved:
        out.print("\n[bold]reconciliation queue[/bold] (never sent again on its own):", markup=True)
        for op in unresolved:
            out.print(
                f"  {op.operation_id}: {op.reason.value if op.reason else ''}: {explain(op)}",
                markup=False,
            )
        first = unresolved[0].operation_id
        if keep:
            out.print("\nan operator would now run:")
        else:
            out.print(
                "\nan operator would now run (on a database this demo removes when it "
                "exits: `outbox demo --dir DIR` keeps it):"
            )
        out.print(f"  outbox --db {db_url} reconcile list", markup=False)
        out.print(f"  outbox --db {db_url} reconcile show {first}", markup=False)
        out.print(
            f"  outbox --db {db_url} reconcile resolve {first} --as succeeded "
            "--note 'reservation found in the inventory admin'",
            markup=False,
        )
        out.print("  (or `reconcile requeue` to send it again under the same operation ID)")
    if not keep:
        out.print("\n(run with --dir DIR to keep the databases and try those commands)")
