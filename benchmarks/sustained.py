"""A sustained run on PostgreSQL with ``purge`` on a schedule (issue 27, section 4).

    python -m benchmarks.sustained [--size 300000] [--interval 60000] [--retain 20]
    python -m benchmarks.sustained --purge-history 1000000     # claims during a big purge

Sustained mode: operations go through the dispatcher in intervals of ``--interval``
(250k in the full size): each interval enqueues its operations (``enqueue_many``, not
timed), then one dispatcher drains them (timed). All along, a thread runs the library's
purge (``Reconciler.purge``, the code behind ``outbox purge``) every ``--purge-every``
seconds on operations finished more than ``--retain`` seconds ago, as a cron job would.
After each interval it prints one row: throughput, the claim's latency (p50/p99/max,
every ``claim_and_begin`` the dispatcher ran, timed around the store call), the size of
each table and of its indexes (``pg_total_relation_size``, ``pg_indexes_size``), its
live and dead tuples (``pg_stat_user_tables``) and what purge deleted. ``--vacuum``
runs ``VACUUM (ANALYZE)`` after each purge, for a server whose autovacuum is off (as
the shared development server's is) or too slow to keep up. Targets: last
interval's throughput within 10% of the first; sizes and dead tuples bounded.

Purge-history mode: ``--purge-history`` settled operations (with their attempt rows,
bulk-loaded as :mod:`benchmarks.status_history` does) are purged while a dispatcher
drains a backlog; the claim latencies during the purge are reported (target: no claim
blocked more than 100 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import create_engine, text

from benchmarks.common import endpoint, postgres_schema, receiver, workdir
from benchmarks.dispatch import drain, load

TABLES = ("outbox_operations", "outbox_attempts")


class ClaimTimer:
    """Times every claim one outbox's dispatcher makes: ``ms`` the claim statement
    (``_claim_on``: the selection, its row locks and the update), ``txn_ms`` the whole
    write transaction it runs in (``claim_and_begin`` on its own, or
    ``record_and_claim``: the previous outcomes, the claim and the attempt rows)."""

    def __init__(self, store: Any) -> None:
        self.ms: list[float] = []
        self.txn_ms: list[float] = []
        store._claim_on = self._wrap(store._claim_on, self.ms)
        store.claim_and_begin = self._wrap(store.claim_and_begin, self.txn_ms)
        store.record_and_claim = self._wrap(store.record_and_claim, self.txn_ms)

    @staticmethod
    def _wrap(inner: Any, into: list[float]) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                into.append((time.perf_counter() - started) * 1000)

        return timed

    def take(self) -> tuple[list[float], list[float]]:
        out = (list(self.ms), list(self.txn_ms))
        self.ms.clear()  # in place: the wrappers hold these lists
        self.txn_ms.clear()
        return out


def quantiles(ms: list[float]) -> dict[str, float | None]:
    if not ms:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    s = sorted(ms)
    return {
        "p50": round(statistics.median(s), 2),
        "p99": round(s[min(len(s) - 1, int(len(s) * 0.99))], 2),
        "max": round(s[-1], 2),
        "n": len(s),
    }


def sizes(url: str) -> dict[str, Any]:
    engine = create_engine(url)
    out: dict[str, Any] = {}
    with engine.connect() as conn:
        for t in TABLES:
            row = conn.execute(
                text(
                    "SELECT pg_total_relation_size(c.oid), pg_indexes_size(c.oid), "
                    "s.n_live_tup, s.n_dead_tup, s.autovacuum_count "
                    "FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid "
                    "WHERE c.oid = to_regclass(:t)"
                ),
                {"t": t},
            ).one()
            out[t] = {
                "total_mb": round(row[0] / 2**20, 1),
                "index_mb": round(row[1] / 2**20, 1),
                "live": row[2],
                "dead": row[3],
                "autovacuums": row[4],
            }
    engine.dispose()
    return out


def vacuum(url: str) -> None:
    """``VACUUM (ANALYZE)`` both tables: what autovacuum does where it is on."""
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text("VACUUM (ANALYZE) outbox_operations, outbox_attempts"))
    engine.dispose()


class Purger(threading.Thread):
    """``Reconciler.purge`` every ``every`` seconds, for rows older than ``retain``."""

    def __init__(self, url: str, every: float, retain: float, vacuum: bool = False) -> None:
        super().__init__(daemon=True)
        from outbox import Outbox

        self.url, self.vacuum = url, vacuum
        self.ob = Outbox(url, endpoints=[endpoint("http://127.0.0.1:9", concurrency=1)])
        self.every, self.retain = every, retain
        self.stop = threading.Event()
        self.deleted = 0
        self.seconds: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        rec = self.ob.reconcile
        try:
            while not self.stop.wait(self.every):
                started = time.perf_counter()
                removed = rec.purge(older_than=timedelta(seconds=self.retain), operator="bench")
                self.seconds.append(time.perf_counter() - started)
                self.deleted += sum(removed.values())
                if self.vacuum:
                    vacuum(self.url)
        except BaseException as exc:  # reported by close(), not lost with the thread
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.join()
        self.ob.close()
        if self.error is not None:
            raise RuntimeError(f"purge failed: {self.error!r}") from self.error


def sustained(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    from outbox import Outbox

    work = workdir()
    rows: list[dict[str, Any]] = []
    with receiver(work) as rx, postgres_schema("bench_sust") as url:
        ob = Outbox(url, endpoints=[endpoint(rx.url, concurrency=args.concurrency)])
        timer = ClaimTimer(ob.store)
        purger = Purger(url, args.purge_every, args.retain, args.vacuum)
        purger.start()
        try:
            done = 0
            while done < args.size:
                n = min(args.interval, args.size - done)
                load(ob, n, f"s{done}-")
                timer.take()
                deleted_before = purger.deleted
                seconds, summary = asyncio.run(drain(ob, n, args.concurrency))
                if summary.succeeded != n:
                    raise RuntimeError(f"interval: {summary.as_dict()} (expected {n})")
                done += n
                claim_ms, txn_ms = timer.take()
                row = {
                    "ops": done, "ops_per_s": round(n / seconds, 1),
                    "claim_ms": quantiles(claim_ms), "claim_txn_ms": quantiles(txn_ms),
                    "purged": purger.deleted - deleted_before, "tables": sizes(url),
                }  # fmt: skip
                rows.append(row)
                say(line(row))
        finally:
            purger.close()
            ob.close()
    first, last = rows[0]["ops_per_s"], rows[-1]["ops_per_s"]
    return {
        "mode": "sustained", "size": args.size, "interval": args.interval,
        "concurrency": args.concurrency, "purge_every_s": args.purge_every,
        "retain_s": args.retain, "vacuum": args.vacuum, "intervals": rows,
        "last_vs_first": round(last / first, 3),
        "purge_seconds": quantiles([s * 1000 for s in purger.seconds]),
    }  # fmt: skip


def line(row: dict[str, Any]) -> str:
    c, t = row["claim_ms"], row["claim_txn_ms"]
    ops, att = row["tables"]["outbox_operations"], row["tables"]["outbox_attempts"]
    return (
        f"{row['ops']:>9,} ops  {row['ops_per_s']:>7,.0f} ops/s  claim p50 {c['p50']} "
        f"p99 {c['p99']} max {c['max']} ms (txn p99 {t['p99']}, n {c['n']})  "
        f"ops {ops['total_mb']} MB (idx {ops['index_mb']}) "
        f"live {ops['live']} dead {ops['dead']}  attempts {att['total_mb']} MB "
        f"(idx {att['index_mb']}) dead {att['dead']}  purged {row['purged']}"
    )


def purge_history(args: argparse.Namespace, say: Any = print) -> dict[str, Any]:
    """Claims while ``outbox purge`` deletes a large settled history."""
    from benchmarks.status_history import populate
    from outbox import Outbox

    work = workdir()
    with receiver(work) as rx, postgres_schema("bench_purge") as url:
        started = time.perf_counter()
        populate(url, args.purge_history)
        say(f"loaded {args.purge_history:,} settled rows in {time.perf_counter() - started:.0f} s")
        before = sizes(url)
        ob = Outbox(url, endpoints=[endpoint(rx.url, concurrency=args.concurrency)])
        timer = ClaimTimer(ob.store)
        rec = ob.reconcile
        batches: list[float] = []
        purge_s: list[float] = []

        def purge() -> None:
            last = [time.perf_counter()]

            def on_batch(_n: int) -> None:
                now = time.perf_counter()
                batches.append((now - last[0]) * 1000)
                last[0] = now

            t0 = time.perf_counter()
            rec.purge(older_than=timedelta(seconds=1), operator="bench", on_batch=on_batch)
            purge_s.append(time.perf_counter() - t0)

        try:
            # The dispatcher stays busy through the purge: a backlog far larger than
            # the purge lasts, topped up interval by interval.
            load(ob, 2000, "warm-")
            asyncio.run(drain(ob, 2000, args.concurrency))
            timer.take()
            thread = threading.Thread(target=purge)
            thread.start()
            claims: list[float] = []
            txns: list[float] = []
            k = 0
            while thread.is_alive():
                load(ob, args.interval, f"p{k}-")
                asyncio.run(drain(ob, args.interval, args.concurrency))
                claim_ms, txn_ms = timer.take()
                claims += claim_ms
                txns += txn_ms
                k += 1
            thread.join()
        finally:
            ob.close()
        after = sizes(url)
    res = {
        "mode": "purge_history", "rows": args.purge_history, "purge_seconds": purge_s,
        "rows_per_s": round(args.purge_history / purge_s[0]) if purge_s else None,
        "batch_ms": quantiles(batches), "claim_ms_during_purge": quantiles(claims),
        "claim_txn_ms_during_purge": quantiles(txns),
        "claims_over_100ms": sum(1 for c in claims if c > 100), "before": before, "after": after,
    }  # fmt: skip
    say(json.dumps({k: v for k, v in res.items() if k not in ("before", "after")}))
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sustained")
    parser.add_argument("--size", type=int, default=2_000_000, help="operations in all")
    parser.add_argument("--interval", type=int, default=250_000, help="operations a row")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--purge-every", type=float, default=10.0, help="seconds")
    parser.add_argument("--retain", type=float, default=20.0, help="purge older than, seconds")
    parser.add_argument(
        "--vacuum", action="store_true",
        help="VACUUM (ANALYZE) after each purge: stands in for autovacuum where it is off",
    )  # fmt: skip
    parser.add_argument("--purge-history", type=int, default=0, help="purge-history mode")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the harness works")
    args = parser.parse_args(argv)
    if args.smoke:
        args.size, args.interval, args.purge_every, args.retain = 600, 200, 0.5, 0.5
        args.purge_history = min(args.purge_history, 5000)
    res = purge_history(args) if args.purge_history else sustained(args)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
