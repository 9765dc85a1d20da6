"""Leases that survive a clock step, with a really stepped clock.

Each dispatcher is a real ``outbox dispatch`` subprocess (``tests.support.dispatch_app``)
whose clocks are libfaketime's (Debian's ``faketime`` package, by ``LD_PRELOAD``),
following a control file the test rewrites: every process started with the same file
sees the same step at the same moment, as the processes of one host see an NTP step.
The wall clock steps 600 s forward or back while an attempt is on the wire, with the
monotonic clock left alone, as a real step leaves it; on PostgreSQL also a second
dispatcher whose wall and monotonic clocks both jump (a VM resumed on another host): its
whole notion of time jumps, the server's does not.

What must hold: the receiver saw each key once, the first attempt's 2xx is recorded as
succeeded (not ``unknown``/``LeaseExpired``), and nothing claimed the operation again.
See DESIGN-NOTES "Leases that survive a clock step".

No step of these scenarios waits on a fixed delay: the receiver commits and answers at
once, and :class:`HeldAnswers`, a proxy in front of it, keeps chosen answers from the
dispatchers until the test releases them, once what must happen while the attempt is on
the wire has been seen to happen (a dispatcher's start, its claim of another operation).
A loaded machine slows every step down; it cannot reorder them.
"""

from __future__ import annotations

import glob
import http.client
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy import select, update

from outbox import Delivery, FakeClock, Outbox, State
from outbox.canonical import CanonicalArgs
from outbox.store import Store, store_for
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.rows import operation_row
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver
from tests.faults.support import DispatcherProcess, app_endpoint, dispatchers, until

ROOT = Path(__file__).resolve().parents[2]
#: tests/support/faketime/sitecustomize.py: time.sleep without clock_nanosleep.
SHIM_DIR = ROOT / "tests" / "support" / "faketime"
STEP = 600
# The endpoint's timeout bounds how long the test may hold an answer: the longest hold
# (Y, in the backward step) lasts through B's start-up and B's first claim and send, up
# to some 25 s on a loaded 2-core machine. The lease leaves room for a slow start of the
# send after its claim (the lease check sends only with the timeout and a 0.25 s margin
# left: LEASE - TIMEOUT - 0.25 s, else the attempt is given back as LeaseCheckFailed, a
# second attempt these tests do not expect), and it is far shorter than the step, so
# that by a stepped clock a live lease looks long expired.
TIMEOUT, LEASE = 60.0, 120.0


def _libfaketime() -> str:
    for pattern in (
        "/usr/lib/*/faketime/libfaketime.so.1",
        "/usr/lib/faketime/libfaketime.so.1",
        "/usr/local/lib/faketime/libfaketime.so.1",
    ):
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    reason = "libfaketime is not installed (Debian: apt-get install faketime)"
    if os.environ.get("OUTBOX_REQUIRE_FAKETIME"):
        pytest.fail(f"{reason}, and OUTBOX_REQUIRE_FAKETIME is set")
    pytest.skip(f"{reason}; OUTBOX_REQUIRE_FAKETIME=1 makes this a failure")


class SteppedClock:
    """The clocks of every process started with :meth:`env`: libfaketime reads the
    control file at each call (``FAKETIME_NO_CACHE``), so rewriting it steps them all."""

    def __init__(self, path: Path, *, monotonic: bool) -> None:
        self.path, self.monotonic = path, monotonic
        self.lib = _libfaketime()
        self.offset = 0
        self._write()

    def env(self) -> dict[str, str]:
        env = {
            "LD_PRELOAD": self.lib,
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            # File times stay real: with stat() faked too every import reads the file.
            "NO_FAKE_STAT": "1",
        }
        if not self.monotonic:
            env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
            # libfaketime 0.9.10 turns its "monotonic fix" on by itself on this glibc:
            # with the monotonic clock left real, a pthread_cond_timedwait on a
            # CLOCK_MONOTONIC condition variable then times out at once (a 5 ms wait
            # returns in 0.01 ms). CPython waits for the GIL exactly so: the event loop's
            # thread and the database thread hand it to each other without pause, each
            # handover waiting for the scheduler on a busy machine. On a loaded 2-core
            # machine a dispatcher's first claim and send took 2-4 times as long (and 20 s
            # at worst), a CPU-bound thread beside the loop ran 10-30 times slower. Off,
            # timed waits keep their length; with a faked monotonic clock
            # (``monotonic=True``) the fix is needed, and stays.
            env["FAKETIME_FORCE_MONOTONIC_FIX"] = "0"
            env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), str(ROOT)])
        return env

    def step(self, seconds: int) -> None:
        self.offset += seconds
        self._write()

    def _write(self) -> None:
        # Whole or not at all: a reader never sees half a line.
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.offset:+d}\n")
        os.replace(tmp, self.path)


