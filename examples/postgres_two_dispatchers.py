"""Two dispatcher processes sharing one PostgreSQL outbox.

Creates a schema of its own, runs ``outbox migrate``, starts two
``outbox dispatch --app examples.postgres_two_dispatchers:outbox`` processes, enqueues N
reservations, and checks at the receiver (a local test receiver) that there are exactly
N effects and N requests: claims use ``FOR UPDATE SKIP LOCKED``, so no operation is sent
by both. Then it SIGTERMs both dispatchers (they drain and exit 0) and drops the schema.

The database comes from OUTBOX_EXAMPLE_POSTGRES_URL
(default postgresql+psycopg://postgres@127.0.0.1:5432/test).

Run from the repository root:  python examples/postgres_two_dispatchers.py
Exit 0 only if every check held; 2 if PostgreSQL is unreachable.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import structlog
from sqlalchemy import text
from sqlalchemy.engine import make_url
from tenacity import wait_fixed

from outbox import DispatcherSettings, Endpoint, Intent, Outbox, RetryPolicy, create_engine
from outbox.testing.receiver import Receiver

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
N = 100
ROOT = Path(__file__).resolve().parents[1]
APP = "examples.postgres_two_dispatchers:outbox"


def outbox() -> Outbox:
    """The application's Outbox: ``outbox dispatch --app`` calls this in each process.

    Endpoints and credentials live in code; the database and the receiver's address
    come from the environment the example gives its dispatchers.
    """
    return Outbox(
        os.environ["OUTBOX_EXAMPLE_DB_URL"],
        endpoints=[
            Endpoint(
                name="inventory",
                base_url=os.environ["OUTBOX_EXAMPLE_RECEIVER_URL"],
                timeout=5.0,
                retry=RetryPolicy(max_attempts=5, window=timedelta(minutes=1),
                                  wait=wait_fixed(0.5)),
                key_retention=timedelta(hours=1),
            )
        ],
        # Small claims, so both processes get a share of a burst.
        dispatcher=DispatcherSettings(concurrency=8, batch_size=10, idle_poll_seconds=0.05),
    )  # fmt: skip


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "outbox.cli", *args]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def log_events(path: Path) -> list[dict[str, object]]:
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def run(base_url: str, tmp: Path) -> list[tuple[str, bool]]:
    schema = f"outbox_example_{uuid.uuid4().hex[:10]}"
    url = make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
    url_text = url.render_as_string(hide_password=False)
    admin = create_engine(base_url)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    print(f"schema {schema} created")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        # synchronous="NORMAL": this receiver need not survive a power cut, only be quick.
        with Receiver(tmp / "inventory.db", synchronous="NORMAL") as inventory:
            env = dict(os.environ)
            env["OUTBOX_EXAMPLE_DB_URL"] = url_text
            env["OUTBOX_EXAMPLE_RECEIVER_URL"] = inventory.url
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
            os.environ.update(env)

            subprocess.run(cli("--db", url_text, "migrate"), check=True, env=env, cwd=ROOT)

            logs = [tmp / "dispatcher-a.log", tmp / "dispatcher-b.log"]
            for log in logs:
                with log.open("wb") as sink:
                    processes.append(
                        subprocess.Popen(
                            cli("--app", APP, "--log-format", "json", "dispatch"),
                            cwd=ROOT,
                            env=env,
                            stdout=sink,
                            stderr=subprocess.STDOUT,
                        )
                    )
            wait_until(
                lambda: all("dispatcher_started" in log.read_text() for log in logs),
                30,
                "both dispatchers to start",
            )
            print("two dispatchers started:", ", ".join(str(p.pid) for p in processes))

            ob = outbox()
            try:
                ob.enqueue_many(
                    [
                        Intent(
                            endpoint="inventory",
                            method="POST",
                            path="/reservations",
                            json={"order_id": n, "sku": "TEST-BOLT", "quantity": 1},
                            operation_id=f"order-{n}-reserve",
                        )
                        for n in range(N)
                    ]
                )
                print(f"enqueued {N} reservations")
                wait_until(
                    lambda: (
                        ob.reconcile.status().counts["succeeded"] == N
                        or any(p.poll() is not None for p in processes)
                    ),
                    60,
                    f"{N} operations to succeed",
                )
                counts = ob.reconcile.status().counts
                ops = [ob.get(f"order-{n}-reserve") for n in range(N)]
            finally:
                ob.close()

            senders: dict[str, int] = {}
            for op in ops:
                for attempt in op.attempts:
                    senders[attempt.dispatcher_id] = senders.get(attempt.dispatcher_id, 0) + 1
            effects = inventory.effect_count()
            requests = len(inventory.requests())
            print(f"states: {counts}")
            print(f"attempts per dispatcher: {senders}")
            print(f"receiver: {effects} effects, {requests} requests")

            for p in processes:
                p.send_signal(signal.SIGTERM)
            codes = [p.wait(timeout=30) for p in processes]
            print(f"dispatchers exited with {codes} after SIGTERM")
            stopped = [e for log in logs for e in log_events(log)
                       if e.get("event") == "dispatcher_stopped"]  # fmt: skip
            return [
                (f"all {N} operations succeeded", counts["succeeded"] == N),
                (f"{N} effects at the receiver", effects == N),
                (f"{N} requests at the receiver: none sent twice", requests == N),
                ("one attempt per operation", all(op.attempts_total == 1 for op in ops)),
                ("both dispatchers exited 0 after SIGTERM", codes == [0, 0]),
                ("both dispatchers drained and reported", len(stopped) == 2),
            ]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
                p.wait()
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
        print(f"schema {schema} dropped")


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    base_url = os.environ.get("OUTBOX_EXAMPLE_POSTGRES_URL", DEFAULT_URL)
    try:
        probe = create_engine(base_url)
        with probe.connect() as conn:
            conn.execute(text("SELECT 1"))
        probe.dispose()
    except Exception as exc:
        print(f"PostgreSQL at {base_url} is unreachable: {type(exc).__name__}: {exc}")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        checks = run(base_url, Path(tmp))
    for name, ok in checks:
        print(f"[{'ok' if ok else 'FAILED'}] {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
