"""Enqueue -> receiver latency of an idle dispatcher behind a real pgbouncer in
transaction pooling: with ``listen_url`` (LISTEN on a direct connection), without it
(the start-up probe finds LISTEN dead: the poll), and connected directly for reference.

    python -m benchmarks.pgbouncer_wakeup [--n 30] [--poll 5.0]

Starts its own pgbouncer (tests/production/conftest.py) in front of
OUTBOX_TEST_POSTGRES_URL, in a throwaway schema and role. Prints medians and p90s.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from outbox import DispatcherSettings, Endpoint, Outbox
from outbox.store.migrate import upgrade
from outbox.testing.receiver import Receiver
from tests.conftest import POSTGRES_URL
from tests.production.conftest import _start


def _measure(url: str, rx: Receiver, n: int, poll: float, listen_url: str | None) -> list[float]:
    ob = Outbox(
        url,
        endpoints=[Endpoint(name="a", base_url=rx.url)],
        dispatcher=DispatcherSettings(idle_poll_seconds=poll, listen_url=listen_url),
    )
    dispatcher = ob.dispatcher()
    ready = asyncio.Event()
    dispatcher.wakeup.hooks.append(
        lambda e: ready.set() if e in ("listening", "listen_unavailable") else None
    )

    async def main() -> list[float]:
        stop = asyncio.Event()
        task = asyncio.create_task(dispatcher.run(stop))
        await asyncio.wait_for(ready.wait(), 10)
        times = []
        for i in range(n):
            key = f"b-{uuid.uuid4().hex[:8]}-{i}"
            start = time.perf_counter()
            await asyncio.to_thread(
                ob.enqueue, endpoint="a", method="POST", path="/o", json={}, operation_id=key
            )
            while not rx.requests(key=key):
                await asyncio.sleep(0.0005)
            times.append(time.perf_counter() - start)
            await asyncio.sleep(0.05)  # idle again before the next one
        stop.set()
        await task
        return times

    try:
        return asyncio.run(main())
    finally:
        ob.close()


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--poll", type=float, default=5.0)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="outbox-bench-pgb-"))
    root.chmod(0o755)  # pgbouncer may run as postgres
    bouncer = _start(root / "b")
    schema = f"pgb_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{schema}" LOGIN'))
        conn.execute(text(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{schema}"'))
        conn.execute(text(f'ALTER ROLE "{schema}" SET search_path = "{schema}"'))
    try:
        bouncer.add(f"{schema}_tx", schema, "transaction")
        pooled = bouncer.url(f"{schema}_tx", schema)
        direct = make_url(POSTGRES_URL).set(username=schema).render_as_string(False)
        engine = create_engine(direct)
        upgrade(engine)
        engine.dispose()
        with Receiver(root / "rx.sqlite3") as rx:
            cases = [
                ("direct", direct, None, args.n),
                ("pgbouncer+listen_url", pooled, direct, args.n),
                ("pgbouncer, no listen_url (poll)", pooled, None, max(3, args.n // 10)),
            ]
            for name, url, listen, n in cases:
                t = _measure(url, rx, n, args.poll, listen)
                print(f"{name:34s} n={n:3d} p50={_pct(t, 0.5):8.1f} ms p90={_pct(t, 0.9):8.1f} ms")
    finally:
        bouncer.process.terminate()
        bouncer.process.wait(10)
        with admin.begin() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename=:u"),
                {"u": schema},
            )
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
            conn.execute(text(f'DROP ROLE "{schema}"'))
        admin.dispose()


if __name__ == "__main__":
    main()
