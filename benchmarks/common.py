"""Shared plumbing for the benchmarks: receiver, CPU pinning, databases, statistics."""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

#: The PostgreSQL server the benchmarks use (trust auth on the local machine by default).
POSTGRES_URL = os.environ.get(
    "OUTBOX_BENCH_POSTGRES_URL",
    os.environ.get("OUTBOX_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
)
RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: The core the receiver gets, and the cores the client side gets (when there are two).
RECEIVER_CORE = 0


def quiet_logs() -> None:
    """Configure structlog as a production user would: warnings and errors only."""
    import structlog

    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(),
        cache_logger_on_first_use=True,
    )


def cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def client_cores() -> set[int]:
    """Where the client side runs: every core but the receiver's, when there are two+."""
    all_cores = cores()
    rest = {c for c in all_cores if c != RECEIVER_CORE}
    return rest or set(all_cores)


def pin(pid: int, cpus: set[int]) -> bool:
    try:
        os.sched_setaffinity(pid, cpus)
    except (AttributeError, OSError):
        return False
    return True


@dataclass
class ReceiverHandle:
    url: str
    pid: int | None
    db_path: Path
    remote: Any
    pinned: bool

    def effects(self, prefix: str) -> int:
        """Effects applied for keys starting with ``prefix`` (read from the receiver's file)."""
        import sqlite3

        with contextlib.closing(sqlite3.connect(self.db_path, timeout=30)) as conn:
            row = conn.execute(
                "SELECT count(*) FROM effects WHERE idempotency_key LIKE ?", (prefix + "%",)
            ).fetchone()
        return int(row[0])

    def cpu_seconds(self) -> float:
        return proc_cpu_seconds(self.pid) if self.pid is not None else 0.0


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0.0 elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@contextlib.contextmanager
def receiver(
    workdir: Path, *, synchronous: str = "FULL", pin_cores: bool = True
) -> Iterator[ReceiverHandle]:
    """The real receiver (idempotency receipts in SQLite) in its own process.

    It gets core 0; this process gets the others, so the two do not fight over a core.
    """
    from outbox.testing.receiver import Receiver

    db = workdir / f"receiver-{uuid.uuid4().hex[:6]}.sqlite3"
    remote = Receiver.spawn(db, synchronous=synchronous)  # type: ignore[arg-type]
    pinned = False
    try:
        if pin_cores and len(cores()) > 1 and remote.pid is not None:
            pinned = pin(remote.pid, {RECEIVER_CORE}) and pin(0, client_cores())
        yield ReceiverHandle(remote.url, remote.pid, db, remote, pinned)
    finally:
        remote.close()
        if pinned:
            pin(0, set(cores_all()))


def cores_all() -> list[int]:
    return list(range(os.cpu_count() or 1))


def endpoint(url: str, *, concurrency: int, name: str = "rx") -> Any:
    from outbox import Endpoint, RetryPolicy

    return Endpoint(
        name=name,
        base_url=url,
        timeout=10.0,
        retry=RetryPolicy(max_attempts=5, window=timedelta(minutes=10)),
        key_retention=timedelta(hours=24),
        max_connections=max(concurrency, 1),
    )


# --------------------------------------------------------------------------- databases


def sqlite_url(workdir: Path, name: str) -> str:
    return f"sqlite:///{workdir / (name + '.sqlite3')}"


def postgres_available() -> str | None:
    """None when the server answers, else why not."""
    try:
        from sqlalchemy import create_engine, text

        engine = create_engine(POSTGRES_URL)
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        engine.dispose()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


@contextlib.contextmanager
def postgres_schema(prefix: str = "bench") -> Iterator[str]:
    """A fresh PostgreSQL schema with the outbox tables, dropped afterwards."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    from outbox.store.engine import create_engine as outbox_engine
    from outbox.store.migrate import upgrade

    schema = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = (
        make_url(POSTGRES_URL)
        .update_query_dict({"options": f"-csearch_path={schema}"})
        .render_as_string(hide_password=False)
    )
    try:
        engine = outbox_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@contextlib.contextmanager
def database(kind: str, workdir: Path, name: str) -> Iterator[str]:
    """A fresh, migrated outbox database: ``kind`` is "sqlite" or "postgres"."""
    if kind == "sqlite":
        url = sqlite_url(workdir, f"{name}-{uuid.uuid4().hex[:6]}")
        from outbox.store.engine import create_engine as outbox_engine
        from outbox.store.migrate import upgrade

        engine = outbox_engine(url)
        upgrade(engine)
        engine.dispose()
        yield url
    else:
        with postgres_schema() as url:
            yield url


# --------------------------------------------------------------------------- statistics


@dataclass
class Measurement:
    """Repeated runs of one contender: ops/s (or ms) per run, and the median."""

    name: str
    unit: str = "ops/s"
    values: list[float] = field(default_factory=list)
    n: int | None = None
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "unit": self.unit,
            "values": [round(v, 3) for v in self.values],
            "median": round(self.median, 3) if self.median is not None else None,
            "n": self.n,
            "notes": self.notes,
            "extra": self.extra,
            "skipped": self.skipped,
        }


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="outbox-bench-"))


def payload(i: int) -> dict[str, Any]:
    """The request body every contender sends: a small JSON order line."""
    return {"sku": f"SKU-{i % 997:04d}", "quantity": 1 + i % 5, "note": "benchmark"}


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}{unit}"
    if value >= 10:
        return f"{value:.1f}{unit}"
    return f"{value:.2f}{unit}"


@contextlib.contextmanager
def process_gc(enabled: bool = True) -> Iterator[None]:
    """The collector settings of an ``outbox dispatch`` process for the block
    (``cli_process.settle_gc_for_dispatch``: start-up frozen, the youngest generation
    collected every 10,000 allocations), then the interpreter's defaults back. The
    throughput phase runs every contender, raw clients and dispatchers alike, this way
    (``--gc default``: the interpreter's own settings for all of them)."""
    import gc

    from outbox.cli.process import DISPATCH_GC_THRESHOLD

    if not enabled:
        yield
        return
    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(max(before[0], DISPATCH_GC_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()

