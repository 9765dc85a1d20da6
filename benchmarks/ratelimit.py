"""The fleet against a rate-limited receiver (issue 23, section 2).

Per case: a fresh outbox; ``--ops`` operations enqueued; a receiver in its own process
that admits ``--rate`` requests/s (a token bucket of one second's worth) and answers
the rest ``429`` + ``Retry-After: 1``; then one dispatcher (in this process,
``run_dispatcher``) or three ``outbox dispatch`` processes drain the backlog. Every
figure comes from the receiver's own log: requests per operation, the most requests
it saw in any one second (per 1-s bucket, and over any sliding second), the drain time
(first arrival to last applied request) against the ideal ``ops / rate``; and from the
outbox, the operations left unresolved.

    python -m benchmarks.ratelimit                      # the four SQLite/PG cases
    python -m benchmarks.ratelimit --case sqlite-1-none
    python -m benchmarks.ratelimit --throughput         # the no-limit A/B only

``--throughput``: with no limit declared and a receiver that never refuses, drain
``--ops`` operations with the limiter as built and with it switched off (``throttle=None``
is not enough: the A/B patches the attempt path to skip the limiter); the ratio is the
limiter's cost when unused (target: within 3 %).

Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

from benchmarks.common import database
from outbox import DispatcherSettings, Endpoint, Intent, Outbox, RetryPolicy
from outbox.testing.receiver import RemoteReceiver

CASES = {
    # name: (db, dispatchers, declared rate_limit?)
    "sqlite-1-none": ("sqlite", 1, False),
    # A load balancer that rate limits with 503 + Retry-After instead of 429: the
    # throttle paces it and the circuit breaker must not open on its refusals.
    "sqlite-1-none-503": ("sqlite", 1, False),
    # GitHub's primary limit: 403 with X-RateLimit-Remaining: 0 and an epoch reset, no
    # Retry-After. A permanent 403 to the outbox before: every refused operation failed.
    "sqlite-1-none-403": ("sqlite", 1, False),
    "sqlite-1-declared": ("sqlite", 1, True),
    "postgresql-3-none": ("postgresql", 3, False),
    "postgresql-3-declared": ("postgresql", 3, True),
}


def build() -> Outbox:
    """The application of the dispatcher processes (``--app benchmarks.ratelimit:build``),
    configured from the environment."""
    rate = os.environ.get("OUTBOX_BENCH_RATE_LIMIT")
    return _outbox(
        os.environ["OUTBOX_BENCH_DB"],
        os.environ["OUTBOX_BENCH_RX"],
        float(rate) if rate else None,
        int(os.environ.get("OUTBOX_BENCH_CONCURRENCY", "32")),
    )


def _outbox(url: str, rx_url: str, rate_limit: float | None, concurrency: int) -> Outbox:
    endpoint = Endpoint(
        name="rx",
        base_url=rx_url,
        timeout=5.0,
        retry=RetryPolicy(max_attempts=8, window=timedelta(seconds=30)),
        key_retention=timedelta(hours=1),
        rate_limit=rate_limit,
    )
    return Outbox(
        url,
        endpoints=[endpoint],
        dispatcher=DispatcherSettings(concurrency=concurrency, idle_poll_seconds=0.05),
    )


def _enqueue(ob: Outbox, ops: int) -> None:
    for start in range(0, ops, 500):
        ob.enqueue_many(
            [Intent("rx", "POST", "/orders", {"n": i}, None, f"op-{i}", "")
             for i in range(start, min(ops, start + 500))]
        )  # fmt: skip


def _wait_applied(rx: RemoteReceiver, ops: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while rx.effect_count() < ops and time.monotonic() < deadline:
        time.sleep(0.2)


def per_second(arrivals: list[int]) -> tuple[int, int, float]:
    """The most arrivals in one 1-s bucket, in any sliding second, and when that
    sliding second started (seconds after the first arrival)."""
    if not arrivals:
        return 0, 0, 0.0
    buckets = Counter(t // 1000 for t in arrivals)
    ordered = sorted(arrivals)
    most, j, at = 0, 0, 0
    for i, t in enumerate(ordered):
        while ordered[j] <= t - 1000:
            j += 1
        if i - j + 1 > most:
            most, at = i - j + 1, ordered[j]
    return max(buckets.values()), most, (at - ordered[0]) / 1000


def _dispatchers(url: str, rx_url: str, rate_limit: float | None, n: int,
                 concurrency: int) -> list[subprocess.Popen[bytes]]:  # fmt: skip
    env = {
        **os.environ,
        "OUTBOX_BENCH_DB": url,
        "OUTBOX_BENCH_RX": rx_url,
        "OUTBOX_BENCH_RATE_LIMIT": "" if rate_limit is None else repr(rate_limit),
        "OUTBOX_BENCH_CONCURRENCY": str(concurrency),
    }
    argv = [sys.executable, "-m", "outbox", "--app", "benchmarks.ratelimit:build",
            "--log-level", "error", "dispatch"]  # fmt: skip
    return [
        subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(n)
    ]


def _refusal(case: str) -> dict[str, Any]:
    """How the case's receiver refuses: 429 + Retry-After: 1 unless the name says."""
    if case.endswith("-403"):
        return {"status": 403, "retry_after": None, "headers": "github"}
    return {"status": 503 if case.endswith("-503") else 429, "retry_after": "1"}