class HeldAnswers:
    """An HTTP proxy in front of the receiver that keeps the answers to chosen keys from
    the dispatchers until the test releases them: the receiver has applied the request
    and answered, the dispatcher is still waiting, for as long as the test needs.

    ``hold(key)`` before the request is sent; ``holding(key)`` once its answer is kept
    (the effect is committed); ``release(key)`` lets it, and any later answer to the
    key, go. Every other request passes straight through."""

    #: Not passed on: hop-by-hop headers, and those written anew on each side.
    _HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer",
                      "transfer-encoding", "upgrade", "host", "content-length", "date",
                      "server"})  # fmt: skip
    #: A held answer goes anyway after this long (a test that failed holding it).
    _LONGEST = 300.0

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._held: dict[str, tuple[threading.Event, threading.Event]] = {}
        relay = self._relay

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the dispatchers' clients use

            def _any(self) -> None:
                relay(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def hold(self, key: str) -> None:
        self._held[key] = (threading.Event(), threading.Event())

    def holding(self, key: str) -> bool:
        return self._held[key][0].is_set()

    def release(self, key: str) -> None:
        self._held[key][1].set()

    def _relay(self, request: BaseHTTPRequestHandler) -> None:
        body = request.rfile.read(int(request.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in self._HOP}
        upstream = http.client.HTTPConnection(*self._upstream, timeout=self._LONGEST)
        try:
            upstream.request(request.command, request.path, body=body, headers=headers)
            answer = upstream.getresponse()
            status, reason, payload = answer.status, answer.reason, answer.read()
            answer_headers = [(k, v) for k, v in answer.getheaders() if k.lower() not in self._HOP]
        finally:
            upstream.close()
        gate = self._held.get(request.headers.get("Idempotency-Key", ""))
        if gate is not None:
            holding, released = gate
            holding.set()
            released.wait(self._LONGEST)
        request.send_response(status, reason)
        for name, value in answer_headers:
            request.send_header(name, value)
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)

    def close(self) -> None:
        for _, released in self._held.values():
            released.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> HeldAnswers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def held(receiver: Receiver) -> Iterator[HeldAnswers]:
    """The dispatchers' way to the receiver (their base URL), holding what it is told."""
    with HeldAnswers(receiver.url) as proxy:
        yield proxy


def _outbox(db_url: str, url: str, *, shifted: int = 0) -> Outbox:
    """The test's own outbox; on SQLite with a clock ``shifted`` seconds from the real
    one, so that what it enqueues is due by the dispatchers' stepped clocks."""
    endpoint = app_endpoint(url, timeout=TIMEOUT)
    clock = None
    if shifted and db_url.startswith("sqlite"):
        clock = FakeClock(start_ms=int(time.time() * 1000) + shifted * 1000)
    return Outbox(db_url, endpoints=[endpoint], clock=clock)


def _enqueue(ob: Outbox, op_id: str, *, priority: int = 0) -> None:
    ob.enqueue(endpoint="receiver", method="POST", path="/orders", priority=priority,
               json={"operation_id": op_id, "qty": 1}, operation_id=op_id)  # fmt: skip


def _start(start: Callable[..., DispatcherProcess], db_url: str, url: str, *,
           clock: SteppedClock, name: str, concurrency: int) -> DispatcherProcess:  # fmt: skip
    process: DispatcherProcess = start(
        db_url, url, name=name, lease=LEASE, timeout=TIMEOUT,
        concurrency=concurrency, failpoints_enabled=False, extra_env=clock.env(),
    )  # fmt: skip
    return process


def _sent_once_and_succeeded(ob: Outbox, receiver: Receiver, op_id: str) -> str:
    """Assert it; the dispatcher id of its one attempt."""
    op = ob.get(op_id)
    assert op.state is State.SUCCEEDED, (op.reason, op.attempts)
    assert len(op.attempts) == 1, op.attempts  # claimed once: none closed as LeaseExpired
    (attempt,) = op.attempts
    assert (attempt.delivery, attempt.status_code, attempt.error_class) == (
        Delivery.SENT, 201, None,
    )  # fmt: skip
    assert [r.request_id for r in receiver.requests(key=op_id)] == [attempt.request_id]
    assert receiver.effect_count(key=op_id) == 1
    return attempt.dispatcher_id


@pytest.mark.slow
def test_a_forward_step_while_on_the_wire_changes_nothing(
    db_url: str, receiver: Receiver, held: HeldAnswers, tmp_path: Path
) -> None:
    """+600 s during the attempt: its own dispatcher's claims after the step (every
    50 ms while it idles) do not take the operation back; its 201 is recorded as
    succeeded. The answer is held until the dispatcher has claimed by its stepped clock:
    the probe, enqueued after the step, is due only by that clock (on SQLite), and the
    claim that takes it (up to 3 rows) finds the held lease expired by that clock."""
    clock = SteppedClock(tmp_path / "faketime.rc", monotonic=False)
    op_id, probe = "forward", "probe"
    held.hold(op_id)
    with _outbox(db_url, held.url) as ob, dispatchers(tmp_path) as start:
        _enqueue(ob, op_id)  # before the start: no enqueue waits on a first, slow claim
        d = _start(start, db_url, held.url, clock=clock, name="a", concurrency=4)
        until(lambda: d.saw("dispatcher_started"), 30, "the dispatcher to start")
        until(lambda: held.holding(op_id), 30, "the attempt at the receiver")
        clock.step(+STEP)
        with _outbox(db_url, held.url, shifted=+STEP) as stepped:
            _enqueue(stepped, probe)
        until(lambda: ob.get(probe).state.is_settled, 30, "a claim by the stepped clock")
        held.release(op_id)
        until(lambda: ob.get(op_id).state.is_settled, 30, "the outcome")
        _sent_once_and_succeeded(ob, receiver, op_id)
        _sent_once_and_succeeded(ob, receiver, probe)
        if db_url.startswith("sqlite"):
            until(lambda: d.saw("clock_stepped"), 15, "the dispatcher to log the step")
        assert d.alive()
        summary = d.stop()
    assert summary is not None and summary["fenced"] == 0


@pytest.mark.slow
def test_a_dispatcher_whose_clocks_jump_takes_no_live_lease_on_postgres(
    db_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    """PostgreSQL judges leases by the server's clock. A holds X on the wire; B, on
    another (simulated) host, has its wall and monotonic clocks jump 600 s (a VM
    resumed): B's claims, every 50 ms, must not take X; A's 201 is recorded."""
    if db_url.startswith("sqlite"):
        pytest.skip("one host shares one monotonic clock: SQLite's case is the step tests")
    a_clock = SteppedClock(tmp_path / "a.rc", monotonic=False)  # never stepped
    b_clock = SteppedClock(tmp_path / "b.rc", monotonic=True)
    op_id = "jumped"
    receiver.faults.delay_after_commit(8.0, times=1, key=op_id)
    with _outbox(db_url, receiver.url) as ob, dispatchers(tmp_path) as start:
        a = _start(start, db_url, receiver.url, clock=a_clock, name="a", concurrency=4)
        _enqueue(ob, op_id)
        until(lambda: receiver.requests(key=op_id), 30, "A's attempt at the receiver")
        b = _start(start, db_url, receiver.url, clock=b_clock, name="b", concurrency=4)
        until(lambda: b.saw("dispatcher_started"), 30, "B to start")
        b_clock.step(+STEP)
        until(lambda: ob.get(op_id).state.is_settled, 30, "the outcome")
        _sent_once_and_succeeded(ob, receiver, op_id)
        (attempt,) = ob.get(op_id).attempts
        assert f":{a.process.pid}:" in attempt.dispatcher_id
        assert a.alive() and b.alive()
        summaries = [a.stop(), b.stop()]
    assert all(s is not None and s["fenced"] == 0 for s in summaries)


@pytest.mark.slow
def test_a_backward_step_changes_nothing_for_either_dispatcher(
    db_url: str, receiver: Receiver, held: HeldAnswers, tmp_path: Path
) -> None:
    """-600 s: A (started before the step) holds Y on the wire; B, started after it,
    claims X while A is busy. A finishes Y and claims again while X is on the wire:
    on SQLite A's clock stands still 600 s above B's, so X's lease looks long gone to
    A; it must not take X. Both 201s are recorded as succeeded."""
    clock = SteppedClock(tmp_path / "faketime.rc", monotonic=False)
    held.hold("y")
    held.hold("x")
    with _outbox(db_url, held.url) as ob, dispatchers(tmp_path) as start:
        _enqueue(ob, "y")
        a = _start(start, db_url, held.url, clock=clock, name="a", concurrency=1)
        until(lambda: a.saw("dispatcher_started"), 30, "A to start")
        until(lambda: held.holding("y"), 30, "Y at the receiver")  # A's one slot is taken
        clock.step(-STEP)
        # Due by the stepped clocks. A has no slot for it: only B, started now, claims it.
        with _outbox(db_url, held.url, shifted=-STEP) as stepped:
            _enqueue(stepped, "x")
        b = _start(start, db_url, held.url, clock=clock, name="b", concurrency=1)
        until(lambda: b.saw("dispatcher_started"), 30, "B to start")
        until(lambda: held.holding("x"), 30, "X at the receiver")
        (x_attempt,) = ob.get("x").attempts
        assert f":{b.process.pid}:" in x_attempt.dispatcher_id, "B is the one holding X"
        # A's next claim, after Y's answer, must be seen before X's answer goes. Z, due
        # by A's standing clock, is for that claim alone (B has no slot; A one): A takes
        # it only if it does not take X, which comes first in the claim's order (Z's
        # priority is lower) if its lease counted as expired.
        with _outbox(db_url, held.url, shifted=-STEP) as stepped:
            _enqueue(stepped, "z", priority=-1)
        held.release("y")
        until(lambda: ob.get("y").state.is_settled, 30, "Y's outcome")
        until(lambda: ob.get("z").state.is_settled, 30, "A's claim with X on the wire")
        held.release("x")
        until(lambda: ob.get("x").state.is_settled, 30, "X's outcome")
        assert a.alive() and b.alive()
        summaries = [a.stop(), b.stop()]
        assert f":{a.process.pid}:" in _sent_once_and_succeeded(ob, receiver, "y")
        assert f":{b.process.pid}:" in _sent_once_and_succeeded(ob, receiver, "x")
        assert f":{a.process.pid}:" in _sent_once_and_succeeded(ob, receiver, "z")
    assert all(s is not None and s["fenced"] == 0 for s in summaries)


# --------------------------------------------------------------------------- the store's rule


def _one_in_flight(store: Store, *, now_ms: int, lease_ms: int) -> None:
    args = CanonicalArgs(endpoint="rx", method="POST", path="/o", headers={},
                         body_json="{}", args_sha256="0" * 64)  # fmt: skip
    row = operation_row(tenant="", operation_id="op", args=args, ordering_key=None,
                        now_ms=now_ms)  # fmt: skip
    with store.write() as conn:
        store.insert_operations(conn, [row])
    (claimed,), _ = store.claim(owner="a", token="A", now_ms=now_ms, lease_ms=lease_ms, limit=1)
    assert claimed.operation_id == "op"


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    engine = create_engine(db_url)
    upgrade(engine)
    yield store_for(engine)
    engine.dispose()


def test_an_expired_lease_longer_than_the_steady_time_is_not_taken(store: Store) -> None:
    """The claim's rule, on both databases: a lease of 30 s, expired by the claimer's
    clock, is taken over only by a clock that has run 30 s or more without a step."""
    t0, lease = 1_800_000_000_000, 30_000
    _one_in_flight(store, now_ms=t0, lease_ms=lease)
    late = t0 + lease + 600_000  # a step of 600 s forward
    claim = dict(owner="b", token="B", now_ms=late, lease_ms=lease, limit=1)
    assert store.claim(**claim, steady_ms=0) == ([], [])
    assert store.claim(**claim, steady_ms=lease - 1) == ([], [])
    (taken,), _ = store.claim(**claim, steady_ms=lease)
    assert taken.operation_id == "op"


def test_postgres_claims_judge_leases_by_the_server_clock(store: Store) -> None:
    """A claimer 600 s ahead of the server takes no live lease with ``server_clock``;
    the lease it writes ends one lease after the server's now, not its own."""
    if store.dialect != "postgresql":
        pytest.skip("SQLite has no server clock")
    server = store.server_time_ms()
    assert server is not None
    lease = 30_000
    _one_in_flight(store, now_ms=server, lease_ms=lease)
    ahead = server + 600_000
    assert store.claim(owner="b", token="B", now_ms=ahead, lease_ms=lease, limit=1,
                       server_clock=True) == ([], [])  # fmt: skip
    with store.write() as conn:  # the lease expires, by the server's clock
        conn.execute(update(operations).values(lease_until=server - 1, next_attempt_at=server - 1))
    behind = server - 600_000  # and a claimer far behind still takes it, and leases it
    (taken,), _ = store.claim(owner="b", token="B", now_ms=behind, lease_ms=lease, limit=1,
                              server_clock=True)  # fmt: skip
    assert taken.operation_id == "op"
    with store.read() as conn:
        (until_ms,) = conn.execute(select(operations.c.lease_until)).one()
    assert server + lease <= until_ms < server + lease + 60_000


def test_a_fresh_once_run_takes_over_the_lease_of_a_dispatcher_that_died(
    sqlite_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    """The steady rule holds back a fresh clock's takeovers, but not of a holder known
    to have exited on this host: ``dispatch --once`` from cron, started after a crash,
    recovers the crashed dispatcher's operation in its one run."""
    lease = 3.0
    with _outbox(sqlite_url, receiver.url) as ob, dispatchers(tmp_path) as start:
        _enqueue(ob, "crashed")
        a = start(sqlite_url, receiver.url, name="a", lease=lease,
                  failpoint_spec="after_attempt_commit=kill")  # fmt: skip
        assert a.wait(30) == -9
        (open_attempt,) = ob.get("crashed").attempts
        until(lambda: time.time() * 1000 > open_attempt.lease_until_ms + 50, 30, "lease's end")
        env = dict(os.environ, OUTBOX_TEST_DB=sqlite_url, OUTBOX_TEST_RECEIVER_URL=receiver.url,
                   OUTBOX_TEST_LEASE=str(lease), PYTHONPATH=str(ROOT))  # fmt: skip
        once = subprocess.run(
            [sys.executable, "-m", "outbox.cli", "--app", "tests.support.dispatch_app:outbox",
             "dispatch", "--once", "--json"],
            cwd=ROOT, env=env, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert once.returncode == 0, once.stderr[-2000:]
        op = ob.get("crashed")
        assert op.state is State.SUCCEEDED, op.attempts
        first, second = op.attempts
        assert (first.delivery, first.error_class) == (Delivery.UNKNOWN, "LeaseExpired")
        assert (second.delivery, second.status_code) == (Delivery.SENT, 201)
    assert receiver.effect_count(key="crashed") == 1
