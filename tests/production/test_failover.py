"""A real two-node cluster (streaming, synchronous replication) and a primary failover
under enqueue and dispatch load: ``pg_ctl stop -m immediate`` on the primary, promote
the standby, re-seed the old primary as the new standby; three times. The outbox uses a
multi-host URL with ``target_session_attrs=read-write``.

Oracle: every acknowledged enqueue is stored and sent; no key is applied twice at the
receiver."""

from __future__ import annotations

import contextlib
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select

from outbox import DispatcherSettings, Endpoint, Outbox, State
from outbox.errors import NotStoredError
from outbox.store.migrate import upgrade
from outbox.store.tables import attempts
from outbox.testing.receiver import Receiver
from tests.production.conftest import free_port

BIN = Path("/usr/lib/postgresql/15/bin")
pytestmark = pytest.mark.slow


def _pg(*args: str) -> None:
    command = [str(BIN / args[0]), *args[1:]]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    subprocess.run(command, check=True, capture_output=True, timeout=120)


@dataclass
class Node:
    directory: Path
    port: int

    def start(self) -> None:
        _pg("pg_ctl", "-D", str(self.directory), "-w", "-l", f"{self.directory}.log",
            "-o", f"-p {self.port} -k {self.directory.parent}", "start")

    def stop_immediate(self) -> None:
        _pg("pg_ctl", "-D", str(self.directory), "-m", "immediate", "stop")

    def promote(self) -> None:
        _pg("pg_ctl", "-D", str(self.directory), "-w", "promote")

    def seed_from(self, primary: Node) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        _pg("pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", str(self.directory), "-R", "-X", "stream", "-c", "fast")
        self.start()


@pytest.fixture(scope="session")
def cluster() -> Iterator[list[Node]]:
    if not (BIN / "pg_ctl").exists():
        pytest.skip("PostgreSQL 15 server binaries are not installed")
    root = Path(tempfile.mkdtemp(prefix="outbox-failover-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    a, b = Node(root / "a", free_port()), Node(root / "b", free_port())
    _pg("initdb", "-D", str(a.directory), "-A", "trust", "-U", "postgres")
    with open(a.directory / "postgresql.conf", "a") as conf:
        conf.write(
            "listen_addresses = '127.0.0.1'\nwal_level = replica\nmax_wal_senders = 10\n"
            "synchronous_standby_names = '*'\nsynchronous_commit = on\n"
            "wal_keep_size = '256MB'\nfsync = off\n"  # fsync: the OS never crashes here
        )
    a.start()
    b.seed_from(a)
    try:
        yield [a, b]
    finally:
        for node in (a, b):
            with contextlib.suppress(subprocess.CalledProcessError):
                node.stop_immediate()
        shutil.rmtree(root, ignore_errors=True)


def test_three_failovers_under_load_lose_nothing(cluster: list[Node], tmp_path: Path) -> None:
    primary, standby = cluster
    # SQLAlchemy's spelling of libpq's host=a,b port=p,q: one host= per node.
    hosts = f"host=127.0.0.1:{primary.port}&host=127.0.0.1:{standby.port}"
    url = (f"postgresql+psycopg://postgres@/postgres?{hosts}"
           "&target_session_attrs=read-write&connect_timeout=2")
    from outbox.store.engine import create_engine

    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    acked: list[str] = []
    not_stored: list[str] = []
    stop = threading.Event()
    settings = DispatcherSettings(idle_poll_seconds=0.2, concurrency=8)
    with Receiver(tmp_path / "rx.sqlite3") as rx, Outbox(
        url, endpoints=[Endpoint(name="a", base_url=rx.url)], dispatcher=settings
    ) as ob:  # closed (its pool with it) even when an assertion fails

        def enqueue_loop() -> None:
            i = 0
            while not stop.is_set():
                key = f"f-{i}"
                try:
                    ob.enqueue(endpoint="a", method="POST", path="/o", json={"i": i},
                               operation_id=key)
                    acked.append(key)
                    i += 1
                except NotStoredError:
                    not_stored.append(key)  # must not be stored: a fresh ID next
                    i += 1
                    time.sleep(0.05)
                except Exception:
                    time.sleep(0.05)  # ambiguous: the same ID again until acknowledged

        loader = threading.Thread(target=enqueue_loop)
        dispatcher = threading.Thread(target=lambda: ob.run_dispatcher(stop=stop))
        loader.start()
        dispatcher.start()
        resumed: list[float] = []
        try:
            for n in range(3):
                deadline = time.monotonic() + 60
                while len(rx.requests()) < 20 * (n + 1) and time.monotonic() < deadline:
                    time.sleep(0.05)
                before = len(rx.requests())
                died = time.monotonic()
                primary.stop_immediate()
                standby.promote()
                primary.seed_from(standby)
                while len(rx.requests()) <= before:
                    time.sleep(0.01)
                resumed.append(time.monotonic() - died)
                primary, standby = standby, primary
            time.sleep(1.0)
        finally:
            stop.set()
            loader.join(60)
            dispatcher.join(120)
        ob.run_dispatcher(until_empty=True)
        print(f"acked={len(acked)} resumed after {[round(r, 2) for r in resumed]} s")
        lost = [k for k in acked if ob.store.get_state("", k) is None]
        assert lost == []
        states = {k: ob.get(k).state for k in acked}
        assert {k: s for k, s in states.items() if s is not State.SUCCEEDED} == {}
        twice = [k for k in acked if rx.effect_count(key=k) > 1]
        assert twice == []
        assert [k for k in not_stored if ob.store.get_state("", k) is not None] == []
        # Every request the receiver saw was preceded by its attempt row (the request
        # ID is written with the attempt before the request leaves).
        with ob.engine.connect() as conn:
            attempt_ids = {r[0] for r in conn.execute(select(attempts.c.request_id))}
        with sqlite3.connect(rx.db_path) as db:
            sent = [r[0] for r in db.execute("SELECT request_id FROM requests")]
        assert sent and [r for r in sent if r not in attempt_ids] == []
