"""A dispatcher process for the benchmarks: drains an outbox database and reports JSON.

``python -m benchmarks.worker --db URL --url RECEIVER [--concurrency 64] [--transport NAME]
[--max-seconds S] [--start-at EPOCH]``

It runs until no operation is pending or in flight (checked every 100 ms through the
partial due index) or ``--max-seconds`` pass, sampling its own RSS every 100 ms. Peak
RSS is the kernel's high-water mark for this process (VmHWM), start-up included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import threading
import time
from typing import Any


def _peak_rss_mb() -> float:
    """This process's RSS high-water mark (VmHWM). Not ``ru_maxrss``: on Linux that
    survives fork+exec, so a child reports its parent's RSS at the fork if larger."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / (1024 * 1024)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--transport", default=None)
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--start-at", type=float, default=0.0)
    args = parser.parse_args(argv)

    from sqlalchemy import text

    from benchmarks import transports
    from benchmarks.common import quiet_logs
    from benchmarks.dispatch import make_outbox
    from outbox import DispatcherSettings

    quiet_logs()
    factory = transports.CANDIDATES[args.transport] if args.transport else None
    ob = make_outbox(args.db, args.url, args.concurrency, factory)
    rss_start = _rss_mb()
    samples: list[tuple[float, float, int]] = []
    left_sql = text(
        "SELECT count(*) FROM outbox_operations WHERE state IN ('pending', 'in_flight')"
    )

    def left() -> int:
        # A read transaction (plain BEGIN on SQLite, not the write lock): never in the
        # dispatcher's way. If the database does not answer, keep going until the deadline.
        try:
            with ob.store.read() as conn:
                return int(conn.execute(left_sql).scalar_one())
        except Exception:
            return -1

    async def run() -> dict[str, Any]:
        dispatcher = ob.dispatcher(DispatcherSettings(concurrency=args.concurrency))
        stop = asyncio.Event()
        done = threading.Event()

        def sample_rss() -> None:
            # Its own thread, every 100 ms: the high-water mark says when, this says what.
            while not done.wait(0.1):
                samples.append(
                    (
                        round(time.time() - start, 2),
                        round(_rss_mb(), 1),
                        dispatcher.summary.succeeded,
                    )
                )

        async def watch() -> None:
            deadline = time.monotonic() + args.max_seconds
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                if await asyncio.to_thread(left) == 0:
                    break
            stop.set()

        start = time.time()
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        watcher = asyncio.create_task(watch())
        summary = await dispatcher.run(stop)
        end = time.time()
        await watcher
        done.set()
        sampler.join()
        return {"start": start, "end": end, "summary": summary.as_dict()}

    delay = args.start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    cpu0 = time.process_time()
    result = asyncio.run(run())
    cpu = time.process_time() - cpu0
    ob.close()
    result.update(
        pid=os.getpid(),
        threads=threading.active_count(),
        cpu_seconds=cpu,
        rss_start_mb=round(rss_start, 1),
        rss_samples=samples,
        rss_sampled_peak_mb=max((s[1] for s in samples), default=round(_rss_mb(), 1)),
        peak_rss_mb=round(_peak_rss_mb(), 1),
    )
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
