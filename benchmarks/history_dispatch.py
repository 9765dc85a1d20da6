"""SQLite dispatch against months of history, and what a metrics scrape costs it
(issue 27, section 4).

    python -m benchmarks.history_dispatch [--rows 1000000] [--n 3000] [--repeat 2] [--smoke]

Variants, interleaved (each round runs every variant once on a fresh copy of its
database), medians quoted:

* ``empty``: drain N fresh operations from an empty table;
* ``history``: the same with ``--rows`` settled operations (each with its attempt row,
  loaded by :func:`benchmarks.status_history.populate`) already in the table;
* ``history_metrics``: ``history`` with Prometheus metrics registered, never scraped;
* ``history_scrape``: ``history_metrics`` scraped every ``--scrape-ms`` (50) by a thread
  calling ``generate_latest``, the store-backed gauges re-read on every scrape
  (``cache_seconds=0``: the worst case);
* ``history_scrape_cached``: the same scrape with the default ``cache_seconds=5``.

Each run also times the dispatcher's start-up check (``Store.preflight``: on SQLite a
``PRAGMA quick_check``, which reads the whole file) and quotes the rate after it
(``steady``) beside the rate from start (``ops_per_s``): at 1M settled rows the check
takes seconds, and a drain of a few thousand operations would otherwise measure it.

Targets: ``history`` >= 0.9x ``empty``; a scrape >= 0.98x ``history_metrics``.
The history database is built once and copied per run (seconds, not a reload).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import endpoint, receiver, workdir
from benchmarks.dispatch import drain, load

VARIANTS = ("empty", "history", "history_metrics", "history_scrape", "history_scrape_cached")


def template(work: Path, rows: int) -> tuple[Path, Path, float]:
    """(empty db, history db, seconds to load the history)."""
    from benchmarks.status_history import populate
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade

    empty = work / "empty.sqlite3"
    engine = create_engine(f"sqlite:///{empty}")
    upgrade(engine)
    engine.dispose()
    hist = work / "history.sqlite3"
    started = time.perf_counter()
    populate(f"sqlite:///{hist}", rows)
    return empty, hist, time.perf_counter() - started


def _scraper(registry: Any, every_s: float, stop: threading.Event, counts: list[int],
             cpu_ms: list[float]) -> None:  # fmt: skip
    from prometheus_client import generate_latest

    while not stop.wait(every_s):
        started = time.thread_time()
        generate_latest(registry)
        cpu_ms.append((time.thread_time() - started) * 1000)
        counts[0] += 1


def run_variant(variant: str, db: Path, rx_url: str, n: int, *, concurrency: int,
                scrape_s: float) -> dict[str, float]:  # fmt: skip
    from outbox import Outbox

    ob = Outbox(f"sqlite:///{db}", endpoints=[endpoint(rx_url, concurrency=concurrency)])
    stop = threading.Event()
    scrapes = [0]
    scrape_cpu_ms: list[float] = []
    thread = None
    try:
        if variant.startswith("history_"):
            from prometheus_client import CollectorRegistry

            registry = CollectorRegistry()
            cached = variant.endswith("_cached")
            ob.metrics(registry=registry, cache_seconds=5.0 if cached else 0.0)
            if "scrape" in variant:
                thread = threading.Thread(
                    target=_scraper,
                    args=(registry, scrape_s, stop, scrapes, scrape_cpu_ms),
                    daemon=True,
                )
        preflight = _timed_preflight(ob.store)
        load(ob, n, f"hd-{uuid.uuid4().hex[:8]}-")
        if thread is not None:
            thread.start()
        cpu = time.process_time()
        seconds, summary = asyncio.run(drain(ob, n, concurrency))
        cpu = time.process_time() - cpu
        if summary.succeeded != n:
            raise RuntimeError(f"{variant}: {summary.as_dict()} (expected {n} succeeded)")
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        ob.close()
    return {
        "ops_per_s": n / seconds, "steady": n / (seconds - preflight[0]),
        "preflight_s": preflight[0], "cpu_ms_per_op": cpu * 1000 / n, "scrapes": scrapes[0],
        # The scraping thread's own CPU per scrape (the figures' reads and the text).
        "scrape_cpu_ms": statistics.median(scrape_cpu_ms) if scrape_cpu_ms else 0.0,
        "cpu_ms_per_s": cpu * 1000 / seconds,
    }  # fmt: skip


def _timed_preflight(store: Any) -> list[float]:
    """Time the dispatcher's start-up check on this store; [seconds], filled on call."""
    spent = [0.0]
    inner = store.preflight

    def timed() -> None:
        started = time.perf_counter()
        try:
            inner()
        finally:
            spent[0] += time.perf_counter() - started

    store.preflight = timed
    return spent


