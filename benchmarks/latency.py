"""Latency: from an enqueue's commit to the first request at the receiver, dispatcher idle.

One operation at a time, each enqueued at a random moment (a uniform random gap after
the previous one settled, so arrivals fall anywhere in a poll's phase). The time is
taken when ``enqueue`` returns (its transaction committed) and compared with the
receiver's own arrival stamp for that key (``requests.arrived_at_ms``, wall clock,
millisecond resolution: +0.5 ms is added to centre it).

Configurations (``CONFIGS``): PostgreSQL with LISTEN/NOTIFY, SQLite with the dispatcher
in the enqueuing process (in-process signal), SQLite with the dispatcher in a separate
process (``PRAGMA data_version`` check), and the poll-only configuration beside them
(``wake_on_change=False``, a 0.25 s poll: the previous default).

Idle load: after the latency runs the dispatcher is left idle and the SQL statements
its engine sends are counted (claims, and the due-time look-up after an empty claim).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import client_cores, endpoint, payload, pin

#: The poll of the poll-only configuration: the default before wake-ups.
POLL_ONLY_SECONDS = 0.25


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    db: str  # "sqlite" | "postgres"
    wake: bool
    separate_process: bool = False


CONFIGS = (
    Config("latency_postgres", "PostgreSQL, LISTEN/NOTIFY", "postgres", True),
    Config("latency_postgres_poll", "PostgreSQL, poll only (0.25 s)", "postgres", False),
    Config("latency_sqlite", "SQLite, dispatcher in the enqueuing process", "sqlite", True),
    Config(
        "latency_sqlite_process",
        "SQLite, dispatcher in a separate process (data_version)",
        "sqlite",
        True,
        separate_process=True,
    ),
    Config("latency_sqlite_poll", "SQLite, poll only (0.25 s)", "sqlite", False),
)


def settings(wake: bool) -> Any:
    from outbox import DispatcherSettings

    if wake:
        return DispatcherSettings(concurrency=8)
    return DispatcherSettings(
        concurrency=8, wake_on_change=False, idle_poll_seconds=POLL_ONLY_SECONDS
    )


class _InProcess:
    """The dispatcher on its own event loop in a thread of this process."""

    def __init__(self, ob: Any, wake: bool) -> None:
        self.dispatcher = ob.dispatcher(settings(wake))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the dispatcher did not start")

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await self.dispatcher.run(self._stop)

        try:
            asyncio.run(run())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        if self._error is not None:
            raise self._error


def _spawn(db_url: str, rx_url: str, wake: bool) -> subprocess.Popen[str]:
    from benchmarks.processes import ROOT, _env

    cmd = [sys.executable, "-m", "benchmarks.latency", "--db", db_url, "--url", rx_url]
    if not wake:
        cmd.append("--poll-only")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT, bufsize=1
    )
    pin(proc.pid, client_cores())
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "ready" once the dispatcher runs
    if line.strip() != "ready":
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"latency dispatcher did not start: {line!r}")
    return proc


def _arrivals(rx_db: Path, prefix: str) -> dict[str, int]:
    with contextlib.closing(sqlite3.connect(rx_db, timeout=30)) as conn:
        rows = conn.execute(
            "SELECT idempotency_key, min(arrived_at_ms) FROM requests "
            "WHERE idempotency_key LIKE ? GROUP BY idempotency_key",
            (prefix + "%",),
        ).fetchall()
    return {str(k): int(t) for k, t in rows}


def _wait_settled(ob: Any, op_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = ob.store.get_state("", op_id)
        if state is not None and state.is_settled:
            return
        time.sleep(0.002)
    raise RuntimeError(f"{op_id} not settled within {timeout}s")


@contextlib.contextmanager
def _statement_counter(engine: Any) -> Iterator[list[int]]:
    from sqlalchemy import event

    count = [0]

    def before(*_: Any) -> None:
        count[0] += 1

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield count
    finally:
        event.remove(engine, "before_cursor_execute", before)


def run_config(
    config: Config,
    db_url: str,
    rx: Any,
    *,
    n: int,
    max_gap: float,
    idle_seconds: float,
    seed: int = 17,
) -> dict[str, Any]:
    """Latencies (ms) of ``n`` lone enqueues, and the idle dispatcher's query rate."""
    from benchmarks.dispatch import make_outbox

    rng = random.Random(seed)
    ob = make_outbox(db_url, rx.url, 8)
    prefix = f"lat-{uuid.uuid4().hex[:8]}-"
    proc = None
    local = None
    try:
        if config.separate_process:
            proc = _spawn(db_url, rx.url, config.wake)
        else:
            local = _InProcess(ob, config.wake)
        # Warm up: connections, the listener, the receiver's pool.
        for i in range(2):
            ob.enqueue(endpoint="rx", method="POST", path="/orders", json=payload(i),
                       operation_id=f"{prefix}warm-{i}")
            _wait_settled(ob, f"{prefix}warm-{i}", 30)
        enqueued: dict[str, float] = {}
        for i in range(n):
            time.sleep(rng.uniform(0.0, max_gap))
            op_id = f"{prefix}{i}"
            ob.enqueue(endpoint="rx", method="POST", path="/orders", json=payload(i),
                       operation_id=op_id)
            enqueued[op_id] = time.time() * 1000
            _wait_settled(ob, op_id, 30)
        idle: dict[str, Any] = {}
        if local is not None and idle_seconds > 0:
            stats = local.dispatcher.wakeup.stats
            claims0 = stats.claims
            with _statement_counter(ob.engine) as count:
                time.sleep(idle_seconds)
            idle = {
                "idle_seconds": idle_seconds,
                "idle_claims_per_s": round((stats.claims - claims0) / idle_seconds, 3),
                "idle_statements_per_s": round(count[0] / idle_seconds, 3),
            }
    finally:
        if local is not None:
            local.close()
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        ob.close()
    arrived = _arrivals(rx.db_path, prefix)
    missing = [k for k in enqueued if k not in arrived]
    if missing:
        raise RuntimeError(f"no request at the receiver for {missing[:3]}")
    lat = sorted(max(0.0, arrived[k] + 0.5 - t) for k, t in enqueued.items())
    return {
        "config": config.label,
        "n": n,
        "p50_ms": round(statistics.median(lat), 2),
        "p99_ms": round(_quantile(lat, 0.99), 2),
        "max_ms": round(lat[-1], 2),
        "values_ms": [round(v, 2) for v in lat],
        **idle,
    }


def _quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile (with few samples, p99 is the maximum)."""
    if not sorted_values:
        return float("nan")
    rank = max(1, int(-(-q * len(sorted_values) // 1)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


# --------------------------------------------------------------------------- the process


def main(argv: list[str] | None = None) -> int:
    """A dispatcher process for the separate-process case: runs until SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--poll-only", action="store_true")
    args = parser.parse_args(argv)

    from benchmarks.common import quiet_logs
    from outbox import Outbox

    quiet_logs()
    ob = Outbox(args.db, endpoints=[endpoint(args.url, concurrency=8, name="rx")])
    dispatcher = ob.dispatcher(settings(not args.poll_only))

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        task = asyncio.create_task(dispatcher.run(stop))
        await asyncio.sleep(0)
        print("ready", flush=True)
        await task

    asyncio.run(run())
    ob.close()
    print(json.dumps({"stats": dispatcher.wakeup.stats.__dict__}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
