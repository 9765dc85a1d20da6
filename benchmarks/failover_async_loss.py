"""How many acknowledged enqueues a failover loses with ASYNCHRONOUS replication.

    python -m benchmarks.failover_async_loss [--trials 3] [--threads 4] [--seconds 2]

Per trial: a fresh two-node cluster (initdb + pg_basebackup, no
synchronous_standby_names), enqueue threads through a multi-host URL, then
``pg_ctl stop -m immediate`` on the primary while they run, promote the standby, and
count the acknowledged operation IDs the promoted node does not have.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from outbox import Endpoint, Outbox
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from tests.production.conftest import free_port
from tests.production.test_failover import Node, _pg


def trial(threads: int, seconds: float) -> tuple[int, int]:
    root = Path(tempfile.mkdtemp(prefix="outbox-async-loss-"))
    root.chmod(0o755)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    a, b = Node(root / "a", free_port()), Node(root / "b", free_port())
    try:
        _pg("initdb", "-D", str(a.directory), "-A", "trust", "-U", "postgres")
        with open(a.directory / "postgresql.conf", "a") as conf:
            conf.write("listen_addresses = '127.0.0.1'\nwal_level = replica\n"
                       "max_wal_senders = 10\nwal_keep_size = '256MB'\n")
        a.start()
        b.seed_from(a)
        url = (f"postgresql+psycopg://postgres@/postgres?host=127.0.0.1:{a.port}"
               f"&host=127.0.0.1:{b.port}&target_session_attrs=read-write&connect_timeout=2")
        engine = create_engine(url)
        upgrade(engine)
        engine.dispose()
        ob = Outbox(url, endpoints=[Endpoint(name="a", base_url="http://127.0.0.1:9")])
        acked: list[str] = []
        stop = threading.Event()

        def load(t: int) -> None:
            i = 0
            while not stop.is_set():
                key = f"{t}-{i}"
                i += 1
                with contextlib.suppress(Exception):
                    ob.enqueue(endpoint="a", method="POST", path="/", json={}, operation_id=key)
                    acked.append(key)

        workers = [threading.Thread(target=load, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        time.sleep(seconds)
        a.stop_immediate()
        stop.set()
        for w in workers:
            w.join(30)
        b.promote()
        time.sleep(0.5)
        lost = sum(1 for k in acked if ob.store.get_state("", k) is None)
        ob.close()
        return lost, len(acked)
    finally:
        for node in (a, b):
            with contextlib.suppress(Exception):
                node.stop_immediate()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    for n in range(args.trials):
        lost, acked = trial(args.threads, args.seconds)
        print(f"trial {n + 1}: {lost} of {acked} acknowledged enqueues lost")


if __name__ == "__main__":
    main()
