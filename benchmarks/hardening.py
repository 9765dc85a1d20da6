"""Figures for the hardening faults, measured once: ``python -m benchmarks.hardening``.

* ``commits``: producers enqueue (each in its own transaction) while a throwaway
  PostgreSQL cluster, created under a temporary directory on a free port, is restarted
  ``--restarts`` times (``pg_ctl restart -m immediate``: a crash). Every enqueue's answer
  is classified (returned, NotStoredError, StoreOutcomeUnknown, and how many returns
  came through a failed COMMIT) and then checked against the rows: a NotStoredError
  whose row exists is the bug this guards against.
* ``outcomes``: a dispatcher sends a backlog to a local receiver while the throwaway
  cluster restarts; counts outcome writes retried and dropped, and attempts closed as
  LeaseExpired (an outcome that was dropped and resent).
* ``hostile``: a dispatcher subprocess sends 32 operations at once to a receiver that
  answers with gzip bombs, ``gzip, gzip`` bombs, 70 MB bodies and endless chunked
  bodies; its peak RSS and the longest attempt against the 5 s deadline.
* ``frozen``: a dispatcher subprocess on PostgreSQL behind a proxy that stops
  forwarding; SIGTERM-to-exit with the default stop timeout (30 s).

Needs root (the throwaway cluster runs as user ``postgres``) and the PostgreSQL server
binaries under /usr/lib/postgresql/*/bin. Never touches the shared server except for a
schema of its own (``frozen``).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """A PostgreSQL cluster of our own, under a temporary directory, as user postgres."""

    def __init__(self, base: Path) -> None:
        bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
        if not bins:
            raise SystemExit("no PostgreSQL server binaries under /usr/lib/postgresql")
        self.bin = Path(bins[-1])
        self.dir = base / "pgdata"
        self.port = _free_port()
        base.chmod(0o755)
        subprocess.run(["chown", "postgres", str(base)], check=True)
        self._as_postgres([str(self.bin / "initdb"), "-D", str(self.dir), "-A", "trust",
                           "-U", "postgres", "--no-sync"])  # fmt: skip
        self.log = base / "pg.log"

    def _as_postgres(self, argv: list[str]) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *argv], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def _ctl(self, *args: str) -> None:
        self._as_postgres([str(self.bin / "pg_ctl"), "-D", str(self.dir), "-l", str(self.log),
                           "-w", "-o", f"-p {self.port} -k {self.dir} "
                           "-c listen_addresses=127.0.0.1 -c fsync=on", *args])  # fmt: skip

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        self._ctl("start")

    def restart(self) -> None:
        self._ctl("restart", "-m", "immediate")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._ctl("stop", "-m", "immediate")


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="outbox-hardening-"))
    c = Cluster(base)
    c.start()
    try:
        yield c
    finally:
        c.stop()
        shutil.rmtree(base, ignore_errors=True)


def _restarter(c: Cluster, restarts: int, every: float, done: threading.Event) -> None:
    for _ in range(restarts):
        time.sleep(every * random.uniform(0.5, 1.5))
        c.restart()
    done.set()


def commits(restarts: int, producers: int) -> dict[str, Any]:
    from sqlalchemy import text

    from outbox import Endpoint, NotStoredError, Outbox, StoreOutcomeUnknown
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade
    from tests.faults.support import outbox_events

    with cluster() as c:
        engine = create_engine(c.url)
        upgrade(engine)
        engine.dispose()
        ob = Outbox(c.url, endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")])
        answers: dict[str, str] = {}
        lock = threading.Lock()
        done = threading.Event()

        def produce(index: int) -> None:
            n = 0
            while not done.is_set():
                n += 1
                op_id = f"p{index}-{n}"
                try:
                    ob.enqueue(endpoint="rx", method="POST", path="/x", json={"n": n},
                               operation_id=op_id)  # fmt: skip
                    answer = "returned"
                except StoreOutcomeUnknown:
                    answer = "unknown"
                except NotStoredError:
                    answer = "not_stored"
                except Exception as exc:  # the report says so rather than crash
                    answer = f"other:{type(exc).__name__}"
                with lock:
                    answers[op_id] = answer

        with outbox_events() as logs:
            threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
            for t in threads:
                t.start()
            started = time.monotonic()
            _restarter(c, restarts, 2.0, done)
            time.sleep(1.0)
            done.set()
            for t in threads:
                t.join()
        wall = time.monotonic() - started
        ob.close()
        engine = create_engine(c.url)
        with engine.connect() as conn:
            stored = set(conn.execute(text("SELECT operation_id FROM outbox_operations")).scalars())
        engine.dispose()
    by_answer = Counter(answers.values())
    failed_commits = [e for e in logs if e.get("event") == "enqueue_commit_failed"]
    unknown_ids = [i for i, a in answers.items() if a == "unknown"]
    return {
        "figure": "ambiguous commits under restarts",
        "restarts": restarts,
        "producers": producers,
        "wall_seconds": round(wall, 1),
        "enqueues": len(answers),
        "answers": dict(by_answer),
        # Enqueues whose COMMIT failed, by the answer the caller got.
        "failed_commits_classified": dict(
            Counter(answers.get(str(e.get("operation_id")), "?") for e in failed_commits)
        ),
        "not_stored_but_row_exists": sum(
            1 for i, a in answers.items() if a == "not_stored" and i in stored
        ),
        "returned_but_row_missing": sum(
            1 for i, a in answers.items() if a == "returned" and i not in stored
        ),
        "unknown_and_row_exists": sum(1 for i in unknown_ids if i in stored),
        "outcome_unknown_events": sum(
            1 for e in logs if e.get("event") == "enqueue_outcome_unknown"
        ),
    }


def outcomes(restarts: int, operations: int) -> dict[str, Any]:
    from tenacity import wait_random_exponential

    from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade
    from outbox.testing.receiver import Receiver
    from tests.faults.support import outbox_events

    with cluster() as c, tempfile.TemporaryDirectory() as tmp:
        engine = create_engine(c.url)
        upgrade(engine)
        engine.dispose()
        with Receiver(Path(tmp) / "rx.sqlite3") as rx:
            rx.faults.delay_after_commit(0.2, times=10**9)  # requests take a while: more in flight
            endpoint = Endpoint(name="rx", base_url=rx.url, timeout=3.0,
                                retry=RetryPolicy(max_attempts=20, window=timedelta(minutes=10),
                                                  wait=wait_random_exponential(0.1, max=1)),
                                key_retention=timedelta(hours=1))  # fmt: skip
            settings = DispatcherSettings(concurrency=32, lease_seconds=10.0,
                                          idle_poll_seconds=0.05)  # fmt: skip
            ob = Outbox(c.url, endpoints=[endpoint], dispatcher=settings)
            for i in range(0, operations, 500):
                from outbox import Intent

                ob.enqueue_many([Intent("rx", "POST", "/orders", {"i": j}, operation_id=f"o{j}")
                                 for j in range(i, min(i + 500, operations))])  # fmt: skip
            stop = threading.Event()
            done = threading.Event()
            with outbox_events() as logs:
                runner = threading.Thread(target=lambda: ob.run_dispatcher(stop=stop))
                runner.start()
                started = time.monotonic()
                _restarter(c, restarts, 3.0, done)
                deadline = time.monotonic() + 180
                while time.monotonic() < deadline:
                    try:
                        counts = ob.reconcile.status().as_dict()["states"]
                    except Exception:
                        time.sleep(0.5)
                        continue
                    if not counts.get("pending") and not counts.get("in_flight"):
                        break
                    time.sleep(0.5)
                stop.set()
                runner.join(120)
                wall = time.monotonic() - started
            with ob.engine.connect() as conn:
                from sqlalchemy import text

                expired = conn.execute(text(
                    "SELECT count(*) FROM outbox_attempts WHERE error_class = 'LeaseExpired'"
                )).scalar()  # fmt: skip
                states = dict(conn.execute(text(  # type: ignore[arg-type]
                    "SELECT state, count(*) FROM outbox_operations GROUP BY state"
                )).all())  # fmt: skip
            ob.close()
            effects = len(rx.effects())
    retry_events = [e for e in logs if e.get("event") == "outcome_write_retry"]
    failed = [e for e in logs if e.get("event") == "outcome_write_failed"]
    return {
        "figure": "outcome writes under restarts",
        "restarts": restarts,
        "operations": operations,
        "wall_seconds": round(wall, 1),
        "outcome_write_retries": len(retry_events),
        "outcome_batches_dropped": len(failed),
        "outcomes_dropped": sum(int(e.get("count", 0)) for e in failed),
        "attempts_closed_lease_expired": expired,
        "final_states": states,
        "receiver_effects": effects,
    }


def hostile(concurrency: int) -> dict[str, Any]:
    from tests.faults.hostile import hostile_receiver

    paths = ["/bomb", "/bomb2", "/huge", "/endless"]
    with hostile_receiver() as (url, _), tempfile.TemporaryDirectory() as tmp:
        script = f"""
