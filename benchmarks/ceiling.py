"""The database-side ceiling: how many claim -> attempt -> outcome cycles one PostgreSQL
server carries, with no HTTP at all, for K = 1, 2, 4, 8 dispatcher processes.

Each process runs the store calls a dispatcher makes for every operation, in the same
transactions: ``Store.record_and_claim`` (the previous batch's fenced outcomes,
"succeeded", then the next batch and its write-ahead attempt rows, one transaction; the
first claim is ``Store.claim_and_begin`` alone). Batches are of 64, what a dispatcher at
concurrency 64 claims. The figure is the rate at which
the database side alone could settle operations; a dispatcher fleet cannot go faster
than this, whatever the receiver.

``python -m benchmarks.ceiling --db URL [--batch 64] [--start-at EPOCH]`` is one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

BATCH = 64


def cycle_until_empty(db_url: str, batch: int) -> dict[str, Any]:
    from outbox.clock import SystemClock
    from outbox.model import Delivery, State, Verdict
    from outbox.store import store_for
    from outbox.store.engine import create_engine
    from outbox.store.records import AttemptOutcome, ClaimPlan

    engine = create_engine(db_url)
    store = store_for(engine)
    clock = SystemClock()
    owner = f"ceiling-{os.getpid()}"
    done = 0
    transactions = 0
    outcomes: list[Any] = []
    try:
        while True:
            token = str(uuid.uuid4())
            now = clock.now_ms()
            claim = {
                "owner": owner, "token": token, "now_ms": now, "lease_ms": 30_000,
                "limit": batch,
                "plan": lambda claimed: ClaimPlan(send={c.pk: str(uuid.uuid4()) for c in claimed}),
            }  # fmt: skip
            # As a busy dispatcher does: the previous batch's outcomes and the next claim
            # in one transaction (the first claim alone).
            if outcomes:
                written, result = store.record_and_claim(outcomes=outcomes, **claim)
                done += len(written)
            else:
                result = store.claim_and_begin(**claim)
            transactions += 1
            outcomes = [
                AttemptOutcome(
                    pk=s.pk, lease_token=token, request_id=s.request_id,
                    delivery=Delivery.SENT, verdict=Verdict.SUCCESS, counted=True,
                    status_code=201, receiver_request_id=None, error_class=None,
                    error_message=None, duration_ms=1, state=State.SUCCEEDED, reason=None,
                    next_attempt_at=None, maybe_delivered=True, saw_refusal=False,
                )
                for s in result.started
            ]  # fmt: skip
            if not result.claimed:
                break
    finally:
        engine.dispose()
    return {"done": done, "transactions": transactions}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--start-at", type=float, default=0.0)
    args = parser.parse_args(argv)
    # Import and connect before the start line, like a running dispatcher.
    from outbox.store.engine import create_engine

    warm = create_engine(args.db)
    with warm.connect():
        pass
    warm.dispose()
    delay = args.start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    cpu0 = time.process_time()
    start = time.time()
    out = cycle_until_empty(args.db, args.batch)
    out.update(start=start, end=time.time(), cpu_seconds=time.process_time() - cpu0)
    print(json.dumps(out), flush=True)
    return 0


def ceiling_phase(
    make_db: Callable[[], AbstractContextManager[str]],
    *,
    n: int,
    processes: Sequence[int] = (1, 2, 4, 8),
    batch: int = BATCH,
) -> list[dict[str, Any]]:
    """Drain n operations with K processes for each K; cycles per second and CPU."""
    from benchmarks.processes import ROOT, PostgresCpu, _env, load_backlog

    results = []
    for k in processes:
        with make_db() as url:
            load_backlog(url, n)
            start_at = time.time() + 1.5 + 0.1 * k
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.ceiling", "--db", url,
                     "--batch", str(batch), "--start-at", str(start_at)],
                    stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                )
                for _ in range(k)
            ]
            pg = PostgresCpu()
            try:
                while any(p.poll() is None for p in procs):
                    pg.sample()
                    time.sleep(0.1)
                outs = []
                for p in procs:
                    stdout, _ = p.communicate(timeout=120)
                    if p.returncode != 0:
                        raise RuntimeError(f"ceiling process failed ({p.returncode})")
                    outs.append(json.loads(stdout.strip().splitlines()[-1]))
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.communicate()
        done = sum(o["done"] for o in outs)
        if done != n:
            raise RuntimeError(f"ceiling K={k}: {done} of {n} cycles completed")
        wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        results.append(
            {
                "processes": k,
                "ops": done,
                "seconds": round(wall, 3),
                "ops_per_s": round(done / wall, 1),
                "per_process_ops": [o["done"] for o in outs],
                "client_cpu_ms_per_op": round(1000 * sum(o["cpu_seconds"] for o in outs) / done,
                                              3),
                "postgres_cpu_ms_per_op": round(1000 * pg.seconds / done, 3),
            }
        )
    return results


if __name__ == "__main__":
    sys.exit(main())
