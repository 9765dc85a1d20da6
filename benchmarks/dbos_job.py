"""DBOS Transact on the same job, run in its own process (DBOS is a process-wide singleton).

The job: N operations, each started durably (one transaction each, as the outbox's
end-to-end run enqueues each in its own transaction), then executed through a DBOS queue
with the same concurrency: one workflow per operation with one step that POSTs to the
receiver under ``Idempotency-Key = workflow ID``. Prints one JSON line.

``python -m benchmarks.dbos_job --db URL --url RECEIVER --n N --concurrency C``
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True, help="DBOS system database URL")
    parser.add_argument("--url", required=True, help="receiver base URL")
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--schema", default=None, help="DBOS system schema (PostgreSQL)")
    args = parser.parse_args(argv)

    import httpx
    from dbos import DBOS, DBOSConfig

    logging.getLogger("dbos").setLevel(logging.WARNING)
    http = httpx.Client(
        base_url=args.url,
        timeout=10.0,
        limits=httpx.Limits(
            max_connections=args.concurrency, max_keepalive_connections=args.concurrency
        ),
    )
    config: DBOSConfig = {
        "name": "outbox-bench",
        "system_database_url": args.db,
        "log_level": "WARNING",
        "sys_db_pool_size": max(20, args.concurrency + 8),
    }
    if args.schema:
        config["dbos_system_schema"] = args.schema
    DBOS(config=config)

    @DBOS.step()
    def post(key: str, body: dict[str, Any]) -> int:
        response = http.post(
            "/orders",
            json=body,
            headers={"Idempotency-Key": key, "X-Request-ID": str(uuid.uuid4())},
        )
        response.raise_for_status()
        return response.status_code

    @DBOS.workflow()
    def operation(key: str, body: dict[str, Any]) -> int:
        return post(key, body)

    DBOS.launch()
    # The queue's configuration lives in the system database: register it after launch.
    queue = DBOS.register_queue(
        "outbox_bench", worker_concurrency=args.concurrency, polling_interval_sec=0.05
    )
    prefix = f"dbos-{uuid.uuid4().hex[:8]}-"
    try:
        start = time.perf_counter()
        handles = []
        for i in range(args.n):
            body = {"sku": f"SKU-{i % 997:04d}", "quantity": 1 + i % 5, "note": "benchmark"}
            from dbos import SetWorkflowID

            with SetWorkflowID(f"{prefix}{i}"):
                handles.append(queue.enqueue(operation, f"{prefix}{i}", body))
        enqueued = time.perf_counter()
        done = 0
        deadline = start + args.max_seconds
        for h in handles:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                break
            h.get_result(polling_interval_sec=0.01)
            done += 1
        end = time.perf_counter()
    finally:
        DBOS.destroy(destroy_registry=True)
        http.close()
    print(
        json.dumps(
            {
                "n": args.n,
                "completed": done,
                "enqueue_seconds": enqueued - start,
                "total_seconds": end - start,
                "ops_per_s": done / (end - start),
                "enqueue_ops_per_s": args.n / (enqueued - start),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