import json, resource, sys, time
from datetime import timedelta
from tenacity import wait_fixed
from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy
ep = Endpoint(name="h", base_url={url!r}, timeout=5.0,
              retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5), wait=wait_fixed(1)),
              key_retention=timedelta(hours=1))
ob = Outbox("sqlite:///{tmp}/h.sqlite3", endpoints=[ep],
            dispatcher=DispatcherSettings(concurrency={concurrency}, batch_size={concurrency}))
paths = {paths!r}
for i in range({concurrency}):
    ob.enqueue(endpoint="h", method="POST", path=paths[i % len(paths)], json={{}},
               operation_id=f"h{{i}}")
t = time.monotonic()
s = ob.dispatch_once()
wall = time.monotonic() - t
ops = [ob.get(f"h{{i}}") for i in range({concurrency})]
longest = max(a.duration_ms or 0 for op in ops for a in op.attempts)
over = sum(1 for op in ops if op.result is not None and op.result.body_sha256 is None)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"attempts": s.attempts, "succeeded": s.succeeded, "recorded_over_limit": over,
                  "longest_attempt_ms": longest, "wall_seconds": round(wall, 2),
                  "peak_rss_mb": round(rss, 1)}}))
"""
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env=env, timeout=300, check=True)  # fmt: skip
        result = json.loads(done.stdout.strip().splitlines()[-1])
    return {"figure": "hostile bodies", "concurrency": concurrency, "deadline_seconds": 5.0,
            "bodies": paths, **result}  # fmt: skip


def frozen() -> dict[str, Any]:
    from benchmarks.common import postgres_schema
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade
    from tests.faults.pgproxy import pg_proxy
    from tests.faults.support import DispatcherProcess

    with postgres_schema("frozen") as url, tempfile.TemporaryDirectory() as tmp, \
            pg_proxy(url) as proxy:  # fmt: skip
        engine = create_engine(url)
        upgrade(engine)
        engine.dispose()
        d = DispatcherProcess(proxy.url, "http://127.0.0.1:9", Path(tmp), name="frozen")
        deadline = time.monotonic() + 60
        while not d.saw("dispatcher_started") and time.monotonic() < deadline:
            time.sleep(0.1)
        proxy.freeze()
        proxy.holding.wait(30)
        sent = time.monotonic()
        d.process.send_signal(signal.SIGTERM)
        code = d.wait(120)
        took = time.monotonic() - sent
        d.kill()
        proxy.thaw()
    return {"figure": "SIGTERM with a frozen database", "stop_timeout_seconds": 30.0,
            "exit_code": code, "sigterm_to_exit_seconds": round(took, 2)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figures", nargs="*", default=["commits", "outcomes", "hostile", "frozen"])
    parser.add_argument("--restarts", type=int, default=6)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--operations", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    from benchmarks.common import quiet_logs

    quiet_logs()
    for figure in args.figures:
        if figure == "commits":
            result = commits(args.restarts, args.producers)
        elif figure == "outcomes":
            result = outcomes(args.restarts, args.operations)
        elif figure == "hostile":
            result = hostile(args.concurrency)
        elif figure == "frozen":
            result = frozen()
        else:
            parser.error(f"unknown figure {figure!r}")
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
