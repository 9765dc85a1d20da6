"""Rate limiting is not an outage (issue 23): a receiver that answers ``503`` with a
``Retry-After`` or rate-limit fields to what exceeds its rate is pacing us, and the
throttle follows it; the circuit breaker must not read those refusals as the
consecutive failures that open a circuit. A bare ``503`` (an outage) still counts.

A real receiver (its own process, or in this one under a FakeClock), a real dispatcher,
SQLite and PostgreSQL; the circuit is read from ``outbox_endpoints``.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from tenacity import wait_fixed

from outbox import DispatcherSettings, Endpoint, FakeClock, Intent, Outbox, RetryPolicy, State
from outbox.config import CircuitBreaker
from outbox.store.endpoints import Circuit, EndpointState
from outbox.store.tables import endpoint_states as endpoint_table
from outbox.testing.receiver import Receiver, RemoteReceiver


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[RemoteReceiver]:
    with RemoteReceiver.spawn(tmp_path / "rx.sqlite3", synchronous="OFF") as receiver:
        yield receiver


def _outbox(db_url: str, url: str, **kw: Any) -> Outbox:
    endpoint = Endpoint(
        name="rx",
        base_url=url,
        timeout=5.0,
        key_retention=timedelta(hours=1),
        retry=RetryPolicy(max_attempts=3, window=timedelta(seconds=5), wait=wait_fixed(0.2)),
        circuit_breaker=CircuitBreaker(failure_threshold=3, refresh_seconds=0.1),
    )
    settings = DispatcherSettings(concurrency=16, idle_poll_seconds=0.05)
    return Outbox(db_url, endpoints=[endpoint], dispatcher=settings, **kw)


def _enqueue(ob: Outbox, n: int) -> None:
    ob.enqueue_many(
        [Intent("rx", "POST", "/orders", {"n": i}, None, f"op-{i}", "") for i in range(n)]
    )


def _state(ob: Outbox) -> EndpointState | None:
    return next((s for s in ob.store.endpoint_states() if s.name == "rx"), None)


@pytest.mark.parametrize(
    ("retry_after", "headers"), [("1", "none"), (None, "ietf"), (None, "x-ratelimit")]
)
def test_503s_of_a_rate_limiter_throttle_and_never_open_the_circuit(
    db_url: str, rx: RemoteReceiver, retry_after: str | None, headers: str
) -> None:
    rx.faults.rate_limit(40, retry_after=retry_after, headers=headers, status=503)
    n = 160
    with _outbox(db_url, rx.url) as ob:
        _enqueue(ob, n)
        stop = threading.Event()
        worker = threading.Thread(target=ob.run_dispatcher, kwargs={"stop": stop})
        worker.start()
        circuits: set[Circuit] = set()
        try:
            deadline = time.monotonic() + 120
            while rx.effect_count() < n and time.monotonic() < deadline:
                state = _state(ob)
                circuits.add(state.circuit if state is not None else Circuit.CLOSED)
                time.sleep(0.05)
        finally:
            stop.set()
            worker.join(timeout=60)
        assert Counter(ob.get(f"op-{i}").state for i in range(n)) == {State.SUCCEEDED: n}
        state = _state(ob)
        assert state is not None and state.rate is not None  # the throttle took them
        # Never opened (an open and a close would have left their reason on the row).
        assert circuits == {Circuit.CLOSED}
        assert (state.circuit, state.reason, state.failures) == (Circuit.CLOSED, None, 0)
    refused = [r for r in rx.requests() if r.outcome == "rate_limited"]
    assert refused and {r.status for r in refused} == {503}
    assert rx.effect_count() == n


@pytest.mark.parametrize(
    ("retry_after", "opens"), [(None, True), ("1", False)], ids=["bare", "retry-after"]
)
def test_a_bare_503_still_counts_and_one_with_retry_after_does_not(
    db_url: str, tmp_path: Path, retry_after: str | None, opens: bool
) -> None:
    clock = FakeClock()
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        receiver.faults.fail_before_work(503, retry_after=retry_after, times=None)
        with _outbox(db_url, receiver.url, clock=clock) as ob:
            _enqueue(ob, 8)
            for _ in range(4):
                ob.dispatch_once()
                clock.advance(1.5)
            state = _state(ob)
            circuit = state.circuit if state is not None else Circuit.CLOSED
            assert (circuit is Circuit.OPEN) is opens
            assert len(receiver.requests()) >= 8  # every operation was refused at least once
            assert all(ob.get(f"op-{i}").state is State.PENDING for i in range(8))


class _GatewayOverDeadUpstream(BaseHTTPRequestHandler):
    """An API gateway that stamps its rate-limit fields, budget left, on every answer, in
    front of an upstream that is down: 503, no ``Retry-After``."""

    FIELDS = (
        ("RateLimit-Limit", "100"),
        ("RateLimit-Remaining", "97"),
        ("RateLimit-Reset", "42"),
        ("X-RateLimit-Remaining", "97"),
    )

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(503)
        for name, value in self.FIELDS:
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_503_whose_rate_fields_show_budget_left_opens_the_circuit(db_url: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _GatewayOverDeadUpstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    clock = FakeClock()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with _outbox(db_url, url, clock=clock) as ob:
            _enqueue(ob, 8)
            for _ in range(4):
                ob.dispatch_once()
                clock.advance(1.5)
            state = _state(ob)
            assert state is not None and state.circuit is Circuit.OPEN
            assert all(ob.get(f"op-{i}").state is State.PENDING for i in range(8))
            # Its RateLimit-Reset (42 s) with budget left is no wait: the fleet's send
            # schedule (the budget's cursor, wall-clock µs) was not pushed out to it.
            with ob.store.read() as conn:
                cursor = conn.execute(
                    select(endpoint_table.c.rate_cursor_us).where(endpoint_table.c.name == "rx")
                ).scalar()
            assert cursor is None or cursor < (time.time() + 30) * 1_000_000
    finally:
        server.shutdown()
        server.server_close()