def measure(rows: int, n: int, *, concurrency: int, repeat: int, scrape_ms: float,
            say: Any = print) -> dict[str, Any]:  # fmt: skip
    work = workdir()
    empty, hist, load_s = template(work, rows)
    say(f"history of {rows:,} settled rows loaded in {load_s:.1f} s")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with receiver(work) as rx:
        for variant in ("empty", "history"):  # warm-up, unmeasured
            db = work / f"warm-{variant}.sqlite3"
            shutil.copy(empty if variant == "empty" else hist, db)
            run_variant(
                variant, db, rx.url, min(n, 300), concurrency=concurrency, scrape_s=scrape_ms / 1000
            )
            db.unlink()
        for round_ in range(repeat):
            for variant in VARIANTS:
                db = work / f"run-{variant}.sqlite3"
                shutil.copy(empty if variant == "empty" else hist, db)
                r = run_variant(
                    variant, db, rx.url, n, concurrency=concurrency, scrape_s=scrape_ms / 1000
                )
                db.unlink()
                runs[variant].append(r)
                say(f"round {round_ + 1} {variant}: {r['ops_per_s']:,.0f} ops/s "
                    f"({r['steady']:,.0f} after a {r['preflight_s']:.2f} s start-up check), "
                    f"{r['cpu_ms_per_op']:.3f} CPU ms/op, {r['scrapes']} scrapes")  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    med = {v: statistics.median(x["ops_per_s"] for x in rs) for v, rs in runs.items()}
    cpu = {v: statistics.median(x["cpu_ms_per_op"] for x in rs) for v, rs in runs.items()}
    steady = {v: statistics.median(x["steady"] for x in rs) for v, rs in runs.items()}
    check = {v: statistics.median(x["preflight_s"] for x in rs) for v, rs in runs.items()}
    return {
        "rows": rows, "n": n, "concurrency": concurrency, "repeat": repeat,
        "scrape_ms": scrape_ms, "load_seconds": round(load_s, 1), "runs": runs,
        "median_ops_per_s": med, "median_steady_ops_per_s": steady,
        "median_preflight_s": check, "median_cpu_ms_per_op": cpu,
        "history_vs_empty": med["history"] / med["empty"],
        "history_vs_empty_steady": steady["history"] / steady["empty"],
        "scrape_vs_metrics": steady["history_scrape"] / steady["history_metrics"],
        "scrape_cpu_vs_metrics": cpu["history_scrape"] / cpu["history_metrics"],
        "cached_scrape_vs_metrics": steady["history_scrape_cached"] / steady["history_metrics"],
        "cached_scrape_cpu_vs_metrics": cpu["history_scrape_cached"] / cpu["history_metrics"],
        **scrape_share(runs, scrape_ms),
    }  # fmt: skip


def scrape_share(runs: dict[str, list[dict[str, float]]], scrape_ms: float) -> dict[str, float]:
    """One uncached scrape's CPU (the scraping thread's, median) against the CPU the
    dispatcher spends in the same time (``history_metrics``' CPU per second): the share
    of the dispatcher's work a scrape takes at this interval and at Prometheus's 15 s."""
    each = statistics.median(x["scrape_cpu_ms"] for x in runs["history_scrape"])
    per_s = statistics.median(x["cpu_ms_per_s"] for x in runs["history_metrics"])
    return {
        "scrape_cpu_ms": each,
        "dispatcher_cpu_ms_per_s": per_s,
        "scrape_share_at_interval": each * (1000 / scrape_ms) / per_s,
        "scrape_share_at_15s": each / 15 / per_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.history_dispatch")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--scrape-ms", type=float, default=50.0)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the harness works")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.n, args.repeat = 2000, 100, 1
    res = measure(
        args.rows,
        args.n,
        concurrency=args.concurrency,
        repeat=args.repeat,
        scrape_ms=args.scrape_ms,
    )
    print(f"\nSQLite dispatch, N={args.n}, {args.rows:,} settled rows, median of {args.repeat}:")
    for v in VARIANTS:
        print(f"  {v:<22} {res['median_ops_per_s'][v]:>7,.0f} ops/s from start, "
              f"{res['median_steady_ops_per_s'][v]:>7,.0f} after the start-up check "
              f"({res['median_preflight_s'][v]:.2f} s)  "
              f"{res['median_cpu_ms_per_op'][v]:.3f} CPU ms/op")  # fmt: skip
    print(
        f"  history / empty: {res['history_vs_empty']:.2f}x from start, "
        f"{res['history_vs_empty_steady']:.2f}x after the check (target >= 0.90)"
    )
    for key, what in (("scrape", "no cache"), ("cached_scrape", "5 s cache")):
        print(f"  scrape every {args.scrape_ms:g} ms ({what}) / metrics: "
              f"{res[key + '_vs_metrics']:.3f}x throughput, "
              f"{res[key + '_cpu_vs_metrics']:.3f}x CPU (target cost <= 2%)")  # fmt: skip
    print(f"  one uncached scrape: {res['scrape_cpu_ms']:.1f} CPU ms; the dispatcher "
          f"{res['dispatcher_cpu_ms_per_s']:.0f} CPU ms/s; share at {args.scrape_ms:g} ms: "
          f"{res['scrape_share_at_interval']:.2%}, "
          f"at 15 s: {res['scrape_share_at_15s']:.3%}")  # fmt: skip
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