def run_case(name: str, ops: int, rate: float, concurrency: int) -> dict[str, Any]:
    db, dispatchers, declared = CASES[name]
    rate_limit = rate if declared else None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with RemoteReceiver.spawn(work / "rx.sqlite3", synchronous="OFF") as rx:
            rx.faults.rate_limit(rate, **_refusal(name))
            with database("sqlite" if db == "sqlite" else "postgres", work, "rl") as url:
                ob = _outbox(url, rx.url, rate_limit, concurrency)
                try:
                    _enqueue(ob, ops)
                    started = time.monotonic()
                    if dispatchers == 1:
                        stop = threading.Event()
                        worker = threading.Thread(
                            target=ob.run_dispatcher, kwargs={"stop": stop}, daemon=True
                        )
                        worker.start()
                        _wait_applied(rx, ops, timeout=ops / rate * 5 + 30)
                        stop.set()
                        worker.join(timeout=60)
                    else:
                        procs = _dispatchers(url, rx.url, rate_limit, dispatchers, concurrency)
                        try:
                            _wait_applied(rx, ops, timeout=ops / rate * 5 + 30)
                        finally:
                            for p in procs:
                                p.terminate()
                            for p in procs:
                                p.wait(timeout=60)
                    wall = time.monotonic() - started
                    unresolved = len(ob.reconcile.unresolved(limit=ops))
                    # Did the circuit ever open? A row that never changed has no reason;
                    # opening and closing both write one.
                    figures = ob.reconcile.status().figures
                    opened = [e.name for e in figures.endpoint_states if e.reason is not None]
                    failed = figures.counts.get("failed") or 0
                finally:
                    ob.close()
            requests = rx.requests()
    arrivals = [r.arrived_at_ms for r in requests]
    applied = [r.arrived_at_ms for r in requests if r.outcome == "applied"]
    drain = (max(applied) - min(arrivals)) / 1000 if applied else float("inf")
    ideal = ops / rate
    bucket, sliding, sliding_at = per_second(arrivals)
    return {
        "case": name, "db": db, "dispatchers": dispatchers, "declared_rate_limit": rate_limit,
        "ops": ops, "receiver_rate": rate, "requests": len(requests),
        "requests_per_op": round(len(requests) / ops, 3),
        "refused": sum(1 for r in requests if r.outcome == "rate_limited"),
        "circuit_opened": bool(opened),
        "applied": len(applied), "unresolved": unresolved, "failed": failed,
        "drain_s": round(drain, 2), "ideal_s": round(ideal, 2),
        "drain_vs_ideal": round(drain / ideal, 3), "wall_s": round(wall, 2),
        "max_per_1s_bucket": bucket, "max_per_sliding_1s": sliding,
        "max_vs_rate": round(sliding / rate, 3), "max_sliding_at_s": sliding_at,
    }  # fmt: skip


def throughput(ops: int, concurrency: int, runs: int) -> dict[str, Any]:
    """No limit, no refusals: the limiter as built against the limiter skipped."""
    from outbox.dispatch import limits

    def once(skip: bool) -> float:
        original = limits.Limits.limited
        if skip:
            limits.Limits.limited = lambda self, name: False  # type: ignore[method-assign]
        try:
            with tempfile.TemporaryDirectory() as tmp:
                work = Path(tmp)
                with (
                    RemoteReceiver.spawn(work / "rx.sqlite3", synchronous="OFF") as rx,
                    database("sqlite", work, "rl") as url,
                ):
                    ob = _outbox(url, rx.url, None, concurrency)
                    try:
                        _enqueue(ob, ops)
                        started = time.monotonic()
                        ob.run_dispatcher(until_empty=True)
                        return ops / (time.monotonic() - started)
                    finally:
                        ob.close()
        finally:
            limits.Limits.limited = original  # type: ignore[method-assign]

    with_limiter, without = [], []
    for _ in range(runs):  # interleaved: the machine's load hits both alike
        without.append(once(True))
        with_limiter.append(once(False))
    a, b = sorted(with_limiter)[runs // 2], sorted(without)[runs // 2]
    return {
        "case": "throughput-no-limit", "ops": ops, "runs": runs,
        "ops_per_s_with_limiter": round(a, 1), "ops_per_s_skipped": round(b, 1),
        "ratio": round(a / b, 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES))
    parser.add_argument("--ops", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--throughput", action="store_true", help="only the no-limit A/B")
    parser.add_argument("--throughput-ops", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5, help="runs of the A/B (medians)")
    args = parser.parse_args()
    if not args.throughput:
        for name in args.case or list(CASES):
            print(json.dumps(run_case(name, args.ops, args.rate, args.concurrency)), flush=True)
    if args.throughput or not args.case:
        print(json.dumps(throughput(args.throughput_ops, args.concurrency, args.runs)))


if __name__ == "__main__":
    main()
