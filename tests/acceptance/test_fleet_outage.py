"""A receiver outage met by a fleet: three real `outbox dispatch` processes on one
database, the receiver down (its port closed) for twice the retry window, then back.

Issue 23's scenario as users run it: nothing goes to an operator, the outage spends
no attempts, the circuit keeps the fleet to its probes, and once the receiver is back
every operation is sent once and succeeds. Asserted on the outbox tables and the
receiver's own store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import Endpoint, Intent, Outbox, State
from outbox.store.tables import attempts
from outbox.testing.receiver import Receiver

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.support.dispatch_app:outbox"
PROCESSES = 3
CONCURRENCY = 8
WINDOW_S = 8.0
#: The attempt timeout: generous, so that a receiver slowed by a busy machine is not
#: taken for a maybe-applied attempt whose window then closes behind the circuit.
TIMEOUT_S = 4.0


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


def _attempt_rows(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one())


def _until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_three_dispatchers_ride_out_an_outage_of_twice_the_window(
    db_url: str, receiver: Receiver
) -> None:
    from outbox.store.endpoints import Circuit

    n = 60
    ob = Outbox(db_url, endpoints=[Endpoint(name="receiver", base_url=receiver.url)])
    env = dict(os.environ, OUTBOX_TEST_DB=db_url, OUTBOX_TEST_RECEIVER_URL=receiver.url,
               OUTBOX_TEST_WINDOW=str(WINDOW_S), OUTBOX_TEST_CONCURRENCY=str(CONCURRENCY),
               OUTBOX_TEST_TIMEOUT=str(TIMEOUT_S))  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        receiver.stop()  # down: its port is closed
        ids = [f"out-{i}" for i in range(n)]
        ob.enqueue_many([Intent("receiver", "POST", "/orders", {"i": i}, None, i) for i in ids])
        cmd = [sys.executable, "-m", "outbox.cli", "--log-level", "warning", "--app", APP,
               "dispatch"]  # fmt: skip
        procs = [
            subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for _ in range(PROCESSES)
        ]  # fmt: skip
        _until(lambda: any(s.circuit is Circuit.OPEN for s in ob.store.endpoint_states()),
               60, "the circuit to open")  # fmt: skip
        opened = time.monotonic()
        while time.monotonic() - opened < 2 * WINDOW_S:  # the outage outlives the window
            time.sleep(0.2)
            assert all(p.poll() is None for p in procs)
        during = _attempt_rows(ob)
        [state] = ob.store.endpoint_states()
        for op_id in ids:
            op = ob.get(op_id)
            assert op.state is State.PENDING, (op_id, op.state, op.reason)  # never sent
            assert op.attempts_counted <= 1  # the outage spent no attempts
        # Before the circuit opened each process saw its first failures (at most about
        # two batches of its slots); after that, the fleet sent nothing but its probes.
        assert during - state.probes <= PROCESSES * 2 * CONCURRENCY, (during, state.probes)
        assert receiver.requests() == []

        receiver.start()  # up again, on the same port
        _until(lambda: all(ob.get(i).state is State.SUCCEEDED for i in ids), 90,
               "every operation to succeed")  # fmt: skip
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
    try:
        assert [s.circuit for s in ob.store.endpoint_states()] == [Circuit.CLOSED]
        assert ob.reconcile.status().counts["unresolved"] == 0  # no operator needed
        assert all(receiver.effect_count(key=i) == 1 for i in ids)
        assert len(receiver.requests()) == n  # one request per operation once it was up
    finally:
        ob.close()
