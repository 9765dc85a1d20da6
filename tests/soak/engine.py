"""The seeded randomized soak shared by ``tests/soak`` and ``python -m benchmarks.soak``.

One run:

1. A receiver in its own process, with random faults per new key (503 with
   Retry-After, delay past the attempt deadline, drop after commit, 500 after commit,
   a stored-and-replayed 500, a key stuck "in progress"); it forgets keys after the
   endpoints' key retention (window + a few seconds).
2. A producer thread enqueues N operations over several endpoints and tenants while
   the chaos runs, and appends an ID to the acknowledged list only after ``enqueue``
   returned. Some go through the caller's own transaction (a row of its own table in
   the same transaction), a few of those are rolled back on purpose.
3. Dispatcher subprocesses (``outbox --app tests.soak.app:outbox dispatch``), each
   SIGKILLed after a random, log-uniform 0.3-8 s; one or two at once; each with random
   failpoints (kill, raise, or pause longer than the lease at the named points).
4. A drain without dispatcher faults until nothing is pending or in flight (bounded).
5. The oracle (``tests.soak.oracle``) reads both databases; one JSON line of figures.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy import func, select, text
from sqlalchemy.engine import make_url

from outbox.client import Outbox
from outbox.dispatch import failpoints
from outbox.errors import OperationConflict, StoreError
from outbox.store.engine import create_engine, sqlite_path
from outbox.store.migrate import upgrade
from outbox.store.tables import attempts, operations
from outbox.testing.receiver import RandomFaults, Receiver, RemoteReceiver
from tests.soak import app as soak_app
from tests.soak import oracle

ROOT = Path(__file__).resolve().parents[2]
TENANTS = ("", "acme", "globex", "initech")


@dataclass
class SoakSettings:
    """Knobs of one run. The defaults are the CI soak (about two minutes)."""

    db: str = "sqlite"
    seed: int = 0
    operations: int = 1000
    #: Random SIGKILLs of dispatchers at least (failpoint kills come on top).
    min_kills: int = 20
    #: Operations enqueued per second during the chaos phase.
    enqueue_rate: float = 16.0
    #: The chaos phase never runs longer than this (kills may then fall short).
    max_chaos_seconds: float = 150.0
    #: The drain never runs longer than this.
    drain_seconds: float = 60.0
    window_seconds: float = 12.0
    lease_seconds: float = 3.0
    lease_margin_seconds: float = 0.25
    concurrency: int = 16
    lifetime_seconds: tuple[float, float] = (0.3, 8.0)
    #: Probability that a dispatcher slot is followed by two dispatchers at once.
    p_two: float = 0.5
    #: Probability that a dispatcher starts with failpoints.
    p_failpoints: float = 0.6
    failpoint_menu: tuple[str, ...] = (
        "after_claim=kill:0.05",
        "after_attempt_commit=kill:0.02",
        "after_response=kill:0.02",
        "after_outcome=kill:0.05",
        "after_response=raise:0.03",
        "after_claim=pause:{pause}@0.15",
        "after_attempt_commit=pause:{pause}@0.06",
        "after_response=pause:{pause}@0.06",
    )
    #: Receiver faults, drawn per new key.
    p_fail_before_work: float = 0.06
    p_drop_after_commit: float = 0.04
    p_fail_after_commit: float = 0.03
    p_stored_500: float = 0.01
    p_delay_after_commit: float = 0.03
    p_stuck: float = 0.01
    retry_after: str = "1"
    #: Producer mix.
    p_via_caller: float = 0.1
    p_rollback: float = 0.03
    p_get: float = 0.02
    #: Slack of O11 and O12 (clock reads, scheduling).
    epsilon_ms: int = 1000
    #: A planted bug for every dispatcher (``tests.soak.planted``), or None.
    plant: str | None = None
    #: Instead of random chaos, the scripted stale-owner race at this failpoint
    #: (``after_attempt_commit`` or ``after_response``): see ``Soak._stale_owner``.
    script: str | None = None

    @property
    def pause_seconds(self) -> float:
        return self.lease_seconds + 1.5


@dataclass
class _Dispatcher:
    index: int
    process: subprocess.Popen[bytes]
    started: float
    lifetime: float
    log: Path
    failpoints: str
    handle: IO[bytes]


@dataclass
class SoakResult:
    line: dict[str, Any]
    verdict: oracle.Verdict
    workdir: Path
    extras_ok: bool = field(default=True)

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.extras_ok


# --------------------------------------------------------------------------- the producer


@dataclass(frozen=True)
class _Planned:
    tenant: str
    operation_id: str
    endpoint: str
    method: str
    path: str
    body: Any
    via_caller: bool
    rollback: bool


def plan_operations(settings: SoakSettings, rng: random.Random) -> list[_Planned]:
    """N intents; pairs share an operation ID in two tenants (keys are per tenant)."""
    planned: list[_Planned] = []
    for i in range(settings.operations):
        number = i // 2
        tenant = TENANTS[(number + (i % 2)) % len(TENANTS)]
        op_id = f"s{settings.seed}-op-{number:06d}"
        spec = rng.choice(soak_app.ENDPOINTS)
        method, template, has_body = rng.choice(spec.routes)
        path = template.format(n=number)
        if rng.random() < settings.p_get:
            method, has_body = "GET", False
        body = None
        if has_body:
            body = {
                "operation_id": op_id,
                "tenant": tenant,
                "n": i,
                "amount": rng.randint(1, 10_000),
                "note": rng.choice(["plain", "ünïcødé ✓", "quote ' and \" and ;--", "a\nb"]),
                "items": [{"sku": f"SKU-{rng.randint(1, 99)}", "qty": rng.randint(1, 5)}],
            }
        via_caller = rng.random() < settings.p_via_caller
        rollback = via_caller and rng.random() < settings.p_rollback / settings.p_via_caller
        planned.append(_Planned(tenant, op_id, spec.name, method, path, body, via_caller, rollback))
    return planned


class _Rollback(Exception):
    pass


class Producer(threading.Thread):
    def __init__(self, ob: Outbox, plan: list[_Planned], rate: float, stop: threading.Event):
        super().__init__(name="soak-producer", daemon=True)
        self.ob, self.plan, self.rate, self.stop_event = ob, plan, rate, stop
        self.acknowledged: list[tuple[str, str]] = []
        self.rolled_back: list[tuple[str, str]] = []
        self.via_caller: list[tuple[str, str]] = []
        self.stats: Counter[str] = Counter()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the engine
            self.error = exc

    def _enqueue(self, p: _Planned, connection: Any = None) -> None:
        self.ob.enqueue(
            endpoint=p.endpoint,
            method=p.method,
            path=p.path,
            json=p.body,
            operation_id=p.operation_id,
            tenant=p.tenant,
            connection=connection,
        )

    def _once(self, p: _Planned) -> None:
        if not p.via_caller:
            self._enqueue(p)
            return
        app_table = oracle.APP_TABLE
        with self.ob.engine.begin() as conn:
            conn.execute(
                text(f"INSERT INTO {app_table} (tenant, operation_id) VALUES (:t, :o)"),
                {"t": p.tenant, "o": p.operation_id},
            )
            self._enqueue(p, connection=conn)
            if p.rollback:
                raise _Rollback

    def _run(self) -> None:
        rng = random.Random(len(self.plan))
        start = time.monotonic()
        for i, p in enumerate(self.plan):
            wait = start + i / self.rate - time.monotonic()
            if wait > 0 and self.stop_event.wait(wait):
                return
            if self.stop_event.is_set():
                return
            for _ in range(20):
                try:
                    self._once(p)
                except _Rollback:
                    self.rolled_back.append((p.tenant, p.operation_id))
                    self.stats["rolled_back"] += 1
                    break
                except StoreError:
                    # Not stored: not acknowledged; the caller tries again, same ID.
                    self.stats["enqueue_store_errors"] += 1
                    time.sleep(0.05)
                    continue
                key = (p.tenant, p.operation_id)
                self.acknowledged.append(key)
                if p.via_caller:
                    self.via_caller.append(key)
                break
            # Now and then, the caller's own retry: same arguments, same operation.
            if self.acknowledged and rng.random() < 0.02:
                self._repeat(rng)

    def _repeat(self, rng: random.Random) -> None:
        tenant, op_id = rng.choice(self.acknowledged)
        p = next(x for x in self.plan if (x.tenant, x.operation_id) == (tenant, op_id))
        try:
            self._enqueue(p)
            self.stats["repeat_enqueue_ok"] += 1
        except StoreError:
            self.stats["enqueue_store_errors"] += 1
        try:
            self.ob.enqueue(
                endpoint=p.endpoint, method="POST", path="/other", json={"x": 1},
                operation_id=op_id, tenant=tenant,
            )  # fmt: skip
            self.stats["conflict_not_raised"] += 1
        except OperationConflict:
            self.stats["conflict_raised"] += 1
        except StoreError:
            self.stats["enqueue_store_errors"] += 1


# --------------------------------------------------------------------------- the engine


class Soak:
    def __init__(self, settings: SoakSettings, workdir: Path, db_url: str | None = None) -> None:
        self.s = settings
        self.workdir = workdir
        self.rng = random.Random(settings.seed)
        self.secret = f"PLANTED-SOAK-SECRET-{settings.seed}-{self.rng.getrandbits(32):08x}"
        if db_url is None:
            if settings.db != "sqlite":
                raise ValueError("a PostgreSQL soak needs db_url")
            db_url = f"sqlite:///{workdir / 'outbox.sqlite3'}"
        self.db_url = db_url
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.failpoint_log = workdir / "failpoints.log"
        self.dispatchers: list[_Dispatcher] = []
        self.exits: Counter[str] = Counter()
        self.crash_tails: list[str] = []
        self.random_kills = 0
        self.starts = 0
        self.two_at_once_seconds = 0.0
        self.config: dict[str, Any] = {}

    # -- processes --------------------------------------------------------------------

    def _spawn(self, *, chaos: bool, failpoint_spec: str = "") -> _Dispatcher:
        index = self.starts
        self.starts += 1
        fps = failpoint_spec
        if chaos and self.rng.random() < self.s.p_failpoints:
            k = min(len(self.s.failpoint_menu), self.rng.choice((1, 1, 2)))
            picked = self.rng.sample(self.s.failpoint_menu, k)
            names = set()
            chosen = []
            for item in picked:  # one rule per point
                name = item.partition("=")[0]
                if name not in names:
                    names.add(name)
                    chosen.append(item.format(pause=self.s.pause_seconds))
            fps = ",".join(chosen)
        env = dict(os.environ)
        env.update(
            {
                soak_app.CONFIG_ENV: json.dumps(self.config),
                failpoints.ENV: fps,
                failpoints.ENABLE_ENV: failpoints.ENABLE_VALUE,
                failpoints.SEED_ENV: str(self.s.seed * 100_003 + index),
                failpoints.LOG_ENV: str(self.failpoint_log),
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p),
            }
        )
        if self.s.plant:
            from tests.soak.planted import PLANT_ENV

            env[PLANT_ENV] = self.s.plant
            argv = [sys.executable, "-m", "tests.soak.planted"]
        else:
            env.pop("OUTBOX_SOAK_PLANT", None)
            argv = [sys.executable, "-m", "outbox.cli"]
        argv += ["--app", "tests.soak.app:outbox", "--log-format", "json", "dispatch"]
        log = self.logs / f"dispatcher-{index:04d}.log"
        handle = log.open("wb")
        process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        low, high = self.s.lifetime_seconds
        lifetime = math.exp(self.rng.uniform(math.log(low), math.log(high)))
        d = _Dispatcher(index, process, time.monotonic(), lifetime, log, fps, handle)
        self.dispatchers.append(d)
        return d

    def _reap(self, d: _Dispatcher, *, kill: bool) -> None:
        if kill and d.process.poll() is None:
            d.process.send_signal(signal.SIGKILL)
        try:
            rc = d.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            d.process.kill()
            rc = d.process.wait()
        d.handle.close()
        if d in self.dispatchers:
            self.dispatchers.remove(d)
        if kill and rc == -signal.SIGKILL:
            return
        self.exits[str(rc)] += 1
        if rc not in (0, -signal.SIGKILL):
            tail = d.log.read_bytes()[-1500:].decode("utf-8", errors="replace")
            self.crash_tails.append(f"dispatcher {d.index} rc={rc} fps={d.failpoints}: {tail}")

    def _stop_gracefully(self, d: _Dispatcher, timeout: float = 20.0) -> None:
        if d.process.poll() is None:
            d.process.send_signal(signal.SIGTERM)
            try:
                d.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                d.process.kill()
        self._reap(d, kill=False)

    def _kill_all(self) -> None:
        for d in list(self.dispatchers):
            self._reap(d, kill=True)

    # -- phases -----------------------------------------------------------------------

    def _count_live(self, ob: Outbox) -> int:
        with ob.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count())
                    .select_from(operations)
                    .where(operations.c.state.in_(["pending", "in_flight"]))
                ).scalar_one()
            )

    def _count_open_attempts(self, ob: Outbox) -> int:
        with ob.engine.connect() as conn:
            return int(
                conn.execute(
                    select(func.count()).select_from(attempts).where(attempts.c.delivery.is_(None))
                ).scalar_one()
            )

    def _stale_owner(self, ob: Outbox, producer: Producer, stop: threading.Event) -> None:
        """The race behind the lease and fencing rules, driven in order, not by chance.

        Everything is enqueued first. Dispatcher A claims the whole batch and holds every
        attempt at ``script``'s failpoint far past its lease. Only once all of A's
        attempts are open does B start: it takes the expired leases over and settles
        every operation. Then A is stopped gracefully, which lets its held attempts run
        to their end before it exits: whatever A does after its lease (send, write) is
        bound to happen, and to happen after B's outcome.
        """
        producer.join(timeout=60)
        stop.set()
        point, hold = self.s.script, self.s.lease_seconds + 8.0
        a = self._spawn(chaos=False, failpoint_spec=f"{point}=pause:{hold}")
        deadline = time.monotonic() + 60
        while self._count_open_attempts(ob) < len(producer.acknowledged):
            if time.monotonic() > deadline or a.process.poll() is not None:
                raise RuntimeError("dispatcher A never held the whole batch")
            time.sleep(0.05)
        b = self._spawn(chaos=False)
        deadline = time.monotonic() + 60
        while self._count_live(ob) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._stop_gracefully(b)
        self._stop_gracefully(a, timeout=hold + 30)

    def run(self) -> SoakResult:
        started = time.monotonic()
        s = self.s
        engine = create_engine(self.db_url)
        try:
            upgrade(engine)
            oracle.install_instruments(engine)
        finally:
            engine.dispose()
        receiver_db = self.workdir / "receiver.sqlite3"
        probe = {"window_seconds": s.window_seconds}
        receiver: RemoteReceiver = Receiver.spawn(
            receiver_db,
            key_ttl_seconds=soak_app.retention_seconds(probe),
            random_faults=RandomFaults(
                seed=s.seed,
                p_drop_after_commit=s.p_drop_after_commit,
                p_fail_before_work=s.p_fail_before_work,
                p_fail_after_commit=s.p_fail_after_commit,
                p_stored_500=s.p_stored_500,
                p_delay_after_commit=s.p_delay_after_commit,
                delay_seconds=max(sp.timeout for sp in soak_app.ENDPOINTS) + 0.7,
                p_stuck=s.p_stuck,
                retry_after=s.retry_after,
            ),
        )
        producer: Producer | None = None
        stop = threading.Event()
        phases: dict[str, float] = {}
        ob: Outbox | None = None
        drain_left = -1
        try:
            self.config = {
                "db": self.db_url,
                "receiver_url": receiver.url,
                "window_seconds": s.window_seconds,
                "lease_seconds": s.lease_seconds,
                "lease_margin_seconds": s.lease_margin_seconds,
                "concurrency": s.concurrency,
                "secret": self.secret,
            }
            ob = soak_app.build(self.config)
            plan = plan_operations(s, self.rng)
            producer = Producer(ob, plan, s.enqueue_rate, stop)
            producer.start()
            if s.script is not None:
                self._stale_owner(ob, producer, stop)

            # Chaos.
            t0 = time.monotonic()
            target = 1
            while s.script is None:
                now = time.monotonic()
                for d in list(self.dispatchers):
                    if d.process.poll() is not None:
                        self._reap(d, kill=False)
                        target = 2 if self.rng.random() < s.p_two else 1
                    elif now - d.started >= d.lifetime:
                        self._reap(d, kill=True)
                        self.random_kills += 1
                        target = 2 if self.rng.random() < s.p_two else 1
                produced = not producer.is_alive()
                if produced and self.random_kills >= s.min_kills:
                    break
                if now - t0 >= s.max_chaos_seconds:
                    break
                while len(self.dispatchers) < target:
                    self._spawn(chaos=True)
                time.sleep(0.05)
                if len(self.dispatchers) >= 2:
                    self.two_at_once_seconds += 0.05
            stop.set()
            producer.join(timeout=30)
            self._kill_all()
            phases["chaos"] = round(time.monotonic() - t0, 1)

            # Drain: no dispatcher faults, until nothing is pending or in flight.
            t1 = time.monotonic()
            drainers = [self._spawn(chaos=False) for _ in range(2) if self._count_live(ob)]
            while time.monotonic() - t1 < s.drain_seconds:
                drain_left = self._count_live(ob)
                if drain_left == 0:
                    break
                for d in drainers:
                    if d.process.poll() is not None and d in self.dispatchers:
                        self._reap(d, kill=False)
                time.sleep(0.25)
            for d in list(self.dispatchers):
                self._stop_gracefully(d)
            phases["drain"] = round(time.monotonic() - t1, 1)
        finally:
            stop.set()
            self._kill_all()
            receiver.close()
            if ob is not None:
                ob.close()

        # Check.
        t2 = time.monotonic()
        scan: list[Path] = []
        path = sqlite_path(create_engine_url(self.db_url))
        if path is not None:
            scan = [path, Path(f"{path}-wal"), Path(f"{path}-shm")]
        logs = sorted(self.logs.glob("*.log"))
        assert producer is not None
        evidence = oracle.Evidence(
            acknowledged=list(producer.acknowledged),
            rolled_back=list(producer.rolled_back),
            via_caller=list(producer.via_caller),
            config=self.config,
            secret=self.secret,
            scan_files=scan,
            log_files=logs,
            epsilon_ms=s.epsilon_ms,
        )
        engine = create_engine(self.db_url)
        try:
            verdict = oracle.check(engine, receiver_db, evidence)
        finally:
            engine.dispose()
        phases["check"] = round(time.monotonic() - t2, 1)

        fired: Counter[str] = Counter()
        if self.failpoint_log.exists():
            for line in self.failpoint_log.read_text().splitlines():
                _, point, action = line.split()
                fired[f"{point}:{action}"] += 1
        extras = dict(verdict.figures.pop("extras"))
        extras.update(
            {
                "producer_error": repr(producer.error) if producer.error else None,
                "conflict_not_raised": producer.stats["conflict_not_raised"],
                "unexpected_dispatcher_exits": sum(
                    n for rc, n in self.exits.items() if rc not in ("0", str(-signal.SIGKILL))
                ),
            }
        )
        extras_ok = (
            not any(v for k, v in extras.items() if k != "producer_error")
            and extras["producer_error"] is None
        )
        line: dict[str, Any] = {
            "soak": "outbox",
            "db": s.db,
            "seed": s.seed,
            "plant": s.plant,
            "operations": s.operations,
            "acknowledged": len(producer.acknowledged),
            "rolled_back": len(producer.rolled_back),
            "via_caller": len(producer.via_caller),
            "producer": dict(producer.stats),
            "dispatcher_starts": self.starts,
            "random_kills": self.random_kills,
            "failpoints_fired": dict(sorted(fired.items())),
            "dispatcher_exits": dict(self.exits),
            "two_at_once_seconds": round(self.two_at_once_seconds, 1),
            "drain_left": drain_left,
            **verdict.figures,
            "checks": verdict.checks,
            "failed_checks": sorted(k for k, v in verdict.checks.items() if v),
            "extras": extras,
            "wall_seconds": round(time.monotonic() - started, 1),
            "phases": phases,
            "settings": {k: v for k, v in asdict(s).items() if k not in ("failpoint_menu",)},
        }
        if not verdict.ok:
            line["examples"] = {k: [repr(x) for x in v] for k, v in verdict.examples.items()}
        if self.crash_tails:
            line["crash_tails"] = self.crash_tails[:3]
        return SoakResult(line=line, verdict=verdict, workdir=self.workdir, extras_ok=extras_ok)


def create_engine_url(url: str) -> Any:
    from outbox.store.engine import normalize_url

    return normalize_url(url)


@contextlib.contextmanager
def postgres_schema(base_url: str, *, keep: bool = False) -> Iterator[str]:
    """A fresh schema on the server (dropped afterwards); yields a URL whose
    search_path is that schema, so every process of the soak uses it."""
    schema = f"soak_{uuid.uuid4().hex[:12]}"
    admin = sa_create_engine(base_url)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = make_url(base_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        if not keep:
            with admin.begin() as conn:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


def run_soak(settings: SoakSettings, workdir: Path, db_url: str | None = None) -> SoakResult:
    """Run one soak and print its JSON line."""
    workdir.mkdir(parents=True, exist_ok=True)
    result = Soak(settings, workdir, db_url).run()
    print(json.dumps(result.line, sort_keys=True, default=str), flush=True)
    return result
