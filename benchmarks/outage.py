"""A receiver outage of twice the retry window, then back (issue 23, section 1).

Per run: the real receiver is stopped (its port closed), ``--n`` operations are
enqueued, and real ``outbox dispatch`` processes (``--processes``) start sending. After
``2 x --window-seconds`` the receiver comes back on the same port. The run ends when
every operation is settled, or after ``--max-seconds``.

    python -m benchmarks.outage                      # SQLite, one dispatcher
    python -m benchmarks.outage --db postgresql --processes 3

Prints one JSON line: the attempt rows written during the outage (those before the
circuit opened, and the half-open probes: ``outbox_endpoints.probes``), the receiver's
requests per operation once it was back, operations succeeded and unresolved, and the
drain time after the receiver came back. No operator action is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from benchmarks.common import database
from outbox import Endpoint, Intent, Outbox, RetryPolicy
from outbox.config import CircuitBreaker
from outbox.store.tables import attempts
from outbox.testing.receiver import Receiver

ROOT = Path(__file__).resolve().parent.parent


def build() -> Outbox:
    """The dispatchers' application (``outbox dispatch --app benchmarks.outage:build``),
    configured from ``OUTBOX_BENCH_DB``, ``OUTBOX_BENCH_RX`` and ``OUTBOX_BENCH_WINDOW``."""
    return Outbox(
        os.environ["OUTBOX_BENCH_DB"],
        endpoints=[
            _endpoint(os.environ["OUTBOX_BENCH_RX"], float(os.environ["OUTBOX_BENCH_WINDOW"]))
        ],
    )


def _endpoint(url: str, window: float) -> Endpoint:
    return Endpoint(
        name="rx",
        base_url=url,
        timeout=2.0,
        retry=RetryPolicy(max_attempts=8, window=timedelta(seconds=window)),
        key_retention=timedelta(hours=1),
        circuit_breaker=CircuitBreaker(probe_max_wait=timedelta(seconds=4)),
    )


def _attempt_rows(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one())


def one_run(db: str, n: int, processes: int, window: float, max_seconds: float) -> dict[str, Any]:
    kind = "sqlite" if db == "sqlite" else "postgres"
    with (
        tempfile.TemporaryDirectory() as tmp,
        Receiver(Path(tmp) / "rx.sqlite3") as receiver,
        database(kind, Path(tmp), "outage") as url,
    ):
        receiver.stop()  # down: its port is closed
        ob = Outbox(url, endpoints=[_endpoint(receiver.url, window)])
        env = dict(
            os.environ,
            OUTBOX_BENCH_DB=url,
            OUTBOX_BENCH_RX=receiver.url,
            OUTBOX_BENCH_WINDOW=str(window),
            PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))),
        )
        procs: list[subprocess.Popen[bytes]] = []
        try:
            ids = [f"op-{i}" for i in range(n)]
            for start in range(0, n, 500):
                ob.enqueue_many(
                    [
                        Intent("rx", "POST", "/orders", {"op": i}, None, i)
                        for i in ids[start : start + 500]
                    ]
                )
            cmd = [
                sys.executable,
                "-m",
                "outbox",
                "dispatch",
                "--app",
                "benchmarks.outage:build",
                "--concurrency",
                "32",
            ]
            procs = [
                subprocess.Popen(
                    cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                for _ in range(processes)
            ]
            time.sleep(2 * window)
            during = _attempt_rows(ob)
            probes = sum(e.probes for e in ob.store.endpoint_states() if e.name == "rx")
            pending_at_up = ob.reconcile.status(settled=False).counts
            receiver.start()  # up again, on the same port
            up = time.monotonic()
            counts: dict[str, int | None] = {}
            while time.monotonic() - up < max_seconds:
                counts = ob.reconcile.status().counts
                if not (counts["pending"] or counts["in_flight"]):
                    break
                time.sleep(0.2)
            drain = time.monotonic() - up
            total = _attempt_rows(ob)
            requests = len(receiver.requests())
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(timeout=60)
            ob.close()
    return {
        "db": db,
        "n": n,
        "processes": processes,
        "window_s": window,
        "outage_s": 2 * window,
        "attempt_rows_during_outage": during,
        "probes": probes,
        "before_the_circuit_opened": during - probes,
        "attempt_rows_after": total - during,
        "pending_when_up": pending_at_up["pending"],
        "succeeded": counts.get("succeeded"),
        "unresolved": counts.get("unresolved"),
        "requests_per_operation_after_up": round(requests / n, 3),
        "drain_after_up_s": round(drain, 2),
        "operator_actions": 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--window-seconds", type=float, default=10.0)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args()
    print(
        json.dumps(one_run(args.db, args.n, args.processes, args.window_seconds, args.max_seconds))
    )


if __name__ == "__main__":
    main()
