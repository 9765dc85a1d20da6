"""The dispatcher on the raw clients' job: drain N pending operations to the receiver.

Throughput is timed from the dispatcher's start to the moment its own summary counts N
settled operations (no polling of the database), then checked against the outbox's
state counts and the receiver's effect table.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import endpoint, payload


def make_outbox(db_url: str, rx_url: str, concurrency: int, transport: Any = None) -> Any:
    from outbox import Outbox

    return Outbox(
        db_url,
        endpoints=[endpoint(rx_url, concurrency=concurrency)],
        transport_factory=transport,
    )


def enqueue_each(ob: Any, n: int, prefix: str) -> None:
    """Enqueue N operations one at a time, each in its own transaction."""
    for i in range(n):
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json=payload(i),
                   operation_id=f"{prefix}{i}")  # fmt: skip


def load(ob: Any, n: int, prefix: str, *, chunk: int = 1000) -> None:
    """Enqueue N operations quickly (enqueue_many in chunks); not part of any timing."""
    from outbox import Intent

    for start in range(0, n, chunk):
        ob.enqueue_many(
            [
                Intent(
                    endpoint="rx",
                    method="POST",
                    path="/orders",
                    json=payload(i),
                    operation_id=f"{prefix}{i}",
                )
                for i in range(start, min(n, start + chunk))
            ]
        )


async def drain(
    ob: Any,
    n: int,
    concurrency: int,
    *,
    on_tick: Callable[[], None] | None = None,
    max_seconds: float | None = None,
) -> tuple[float, Any]:
    """Run the dispatcher until N operations settled; (seconds, summary)."""
    from outbox import DispatcherSettings

    settings = DispatcherSettings(concurrency=concurrency)
    dispatcher = ob.dispatcher(settings)
    stop = asyncio.Event()

    async def watch() -> None:
        s = dispatcher.summary
        deadline = None if max_seconds is None else time.perf_counter() + max_seconds
        while s.succeeded + s.failed + s.unresolved < n:
            if on_tick is not None:
                on_tick()
            if deadline is not None and time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.005)
        stop.set()

    start = time.perf_counter()
    watcher = asyncio.create_task(watch())
    summary = await dispatcher.run(stop)
    seconds = time.perf_counter() - start
    await watcher
    return seconds, summary


def run_dispatch(db_url: str, rx_url: str, n: int, concurrency: int, transport: Any) -> float:
    """ops/s of the dispatcher draining N fresh operations."""
    ob = make_outbox(db_url, rx_url, concurrency, transport)
    try:
        prefix = f"disp-{uuid.uuid4().hex[:8]}-"
        load(ob, n, prefix)
        seconds, summary = asyncio.run(drain(ob, n, concurrency))
        if summary.succeeded != n:
            raise RuntimeError(f"dispatcher: {summary.as_dict()} (expected {n} succeeded)")
    finally:
        ob.close()
    return n / seconds


def run_end_to_end(
    db_url: str, rx_url: str, n: int, concurrency: int, transport: Any
) -> dict[str, float]:
    """Enqueue N operations, each in its own transaction, then dispatch them all."""
    ob = make_outbox(db_url, rx_url, concurrency, transport)
    try:
        prefix = f"e2e-{uuid.uuid4().hex[:8]}-"
        start = time.perf_counter()
        enqueue_each(ob, n, prefix)
        enqueue_s = time.perf_counter() - start
        dispatch_s, summary = asyncio.run(drain(ob, n, concurrency))
        if summary.succeeded != n:
            raise RuntimeError(f"end to end: {summary.as_dict()} (expected {n} succeeded)")
    finally:
        ob.close()
    total = enqueue_s + dispatch_s
    return {
        "ops_per_s": n / total,
        "enqueue_ops_per_s": n / enqueue_s,
        "dispatch_ops_per_s": n / dispatch_s,
    }


def run_end_to_end_live(
    db_url: str, rx_url: str, n: int, concurrency: int, transport: Any
) -> dict[str, float]:
    """DBOS's shape of the job: the dispatcher already runs in the application's process
    (its own thread and event loop, as DBOS's queue workers run beside its enqueues)
    while the application enqueues N operations, each in its own transaction. Timed from
    the first enqueue to the moment the dispatcher counts N settled."""
    ob = make_outbox(db_url, rx_url, concurrency, transport)
    running = threading.Event()
    done: dict[str, Any] = {}

    def dispatch() -> None:
        try:
            _, summary = asyncio.run(drain(ob, n, concurrency, on_tick=running.set))
            done["summary"] = summary
        except BaseException as exc:  # reported by the main thread
            done["error"] = exc
        finally:
            done["end"] = time.perf_counter()
            running.set()

    thread = threading.Thread(target=dispatch, name="bench-dispatcher", daemon=True)
    try:
        prefix = f"live-{uuid.uuid4().hex[:8]}-"
        thread.start()
        running.wait(30)
        time.sleep(0.3)  # past its preflight: idle, waiting for work
        start = time.perf_counter()
        enqueue_each(ob, n, prefix)
        enqueue_s = time.perf_counter() - start
        thread.join(300)
        if "error" in done:
            raise done["error"]
        summary = done.get("summary")
        if summary is None or summary.succeeded != n:
            got = summary.as_dict() if summary is not None else "did not finish"
            raise RuntimeError(f"end to end, live: {got} (expected {n} succeeded)")
    finally:
        ob.close()
    total = done["end"] - start
    return {"ops_per_s": n / total, "enqueue_ops_per_s": n / enqueue_s}


def run_end_to_end_process(
    db_url: str, rx_url: str, n: int, concurrency: int, transport_name: str
) -> dict[str, float]:
    """The deployment the README recommends: ``outbox dispatch`` runs as a process of its
    own (on the same client core: it inherits this process's CPU affinity) while the
    application enqueues N operations, each in its own transaction. Timed from the
    first enqueue until the application counts N succeeded (it looks every 10 ms, as
    DBOS's job polls its handles)."""
    from sqlalchemy import text

    from benchmarks import transports

    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p),
        OUTBOX_BENCH_DB=db_url,
        OUTBOX_BENCH_RX=rx_url,
        OUTBOX_BENCH_CONCURRENCY=str(concurrency),
        OUTBOX_BENCH_TRANSPORT=transport_name,
    )
    cmd = [sys.executable, "-m", "outbox", "--app", "benchmarks.app:build",
           "--log-level", "warning", "dispatch", "--concurrency", str(concurrency)]  # fmt: skip
    ob = make_outbox(db_url, rx_url, concurrency, transports.CANDIDATES[transport_name])
    prefix = f"proc-{uuid.uuid4().hex[:8]}-"
    count = text(
        "SELECT count(*) FROM outbox_operations WHERE state = 'succeeded' "
        "AND operation_id LIKE :prefix"
    )

    def succeeded(like: str) -> int:
        with ob.store.read() as conn:
            return int(conn.execute(count, {"prefix": like}).scalar_one())

    def wait_for(like: str, want: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while succeeded(like) < want:
            if proc.poll() is not None:
                raise RuntimeError(f"outbox dispatch exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"end to end, process: fewer than {want} succeeded")
            time.sleep(0.01)

    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        # Started, connected and idle: one operation through it before the clock starts.
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json=payload(0),
                   operation_id=f"{prefix}warm")  # fmt: skip
        wait_for(f"{prefix}warm", 1, 60)
        start = time.perf_counter()
        enqueue_each(ob, n, prefix)
        enqueue_s = time.perf_counter() - start
        wait_for(f"{prefix}%", n + 1, 300)
        total = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        ob.close()
    return {"ops_per_s": n / total, "enqueue_ops_per_s": n / enqueue_s}


def new_prefix(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}-"
