"""Phases that run dispatchers as separate processes: peak RSS, and two vs one on PostgreSQL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.claim import bulk_load
from benchmarks.common import client_cores, cores_all, pin, proc_cpu_seconds

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def spawn_worker(
    db_url: str,
    rx_url: str,
    *,
    concurrency: int,
    transport: str | None,
    max_seconds: float,
    start_at: float = 0.0,
    cpus: set[int] | None = None,
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.worker",
        "--db",
        db_url,
        "--url",
        rx_url,
        "--concurrency",
        str(concurrency),
        "--max-seconds",
        str(max_seconds),
        "--start-at",
        str(start_at),
    ]
    if transport:
        cmd += ["--transport", transport]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    if cpus:
        pin(proc.pid, cpus)
    return proc


def collect(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # never leave a dispatcher running into the next phase
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"dispatcher worker failed with exit code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


def load_backlog(db_url: str, n: int) -> float:
    from outbox.store.engine import create_engine

    engine = create_engine(db_url)
    try:
        return bulk_load(engine, 0, n, int(time.time() * 1000), f"bk-{uuid.uuid4().hex[:6]}-")
    finally:
        engine.dispose()


def rss_phase(
    db_url: str,
    rx_url: str,
    *,
    backlog: int,
    seconds: float,
    concurrency: int,
    transport: str | None,
) -> dict[str, Any]:
    """Peak RSS of one dispatcher process draining a backlog of ``backlog`` rows."""
    load_s = load_backlog(db_url, backlog)
    proc = spawn_worker(
        db_url, rx_url, concurrency=concurrency, transport=transport, max_seconds=seconds
    )
    result = collect(proc, timeout=seconds + 120)
    drained = result["summary"]["succeeded"]
    samples = result["rss_samples"]
    # RSS growth over the second half of the drain (the first half includes warm-up).
    growth = None
    if len(samples) >= 6:
        a, b = samples[len(samples) // 2], samples[-1]
        if b[2] > a[2]:
            growth = round((b[1] - a[1]) / (b[2] - a[2]) * 100_000, 2)  # MB per 100k ops
    return {
        "backlog": backlog,
        "load_seconds": round(load_s, 1),
        "drained": drained,
        "drain_seconds": round(result["end"] - result["start"], 1),
        "ops_per_s": round(drained / max(result["end"] - result["start"], 1e-9), 1),
        "peak_rss_mb": result["peak_rss_mb"],
        "sampled_peak_mb": result["rss_sampled_peak_mb"],
        "rss_start_mb": result["rss_start_mb"],
        "rss_growth_mb_per_100k_ops": growth,
        "sampled_peak_at": max(samples, key=lambda x: x[1]) if samples else None,
        "samples": samples[:: max(1, len(samples) // 20)],
    }


class PostgresCpu:
    """CPU seconds of the PostgreSQL server's processes, sampled while they live
    (a backend's counters vanish when its connection closes)."""

    def __init__(self) -> None:
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def sample(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                name = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if name.startswith("postgres"):
                pid = int(entry.name)
                cpu = proc_cpu_seconds(pid)
                self.first.setdefault(pid, cpu)
                self.last[pid] = cpu

    @property
    def seconds(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


def multi_phase(
    make_db: Any,
    rx: Any,
    *,
    n: int,
    concurrency: int,
    transport: str | None,
    configs: list[tuple[str, int, set[int] | None]],
    max_seconds: float = 60.0,
) -> list[dict[str, Any]]:
    """Drain the same backlog with each (label, processes, cpus) config on PostgreSQL."""
    results = []
    for label, procs, cpus in configs:
        with make_db() as url:
            load_backlog(url, n)
            start_at = time.time() + 2.0  # after every process has imported and connected
            workers = [
                spawn_worker(
                    url,
                    rx.url,
                    concurrency=concurrency,
                    transport=transport,
                    max_seconds=max_seconds,
                    start_at=start_at,
                    cpus=cpus,
                )
                for _ in range(procs)
            ]
            time.sleep(max(0.0, start_at - time.time() - 0.2))
            rx_cpu0, pg = rx.cpu_seconds(), PostgresCpu()
            while any(w.poll() is None for w in workers):
                pg.sample()
                time.sleep(0.25)
            outs = [collect(w, timeout=max_seconds + 60) for w in workers]
            rx_cpu, pg_cpu = rx.cpu_seconds() - rx_cpu0, pg.seconds
        done = sum(o["summary"]["succeeded"] for o in outs)
        wall = max(o["end"] for o in outs) - min(o["start"] for o in outs)
        results.append(
            {
                "config": label,
                "processes": procs,
                "cpus": sorted(cpus) if cpus else sorted(cores_all()),
                "ops": done,
                "seconds": round(wall, 2),
                "ops_per_s": round(done / wall, 1),
                "per_process_ops": [o["summary"]["succeeded"] for o in outs],
                "cpu_ms_per_op": {
                    "dispatchers": round(1000 * sum(o["cpu_seconds"] for o in outs) / done, 3),
                    "receiver": round(1000 * rx_cpu / done, 3),
                    "postgres": round(1000 * pg_cpu / done, 3),
                },
            }
        )
    return results


def default_multi_configs() -> list[tuple[str, int, set[int] | None]]:
    client = client_cores()
    both = set(cores_all())
    configs: list[tuple[str, int, set[int] | None]] = [
        ("1 dispatcher, client core", 1, client),
        ("2 dispatchers, client core", 2, client),
    ]
    if both != client:
        configs.append(("2 dispatchers, all cores", 2, both))
    return configs
