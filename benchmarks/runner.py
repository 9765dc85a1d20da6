"""``python -m benchmarks run``: every contender side by side in one invocation.

Phases (``--phases`` picks some): latency, throughput, e2e, enqueue, claim, rss, multi,
ceiling.
Repetitions are interleaved (each repetition runs every contender once) so that drift on
a noisy machine hits all of them alike; the table quotes medians.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import transports
from benchmarks.common import (
    POSTGRES_URL,
    RESULTS_DIR,
    Measurement,
    cores_all,
    database,
    fmt,
    postgres_available,
    process_gc,
    quiet_logs,
    receiver,
    workdir,
)
from benchmarks.transports import missing

PHASES = ("latency", "throughput", "e2e", "enqueue", "claim", "rss", "multi", "ceiling")


@dataclass
class Profile:
    n: int
    concurrency: int
    repeats: int
    dbos_repeats: int
    dbos_max_seconds: float
    enqueue_n: int
    enqueue_hot_n: int
    claim_sizes: list[int]
    claim_repeats: int
    rss_backlog: int
    rss_seconds: float
    multi_n: int
    latency_n: int = 100
    latency_max_gap: float = 0.1
    latency_idle_seconds: float = 15.0
    ceiling_n: int = 4000
    ceiling_processes: tuple[int, ...] = (1, 2, 4, 8)


def profile(args: argparse.Namespace) -> Profile:
    if args.smoke:
        p = Profile(
            n=40,
            concurrency=8,
            repeats=1,
            dbos_repeats=1,
            dbos_max_seconds=30,
            enqueue_n=20,
            enqueue_hot_n=40,
            claim_sizes=[200, 1000],
            claim_repeats=2,
            rss_backlog=300,
            rss_seconds=3,
            multi_n=60,
            latency_n=5,
            latency_max_gap=0.05,
            latency_idle_seconds=1.0,
            ceiling_n=200,
            ceiling_processes=(1, 2),
        )
    elif args.quick:
        p = Profile(
            n=1000,
            concurrency=64,
            repeats=3,
            dbos_repeats=1,
            dbos_max_seconds=60,
            enqueue_n=400,
            enqueue_hot_n=2000,
            claim_sizes=[1000, 100_000],
            claim_repeats=10,
            rss_backlog=100_000,
            rss_seconds=15,
            multi_n=2000,
            latency_n=40,
            latency_idle_seconds=6.0,
            ceiling_n=2000,
        )
    else:
        p = Profile(
            n=2000,
            concurrency=64,
            repeats=3,
            dbos_repeats=1,
            dbos_max_seconds=120,
            enqueue_n=1000,
            enqueue_hot_n=4000,
            claim_sizes=[1000, 100_000, 1_000_000],
            claim_repeats=15,
            rss_backlog=1_000_000,
            rss_seconds=45,
            multi_n=5000,
        )
    if args.n:
        p.n = args.n
    if args.concurrency:
        p.concurrency = args.concurrency
    if args.repeats:
        p.repeats = args.repeats
    if args.dbos_repeats:
        p.dbos_repeats = args.dbos_repeats
    if args.rss_seconds:
        p.rss_seconds = args.rss_seconds
    return p


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.p = profile(args)
        self.transport = args.transport
        self.dir = workdir()
        self.results: dict[str, Any] = {"measurements": {}, "phases": {}, "skipped": {}}
        self.pg_reason = postgres_available()
        self.dbs = ["sqlite"] + ([] if self.pg_reason else ["postgres"])
        if self.pg_reason:
            self.results["skipped"]["postgres"] = self.pg_reason

    # -- helpers ------------------------------------------------------------------

    def m(self, key: str, name: str, unit: str = "ops/s", n: int | None = None) -> Measurement:
        got = self.results["measurements"].get(key)
        if got is None:
            got = Measurement(name=name, unit=unit, n=n)
            self.results["measurements"][key] = got
        return got

    def med(self, key: str) -> float | None:
        got = self.results["measurements"].get(key)
        return got.median if got is not None else None

    def _safe(self, label: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:
            if self.args.smoke or self.args.strict:
                raise
            _say(f"  ! {label} failed: {type(exc).__name__}: {exc}")
            self.results["skipped"][label] = f"failed: {type(exc).__name__}: {exc}"
            return None

    # -- phases -------------------------------------------------------------------

    def throughput(self, rx: Any) -> None:
        from benchmarks.dispatch import run_dispatch
        from benchmarks.raw import run_raw

        p, t = self.p, self.transport
        contenders: list[tuple[str, str, Callable[[], float]]] = [
            ("raw_aiohttp", "raw aiohttp", lambda: run_raw("aiohttp", rx.url, p.n, p.concurrency)),
            (
                "raw_httpx_default",
                "raw httpx, default transport (shipped today)",
                lambda: run_raw("httpx", rx.url, p.n, p.concurrency, transports.httpx_default),
            ),
        ]
        for name in transports.CANDIDATES:
            if name == "httpx_default":
                continue
            contenders.append(
                (
                    f"raw_httpx_{name}",
                    f"raw httpx over {name}"
                    + (" (recommended)" if name == transports.RECOMMENDED else ""),
                    lambda name=name: run_raw(
                        "httpx", rx.url, p.n, p.concurrency, transports.CANDIDATES[name]
                    ),
                )
            )
        for kind in self.dbs:

            def disp(kind: str = kind) -> float:
                with database(kind, self.dir, "disp") as url:
                    return run_dispatch(url, rx.url, p.n, p.concurrency, transports.CANDIDATES[t])

            contenders.append((f"dispatch_{kind}", f"outbox dispatcher, {kind} ({t})", disp))
        skip = {f"raw_httpx_{n}": missing(n) for n in transports.CANDIDATES if missing(n)}
        if missing("aiohttp_outbox"):
            skip["raw_aiohttp"] = missing("aiohttp_outbox")
        if missing(t):
            for kind in self.dbs:
                skip[f"dispatch_{kind}"] = f"transport {t}: {missing(t)}"
        for key, name, _fn in contenders:
            if key in skip:
                self.m(key, name, n=p.n).skipped = skip[key]
                _say(f"  - {name} skipped: {skip[key]}")
        contenders = [c for c in contenders if c[0] not in skip]
        gc_mode = self.args.gc == "dispatch"
        for rep in range(p.repeats):
            for key, name, fn in contenders:
                with process_gc(gc_mode):
                    value = self._safe(key, fn)
                if value is not None:
                    self.m(key, name, n=p.n).values.append(value)
                    _say(f"  [{rep + 1}/{p.repeats}] {name}: {value:,.0f} ops/s")

    def e2e(self, rx: Any) -> None:
        from benchmarks.dispatch import (
            run_end_to_end,
            run_end_to_end_live,
            run_end_to_end_process,
        )

        p, t = self.p, self.transport
        factory = transports.CANDIDATES[t]
        shapes: tuple[tuple[str, str, Callable[..., dict[str, float]], Any], ...] = (
            ("e2e", "outbox end to end (enqueue all, then dispatch)", run_end_to_end, factory),
            (
                "e2e_live",
                "outbox end to end (dispatcher thread in the app, running while it enqueues)",
                run_end_to_end_live,
                factory,
            ),
            (
                "e2e_process",
                "outbox end to end (`outbox dispatch` process, running while the app enqueues)",
                run_end_to_end_process,
                t,
            ),
        )
        for rep in range(p.repeats):
            for kind in self.dbs:
                for tag, title, fn, how in shapes:
                    with database(kind, self.dir, tag) as url:
                        out = self._safe(
                            f"{tag}_{kind}",
                            lambda url=url, fn=fn, how=how: fn(
                                url, rx.url, p.n, p.concurrency, how
                            ),
                        )
                    if out is None:
                        continue
                    m = self.m(f"{tag}_{kind}", f"{title}, {kind}", n=p.n)
                    m.values.append(out["ops_per_s"])
                    for extra in ("enqueue_ops_per_s", "dispatch_ops_per_s"):
                        if extra in out:
                            m.extra.setdefault(extra, []).append(round(out[extra]))
                    _say(f"  [{rep + 1}/{p.repeats}] {tag} {kind}: {out['ops_per_s']:,.0f} ops/s")
        self.dbos(rx)

    def dbos(self, rx: Any) -> None:
        p = self.p
        if importlib.util.find_spec("dbos") is None:
            reason = "dbos is not installed (pip install -e '.[bench]')"
            for kind in self.dbs:
                self.m(f"dbos_{kind}", f"DBOS Transact end to end, {kind}").skipped = reason
            _say(f"  - DBOS skipped: {reason}")
            return
        for rep in range(p.dbos_repeats):
            for kind in self.dbs:
                out = self._safe(f"dbos_{kind}", lambda kind=kind: self._dbos_once(kind, rx))
                if out is None:
                    continue
                m = self.m(f"dbos_{kind}", f"DBOS Transact end to end, {kind}", n=p.n)
                m.values.append(out["ops_per_s"])
                m.extra.setdefault("completed", []).append(out["completed"])
                if out["completed"] < p.n:
                    m.notes.append(
                        f"stopped after {p.dbos_max_seconds:.0f}s: {out['completed']} of {p.n}"
                    )
                _say(f"  [{rep + 1}/{p.dbos_repeats}] DBOS {kind}: {out['ops_per_s']:,.1f} ops/s")

    def _dbos_once(self, kind: str, rx: Any) -> dict[str, Any]:
        from sqlalchemy import create_engine, text

        p = self.p
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.dbos_job",
            "--url",
            rx.url,
            "--n",
            str(p.n),
            "--concurrency",
            str(p.concurrency),
            "--max-seconds",
            str(p.dbos_max_seconds),
        ]
        schema = None
        if kind == "sqlite":
            cmd += ["--db", f"sqlite:///{self.dir / ('dbos-' + uuid.uuid4().hex[:6] + '.db')}"]
        else:
            schema = f"dbos_bench_{uuid.uuid4().hex[:8]}"
            cmd += ["--db", POSTGRES_URL.replace("+psycopg", ""), "--schema", schema]
        root = Path(__file__).resolve().parent.parent
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(root), env.get("PYTHONPATH")) if x)
        try:
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env=env,
                cwd=root,
                timeout=p.dbos_max_seconds + 120,
                check=False,
            )
        finally:
            if schema is not None:
                engine = create_engine(POSTGRES_URL)
                with engine.begin() as conn:
                    conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
                engine.dispose()
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed")
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    def enqueue(self) -> None:
        from benchmarks import enqueue as E

        p = self.p
        for rep in range(p.repeats):
            for kind in self.dbs:
                with database(kind, self.dir, "enq") as url:
                    v = self._safe(
                        f"enqueue_own_{kind}", lambda url=url: E.own_transaction(url, p.enqueue_n)
                    )
                    if v is not None:
                        self.m(
                            f"enqueue_own_{kind}",
                            f"enqueue, own transaction, {kind}",
                            n=p.enqueue_n,
                        ).values.append(v)
                    for shape, per_tx, n in (("tx", 1, p.enqueue_n), ("hot", 200, p.enqueue_hot_n)):
                        out = self._safe(
                            f"enqueue_caller_{shape}_{kind}",
                            lambda url=url, per_tx=per_tx, n=n: E.callers_transaction(
                                url, n, per_tx=per_tx
                            ),
                        )
                        if out is None:
                            continue
                        label = (
                            "1 op per transaction"
                            if per_tx == 1
                            else f"{per_tx} ops per transaction"
                        )
                        self.m(
                            f"enqueue_caller_{shape}_{kind}",
                            f"enqueue in caller's transaction ({label}), {kind}",
                            n=n,
                        ).values.append(out["enqueue"])
                        self.m(
                            f"bare_insert_{shape}_{kind}",
                            f"bare Core insert, same row ({label}), {kind}",
                            n=n,
                        ).values.append(out["bare"])
                    rates = self._safe(f"enqueue_many_{kind}", lambda url=url: E.enqueue_many(url))
                    if rates:
                        self.m(
                            f"enqueue_many_{kind}", f"enqueue_many(1,000), {kind}", n=1000
                        ).values.extend(rates)
            _say(f"  [{rep + 1}/{p.repeats}] enqueue done")

    def claim(self) -> None:
        from benchmarks.claim import run_claim_bench

        p = self.p
        out: dict[str, Any] = {}
        for kind in self.dbs:
            with database(kind, self.dir, "claim") as url:
                rows = self._safe(
                    f"claim_{kind}",
                    lambda url=url: run_claim_bench(url, p.claim_sizes, repeats=p.claim_repeats),
                )
            if rows is None:
                continue
            out[kind] = rows
            for r in rows:
                _say(
                    f"  claim {kind} backlog {r['backlog']:,} ({r['mode']}): "
                    f"{r['ms_per_claim_100']} ms per 100, due index used: {r['uses_due_index']}"
                )
        self.results["phases"]["claim"] = out

    def rss(self, rx: Any) -> None:
        from benchmarks.processes import rss_phase

        p = self.p
        with database("sqlite", self.dir, "rss") as url:
            out = self._safe(
                "rss",
                lambda: rss_phase(
                    url,
                    rx.url,
                    backlog=p.rss_backlog,
                    seconds=p.rss_seconds,
                    concurrency=p.concurrency,
                    transport=self.transport,
                ),
            )
        if out is not None:
            self.results["phases"]["rss"] = out
            _say(
                f"  rss: backlog {out['backlog']:,}, drained {out['drained']:,} in "
                f"{out['drain_seconds']}s, peak {out['peak_rss_mb']} MB"
            )

    def multi(self, rx: Any) -> None:
        from benchmarks.processes import default_multi_configs, multi_phase

        p = self.p
        if "postgres" not in self.dbs:
            self.results["skipped"]["multi"] = f"needs PostgreSQL: {self.pg_reason}"
            return
        configs = default_multi_configs()
        out = self._safe(
            "multi",
            lambda: multi_phase(
                lambda: database("postgres", self.dir, "multi"),
                rx,
                n=p.multi_n,
                concurrency=p.concurrency,
                transport=self.transport,
                configs=configs,
            ),
        )
        if out is not None:
            self.results["phases"]["multi"] = out
            for r in out:
                _say(f"  multi {r['config']}: {r['ops_per_s']:,.0f} ops/s")

    def latency(self, rx: Any) -> None:
        from benchmarks.latency import CONFIGS, run_config

        p = self.p
        out: list[dict[str, Any]] = []
        for config in CONFIGS:
            if config.db not in self.dbs:
                continue
            with database(config.db, self.dir, "lat") as url:
                row = self._safe(
                    config.key,
                    lambda config=config, url=url: run_config(
                        config,
                        url,
                        rx,
                        n=p.latency_n,
                        max_gap=p.latency_max_gap,
                        idle_seconds=p.latency_idle_seconds,
                    ),
                )
            if row is None:
                continue
            row["key"] = config.key
            out.append(row)
            idle = row.get("idle_claims_per_s")
            _say(
                f"  latency {config.label}: p50 {row['p50_ms']} ms, p99 {row['p99_ms']} ms"
                + (f", idle {idle} claims/s" if idle is not None else "")
            )
        self.results["phases"]["latency"] = out

    def ceiling(self) -> None:
        from benchmarks.ceiling import ceiling_phase

        p = self.p
        if "postgres" not in self.dbs:
            self.results["skipped"]["ceiling"] = f"needs PostgreSQL: {self.pg_reason}"
            return
        out = self._safe(
            "ceiling",
            lambda: ceiling_phase(
                lambda: database("postgres", self.dir, "ceiling"),
                n=p.ceiling_n,
                processes=p.ceiling_processes,
            ),
        )
        if out is not None:
            self.results["phases"]["ceiling"] = out
            for r in out:
                _say(f"  ceiling K={r['processes']}: {r['ops_per_s']:,.0f} cycles/s")

    # -- driver -------------------------------------------------------------------

    def execute(self, phases: list[str]) -> dict[str, Any]:
        quiet_logs()
        started = time.time()
        self.results["meta"] = self.meta()
        with receiver(self.dir) as rx:
            self.results["meta"]["pinned"] = rx.pinned
            for phase in phases:
                t0 = time.time()
                _say(f"== {phase}")
                if phase == "throughput":
                    self.throughput(rx)
                elif phase == "e2e":
                    self.e2e(rx)
                elif phase == "enqueue":
                    self.enqueue()
                elif phase == "claim":
                    self.claim()
                elif phase == "rss":
                    self.rss(rx)
                elif phase == "multi":
                    self.multi(rx)
                elif phase == "latency":
                    self.latency(rx)
                elif phase == "ceiling":
                    self.ceiling()
                self.results["meta"].setdefault("phase_seconds", {})[phase] = round(
                    time.time() - t0, 1
                )
        self.results["meta"]["seconds"] = round(time.time() - started, 1)
        return self.results

    def meta(self) -> dict[str, Any]:
        import httpx
        import sqlalchemy

        def version(mod: str) -> str | None:
            with contextlib.suppress(Exception):
                from importlib.metadata import version as v

                return v(mod)
            return None

        rev = None
        with contextlib.suppress(Exception):
            rev = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                check=False,
            ).stdout.strip()
        import outbox

        return {
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git": rev,
            "outbox_from": str(Path(outbox.__file__).parent),
            "python": platform.python_version(),
            "cpus": len(cores_all()),
            "loadavg_at_start": os.getloadavg(),
            "profile": self.p.__dict__,
            "transport": self.transport,
            "gc": self.args.gc,
            "versions": {
                "httpx": httpx.__version__,
                "sqlalchemy": sqlalchemy.__version__,
                "aiohttp": version("aiohttp"),
                "httpx-aiohttp": version("httpx-aiohttp"),
                "dbos": version("dbos"),
            },
        }


# --------------------------------------------------------------------------- report


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def targets(res: dict[str, Any], transport: str) -> list[dict[str, Any]]:
    ms = res["measurements"]

    def med(key: str) -> float | None:
        m = ms.get(key)
        return m.median if m is not None else None

    rows: list[dict[str, Any]] = []

    def add(
        name: str,
        value: float | None,
        goal: float,
        *,
        le: bool = False,
        unit: str = "x",
        note: str = "",
    ) -> None:
        met = None if value is None else (value <= goal if le else value >= goal)
        rows.append(
            {
                "target": name,
                "value": value,
                "goal": f"{'<=' if le else '>='} {goal}{unit if unit != 'x' else 'x'}",
                "met": met,
                "note": note,
            }
        )

    raw_same = med(f"raw_httpx_{transport}")
    add(
        "dispatch SQLite / raw httpx (same transport)",
        _ratio(med("dispatch_sqlite"), raw_same),
        0.8,
    )
    add(
        "dispatch PostgreSQL / raw httpx (same transport)",
        _ratio(med("dispatch_postgres"), raw_same),
        0.6,
    )
    add(
        f"raw httpx over {transport} / httpx default", _ratio(raw_same, med("raw_httpx_default")), 5
    )
    add(
        f"raw httpx over {transport} / raw aiohttp (stretch)",
        _ratio(raw_same, med("raw_aiohttp")),
        0.5,
    )
    add(
        "dispatch SQLite / raw aiohttp (stretch)",
        _ratio(med("dispatch_sqlite"), med("raw_aiohttp")),
        0.5,
    )
    add(
        "end to end SQLite / DBOS SQLite (dispatcher thread in the app, DBOS's shape)",
        _ratio(med("e2e_live_sqlite"), med("dbos_sqlite")),
        15,
    )
    add(
        "end to end PostgreSQL / DBOS PostgreSQL (dispatcher thread in the app)",
        _ratio(med("e2e_live_postgres"), med("dbos_postgres")),
        5,
    )
    add(
        "end to end SQLite / DBOS SQLite (`outbox dispatch` process while enqueuing)",
        _ratio(med("e2e_process_sqlite"), med("dbos_sqlite")),
        15,
    )
    add(
        "end to end PostgreSQL / DBOS PostgreSQL (`outbox dispatch` process while enqueuing)",
        _ratio(med("e2e_process_postgres"), med("dbos_postgres")),
        5,
    )
    add(
        "end to end SQLite / DBOS SQLite (enqueue all, then dispatch)",
        _ratio(med("e2e_sqlite"), med("dbos_sqlite")),
        15,
    )
    add(
        "end to end PostgreSQL / DBOS PostgreSQL (enqueue all, then dispatch)",
        _ratio(med("e2e_postgres"), med("dbos_postgres")),
        5,
    )
    for kind in ("sqlite", "postgres"):
        add(
            f"enqueue in caller's tx / bare insert, 1 op per tx, {kind}",
            _ratio(med(f"enqueue_caller_tx_{kind}"), med(f"bare_insert_tx_{kind}")),
            0.9,
        )
        add(
            f"enqueue in caller's tx / bare insert, 200 ops per tx, {kind}",
            _ratio(med(f"enqueue_caller_hot_{kind}"), med(f"bare_insert_hot_{kind}")),
            0.9,
        )
    add("enqueue_many(1,000) SQLite", med("enqueue_many_sqlite"), 20000, unit=" ops/s")
    claim = res["phases"].get("claim", {})
    for kind, rows_ in claim.items():
        by_mode: dict[str, dict[int, float]] = {}
        for r in rows_:
            by_mode.setdefault(r["mode"], {})[r["backlog"]] = r["ms_per_claim_100"]
        for mode, per in by_mode.items():
            small, big = min(per), max(per)
            if small == big:
                continue
            add(
                f"claim at {big:,} / claim at {small:,}, {kind} ({mode})",
                _ratio(per[big], per[small]),
                1.5,
                le=True,
            )
    rss = res["phases"].get("rss")
    if rss:
        add(
            f"dispatcher peak RSS, backlog {rss['backlog']:,} (drained {rss['drained']:,})",
            rss["peak_rss_mb"],
            150,
            le=True,
            unit=" MB",
        )
    for row in res["phases"].get("latency", []):
        key = row["key"]
        if key in ("latency_postgres", "latency_sqlite"):
            add(f"enqueue -> receiver p50, {row['config']}", row["p50_ms"], 10, le=True,
                unit=" ms")
            add(f"enqueue -> receiver p99, {row['config']}", row["p99_ms"], 50, le=True,
                unit=" ms")
        elif key == "latency_sqlite_process":
            add(f"enqueue -> receiver p50, {row['config']}", row["p50_ms"], 20, le=True,
                unit=" ms")
        if key == "latency_postgres" and row.get("idle_claims_per_s") is not None:
            add("idle claim queries per second per dispatcher, PostgreSQL",
                row["idle_claims_per_s"], 1, le=True, unit="/s")
    multi = res["phases"].get("multi")
    if multi:
        one = next((r for r in multi if r["processes"] == 1), None)
        for r in multi:
            if r["processes"] == 2 and one:
                add(
                    f"two PG dispatchers / one ({r['config']})",
                    _ratio(r["ops_per_s"], one["ops_per_s"]),
                    1.5,
                )
    return rows


def report(res: dict[str, Any], transport: str) -> str:
    ms: dict[str, Measurement] = res["measurements"]
    lines = []
    meta = res["meta"]
    lines.append(
        f"outbox benchmarks  {meta['when']}  git {meta['git']}  cpus {meta['cpus']}  "
        f"receiver pinned to its own core: {meta.get('pinned')}  "
        f"load avg at start {tuple(round(x, 2) for x in meta['loadavg_at_start'])}"
    )
    p = meta["profile"]
    lines.append(
        f"N={p['n']} concurrency={p['concurrency']} repeats={p['repeats']} "
        f"(median of the repeats), dispatcher transport: {transport}, "
        f"throughput collector settings: {meta.get('gc', 'default')}"
    )
    lines.append("")
    base = ms.get("raw_aiohttp")
    width = max((len(m.name) for m in ms.values()), default=40) + 2
    lines.append(f"{'contender':<{width}}{'median':>12}  {'runs':<28}{'vs raw aiohttp':>15}")
    for m in ms.values():
        if m.skipped:
            lines.append(f"{m.name:<{width}}{'skipped':>12}  {m.skipped}")
            continue
        runs = ", ".join(fmt(v) for v in m.values[:5]) + (", ..." if len(m.values) > 5 else "")
        rel = _ratio(m.median, base.median if base else None) if m.unit == "ops/s" else None
        rel_s = f"{rel:.2f}x" if rel is not None and m.name.startswith(("raw", "outbox d")) else ""
        note = f"  ({'; '.join(m.notes)})" if m.notes else ""
        lines.append(f"{m.name:<{width}}{fmt(m.median):>12}  {runs:<28}{rel_s:>15}{note}")
    claim = res["phases"].get("claim")
    if claim:
        lines.append("")
        lines.append("claim of 100 (own transaction), ms, median:")
        for kind, rows in claim.items():
            for r in rows:
                lines.append(
                    f"  {kind:<9}{r['mode']:<10} backlog {r['backlog']:>9,}: "
                    f"{r['ms_per_claim_100']:>9.2f} ms   "
                    f"{'uses' if r['uses_due_index'] else 'does NOT use'} ix_outbox_operations_fair"
                )
    rss = res["phases"].get("rss")
    if rss:
        lines.append("")
        lines.append(
            f"dispatcher RSS (SQLite, backlog {rss['backlog']:,}): peak {rss['peak_rss_mb']} MB, "
            f"start {rss['rss_start_mb']} MB; drained {rss['drained']:,} in "
            f"{rss['drain_seconds']}s ({rss['ops_per_s']:,.0f}/s); growth over the second half "
            f"of the drain {rss['rss_growth_mb_per_100k_ops']} MB per 100k ops"
        )
    multi = res["phases"].get("multi")
    if multi:
        lines.append("")
        lines.append(
            "dispatcher processes on PostgreSQL (CPU ms per op: dispatchers / receiver "
            "/ PostgreSQL):"
        )
        for r in multi:
            c = r["cpu_ms_per_op"]
            lines.append(
                f"  {r['config']:<30} cpus {r['cpus']}: {r['ops_per_s']:>8,.0f} ops/s  "
                f"split {r['per_process_ops']}  cpu {c['dispatchers']} / "
                f"{c['receiver']} / {c['postgres']}"
            )
    latency = res["phases"].get("latency")
    if latency:
        lines.append("")
        lines.append(
            "latency, enqueue committed -> first request at the receiver, one at a time "
            "at random moments (ms):"
        )
        for r in latency:
            idle = ""
            if r.get("idle_claims_per_s") is not None:
                idle = (
                    f"   idle: {r['idle_claims_per_s']} claims/s, "
                    f"{r['idle_statements_per_s']} statements/s"
                )
            lines.append(
                f"  {r['config']:<58} p50 {r['p50_ms']:>7.1f}  p99 {r['p99_ms']:>7.1f}"
                f"  (n={r['n']}){idle}"
            )
    ceiling = res["phases"].get("ceiling")
    if ceiling:
        lines.append("")
        lines.append(
            "database-side ceiling, PostgreSQL: claim -> attempt row -> outcome, no HTTP "
            "(K processes, batches of 64):"
        )
        for r in ceiling:
            lines.append(
                f"  K={r['processes']:<3} {r['ops_per_s']:>9,.0f} cycles/s   "
                f"split {r['per_process_ops']}   PostgreSQL CPU {r['postgres_cpu_ms_per_op']} "
                "ms per cycle"
            )
    lines.append("")
    lines.append("targets:")
    for t in targets(res, transport):
        v = t["value"]
        vs = "-" if v is None else (f"{v:,.0f}" if v >= 100 else f"{v:.2f}")
        mark = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        lines.append(f"  {mark:<7}{t['target']}: {vs} (goal {t['goal']})")
    if res["skipped"]:
        lines.append("")
        for k, v in res["skipped"].items():
            lines.append(f"skipped {k}: {v}")
    lines.append(f"\ntook {meta['seconds']}s")
    return "\n".join(lines)


def to_json(res: dict[str, Any], transport: str) -> dict[str, Any]:
    out = dict(res)
    out["measurements"] = {k: m.as_dict() for k, m in res["measurements"].items()}
    out["targets"] = targets(res, transport)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the benchmarks and print a table")
    run.add_argument("--n", type=int, default=None, help="operations per throughput run")
    run.add_argument("--concurrency", type=int, default=None)
    run.add_argument("--repeats", type=int, default=None)
    run.add_argument("--dbos-repeats", type=int, default=None)
    run.add_argument("--rss-seconds", type=float, default=None, help="how long the RSS drain runs")
    run.add_argument("--quick", action="store_true", help="smaller sizes (about 3 minutes)")
    run.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness works")
    run.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}"
    )
    run.add_argument(
        "--transport",
        default=transports.RECOMMENDED,
        choices=sorted(transports.CANDIDATES),
        help="transport the dispatcher runs on",
    )
    run.add_argument("--output", default=None, help="JSON file (default benchmarks/results/)")
    run.add_argument("--strict", action="store_true", help="fail on the first error")
    run.add_argument(
        "--gc",
        choices=("dispatch", "default"),
        default="dispatch",
        help="collector settings for every throughput contender: those of an `outbox "
        "dispatch` process (start-up frozen, youngest generation every 10,000 "
        "allocations; the default) or the interpreter's own",
    )
    args = parser.parse_args(argv)

    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"unknown phases: {sorted(unknown)}")
    runner = Run(args)
    res = runner.execute(phases)
    print(report(res, args.transport), flush=True)
    out_path = (
        Path(args.output)
        if args.output
        else (
            RESULTS_DIR
            / f"run-{time.strftime('%Y%m%d-%H%M%S')}{'-smoke' if args.smoke else ''}.json"
        )
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(to_json(res, args.transport), indent=2, default=str))
    print(f"wrote {out_path}", flush=True)
    return 0
