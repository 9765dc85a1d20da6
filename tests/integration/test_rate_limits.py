"""The fleet's rate and in-flight limits, and the throttle 429s teach it, against the
real receiver in its rate-limited mode, on SQLite and PostgreSQL (issue 23, section 2).

Every rate is read from the receiver's own log: its arrivals counted per 1-s bucket of
its own timestamps. In-flight counts come from the outbox's attempt rows (started and
finished times). No assertion waits for timing to cooperate: a dispatcher runs until
the receiver holds every effect (or ``until_empty``), then the records are read.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from tenacity import wait_fixed

from outbox import (
    DispatcherSettings,
    Endpoint,
    FakeClock,
    Intent,
    Outbox,
    Reason,
    RetryPolicy,
    State,
)
from outbox.classify import rate_hint
from outbox.dispatch.limits import PACE, PERIOD, PERMIT_LEASE_MS, Limits
from outbox.testing.receiver import Receiver, ReceiverHandle, RemoteReceiver


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[RemoteReceiver]:
    """The receiver in its own process: its timestamps are not held up by ours."""
    with RemoteReceiver.spawn(tmp_path / "rx.sqlite3", synchronous="OFF") as receiver:
        yield receiver


def _endpoint(url: str, **options: Any) -> Endpoint:
    options.setdefault("retry", RetryPolicy(max_attempts=2, window=timedelta(seconds=2),
                                            wait=wait_fixed(0.2)))  # fmt: skip
    return Endpoint(name="rx", base_url=url, timeout=5.0, key_retention=timedelta(hours=1),
                    **options)  # fmt: skip


def _outbox(db_url: str, endpoint: Endpoint, **kw: Any) -> Outbox:
    settings = DispatcherSettings(concurrency=16, idle_poll_seconds=0.05)
    return Outbox(db_url, endpoints=[endpoint], dispatcher=settings, **kw)


def _enqueue(ob: Outbox, n: int) -> None:
    ob.enqueue_many(
        [Intent("rx", "POST", "/orders", {"n": i}, None, f"op-{i}", "") for i in range(n)]
    )


def _per_second(receiver: ReceiverHandle) -> list[int]:
    """Arrivals per 1-s bucket of the receiver's own clock, in order."""
    counts = Counter(r.arrived_at_ms // 1000 for r in receiver.requests())
    return [counts[s] for s in sorted(counts)]


def _drain(ob: Outbox, receiver: ReceiverHandle, n: int) -> None:
    """Run a dispatcher until the receiver holds ``n`` effects (refused operations are
    retried later: ``until_empty`` would leave them pending)."""
    stop = threading.Event()
    worker = threading.Thread(target=ob.run_dispatcher, kwargs={"stop": stop})
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while receiver.effect_count() < n and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(timeout=60)


def _states(ob: Outbox, n: int) -> Counter[State]:
    return Counter(ob.get(f"op-{i}").state for i in range(n))


# --------------------------------------------------------------------------- declared


def test_a_declared_rate_limit_is_kept_and_nothing_is_refused(
    db_url: str, rx: RemoteReceiver
) -> None:
    rx.faults.rate_limit(25)  # the receiver admits 25/s; the endpoint declares it
    with _outbox(db_url, _endpoint(rx.url, rate_limit=25)) as ob:
        _enqueue(ob, 75)
        _drain(ob, rx, 75)
        assert _states(ob, 75) == {State.SUCCEEDED: 75}
    requests = rx.requests()
    assert len(requests) <= 76  # <= 1.02 requests per operation (here: one at most refused)
    assert max(_per_second(rx)) <= 25 * 1.1


def test_max_in_flight_is_kept_by_two_dispatchers_together(db_url: str, tmp_path: Path) -> None:
    with Receiver(tmp_path / "slow.sqlite3") as slow:
        slow.faults.delay_after_commit(0.05, times=None)  # each answer 50 ms after its effect
        endpoint = _endpoint(slow.url, max_in_flight=3)
        with _outbox(db_url, endpoint) as one, _outbox(db_url, endpoint) as two:
            _enqueue(one, 60)
            other = threading.Thread(target=two.run_dispatcher, kwargs={"until_empty": True})
            other.start()
            one.run_dispatcher(until_empty=True)
            other.join(timeout=120)
            assert _states(one, 60) == {State.SUCCEEDED: 60}
        # The receiver's own record: each request is open from its arrival to at least
        # 50 ms after its effect committed. Never more than 3 at once, across both.
        arrived = {r.key: r.arrived_at_ms for r in slow.requests()}  # one request per key
        spans = [(arrived[e.key], e.created_at_ms + 50) for e in slow.effects()]
    assert len(spans) == len(slow.requests()) == 60
    events = sorted([(s, 1) for s, _ in spans] + [(f, -1) for _, f in spans])
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    assert most <= 3


def test_a_request_on_the_wire_keeps_its_permit_however_late_the_renewals(
    db_url: str,
) -> None:
    # A dispatcher admits requests on its permits for PERMIT_LEASE_MS - PERIOD after the
    # lease began, and one admitted last may stay on the wire for the endpoint's whole
    # timeout. Its renewals can be late (a write lock held, the process stalled): the
    # database must still hold its permit then, or another dispatcher leases it and the
    # receiver has max_in_flight + 1 requests open (seen once, in the test above).
    endpoint = _endpoint("http://127.0.0.1:9", max_in_flight=3)  # timeout 5 s

    async def run_db(fn: Any, **kw: Any) -> Any:
        return fn(**kw)

    async def scenario(ob: Outbox) -> int:
        one = Limits(store=ob.store, endpoints={"rx": endpoint}, owner="d1",
                     clock=ob.clock, run_db=run_db, log=None)  # fmt: skip
        leased_at = time.time_ns() // 1_000_000
        for _ in range(3):
            assert await one.admit(endpoint)
        # No await from here on, so d1's renewals (every PERIOD) never run: stalled. A
        # request admitted on these permits as late as they admit is on the wire until:
        on_the_wire_until = leased_at + PERMIT_LEASE_MS - int(PERIOD * 1000) + 5_000
        got = ob.store.lease_slots(name="rx", owner="d2", now_ms=on_the_wire_until - 1,
                                   want=3, limit=3, lease_ms=3_000)  # fmt: skip
        await one.close()
        return int(got)

    with _outbox(db_url, endpoint) as ob:
        assert asyncio.run(scenario(ob)) == 0


def test_requests_waiting_for_permits_ask_the_database_together_not_each(
    db_url: str,
) -> None:
    # Another dispatcher holds every permit. Twenty requests wait here: they must ask for
    # permits about once per PACE together (and the renewal once per PERIOD), not each
    # one back to back, a stream of write transactions that kept the SQLite write lock
    # busy and made the renewals late. Then, when the permits come free, three go.
    endpoint = _endpoint("http://127.0.0.1:9", max_in_flight=3)
    leases = 0

    async def run_db(fn: Any, **kw: Any) -> Any:
        nonlocal leases
        leases += fn.__name__ == "lease_slots"
        return fn(**kw)

    async def scenario(ob: Outbox) -> tuple[int, float, int]:
        held = ob.store.lease_slots(name="rx", owner="d2", now_ms=time.time_ns() // 1_000_000,
                                    want=3, limit=3, lease_ms=60_000)  # fmt: skip
        assert held == 3
        one = Limits(store=ob.store, endpoints={"rx": endpoint}, owner="d1",
                     clock=ob.clock, run_db=run_db, log=None)  # fmt: skip
        started = time.monotonic()
        waiters = [asyncio.create_task(one.admit(endpoint)) for _ in range(20)]
        await asyncio.sleep(4 * PACE)
        waited, asked = time.monotonic() - started, leases
        assert not any(w.done() for w in waiters)
        ob.store.lease_slots(name="rx", owner="d2", now_ms=time.time_ns() // 1_000_000,
                             want=0, limit=3, lease_ms=0)  # fmt: skip
        deadline = time.monotonic() + 30
        while sum(w.done() for w in waiters) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(2 * PACE)  # a fourth would go now, if it could
        admitted = sum(w.done() for w in waiters)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        await one.close()
        return asked, waited, admitted

    with _outbox(db_url, endpoint) as ob:
        asked, waited, admitted = asyncio.run(scenario(ob))
    # One lease per PACE of the waiters, one renewal per PERIOD, and the first: however
    # long the wait really took (a busy machine stretches it), never one per waiter.
    assert asked <= waited / PACE + waited / PERIOD + 2, (asked, waited)
    assert admitted == 3


# --------------------------------------------------------------------------- throttle


@pytest.mark.parametrize(
    "refusal",
    [
        {"retry_after": "1"},
        # GitHub's primary limit: 403, X-RateLimit-Remaining: 0, an epoch reset and no
        # Retry-After. Read as a permanent 403, every refused operation ended failed.
        {"retry_after": None, "headers": "github", "status": 403},
    ],
    ids=["429", "github-403"],
)
def test_refusals_past_the_rate_throttle_the_fleet_and_spend_no_attempt(
    db_url: str, rx: RemoteReceiver, refusal: dict[str, Any]
) -> None:
    # No declared limit. max_attempts=2 and a 2 s window: without the throttle's rules
    # operations refused twice, or refused past 2 s, would end unresolved.
    rx.faults.rate_limit(40, **refusal)
    with _outbox(db_url, _endpoint(rx.url)) as ob:
        _enqueue(ob, 200)
        _drain(ob, rx, 200)
        assert _states(ob, 200) == {State.SUCCEEDED: 200}
        assert max(ob.get(f"op-{i}").attempts_counted for i in range(200)) == 1
        [state] = [s for s in ob.store.endpoint_states() if s.name == "rx"]
        assert state.rate is not None  # the fleet's throttle, in the database
    refused = [r for r in rx.requests() if r.outcome == "rate_limited"]
    assert refused  # the first burst found the limit...
    assert {r.status for r in refused} == {refusal.get("status", 429)}
    assert len(refused) < 200 * 0.5  # ...and the throttle stopped hammering it
    assert rx.effect_count() == 200


def test_a_refusal_under_throttle_waits_for_deliver_within_not_the_window(
    db_url: str, tmp_path: Path
) -> None:
    clock = FakeClock()
    policy = RetryPolicy(max_attempts=2, window=timedelta(seconds=5), wait=wait_fixed(1),
                         deliver_within=timedelta(seconds=60))  # fmt: skip
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        receiver.faults.fail_before_work(429, retry_after="1", key="op-0")
        with _outbox(db_url, _endpoint(receiver.url, retry=policy), clock=clock) as ob:
            _enqueue(ob, 1)
            for _ in range(6):  # 6 refusals over 6.6 s: past max_attempts and the window
                ob.dispatch_once()
                op = ob.get("op-0")
                assert op.state is State.PENDING
                assert op.attempts_counted == 0
                clock.advance(1.1)
            assert len(receiver.requests(key="op-0")) == 6
            clock.advance(60)  # past deliver_within: to reconciliation, never applied
            ob.dispatch_once()
            op = ob.get("op-0")
            assert (op.state, op.reason) == (State.UNRESOLVED, Reason.NEVER_DELIVERED)
            assert receiver.effect_count() == 0


@pytest.mark.parametrize("headers", ["ietf", "x-ratelimit"])
def test_the_receivers_rate_fields_size_the_throttle(
    db_url: str, tmp_path: Path, headers: str
) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        receiver.faults.rate_limit(20, headers=headers)
        with _outbox(db_url, _endpoint(receiver.url), clock=FakeClock()) as ob:
            _enqueue(ob, 48)
            rates: list[float | None] = []
            while not any(rates) and len(rates) < 3:  # 16 a claim: the second finds it
                ob.dispatch_once()
                rates = [s.rate for s in ob.store.endpoint_states() if s.name == "rx"]
            assert rates == [20.0]  # what the 429 said, not a guess
            assert any(r.outcome == "rate_limited" for r in receiver.requests())


def test_a_403_without_rate_fields_still_fails_at_once(db_url: str, tmp_path: Path) -> None:
    with Receiver(tmp_path / "rx.sqlite3") as receiver:
        receiver.faults.fail_before_work(403, retry_after=None, times=None, key="op-0")
        with _outbox(db_url, _endpoint(receiver.url)) as ob:
            _enqueue(ob, 1)
            ob.dispatch_once()
            op = ob.get("op-0")
            assert (op.state, op.attempts_total) == (State.FAILED, 1)
            assert all(s.rate is None for s in ob.store.endpoint_states())
        assert len(receiver.requests(key="op-0")) == 1


def test_the_throttle_is_lifted_after_a_quiet_spell(db_url: str, tmp_path: Path) -> None:
    with (
        Receiver(tmp_path / "rx.sqlite3") as receiver,
        _outbox(db_url, _endpoint(receiver.url)) as ob,
    ):
        store, now = ob.store, int(time.time() * 1000)
        store.throttle("rx", now_ms=now - 40_000, initial=10.0, said=None, decrease=0.8,
                       min_rate=1.0, interval_ms=1000, pause_until_ms=None)  # fmt: skip
        [state] = store.endpoint_states()
        assert state.rate == 10.0
        # A second later without a refusal: raised by a step.
        raised = store.recover_rate("rx", now_ms=now - 39_000, seen_changed_at=now - 40_000,
                                    step_fraction=0.1, min_step=1.0, interval_ms=1000,
                                    release_after_ms=30_000)  # fmt: skip
        assert raised == 11.0
        # A stale view (another dispatcher raised it since) changes nothing.
        assert store.recover_rate("rx", now_ms=now, seen_changed_at=now - 40_000,
                                  step_fraction=0.1, min_step=1.0, interval_ms=1000,
                                  release_after_ms=30_000) == 11.0  # fmt: skip
        lifted = store.recover_rate("rx", now_ms=now, seen_changed_at=now - 39_000,
                                    step_fraction=0.1, min_step=1.0, interval_ms=1000,
                                    release_after_ms=30_000)  # fmt: skip
        assert lifted is None
        assert store.endpoint_states()[0].rate is None
        # Refused again, and again half a second later: the next second is not quiet,
        # so it is not raised (the cut waits for its interval, the raise for quiet).
        for at in (now, now + 500):
            store.throttle("rx", now_ms=at, initial=10.0, said=None, decrease=0.8,
                           min_rate=1.0, interval_ms=1000, pause_until_ms=None)  # fmt: skip
        assert store.recover_rate("rx", now_ms=now + 1000, seen_changed_at=now,
                                  step_fraction=0.1, min_step=1.0, interval_ms=1000,
                                  release_after_ms=30_000) == 10.0  # fmt: skip
        # A refusal of a request sent before the rate's last change says nothing of
        # the new rate: ignored (neither a cut nor a refusal that spoils the quiet).
        late = store.throttle("rx", now_ms=now + 2000, initial=10.0, said=None,
                              decrease=0.8, min_rate=1.0, interval_ms=1000,
                              pause_until_ms=None, sent_at_ms=now - 100)  # fmt: skip
        assert (late.rate, late.changed) == (10.0, False)
        assert store.endpoint_states()[0].refused_at == now + 500


def test_budget_slices_of_two_dispatchers_never_overlap(db_url: str, tmp_path: Path) -> None:
    with (
        Receiver(tmp_path / "rx.sqlite3") as receiver,
        _outbox(db_url, _endpoint(receiver.url)) as ob,
    ):
        now = int(time.time() * 1000)
        grants = [
            ob.store.grant_rate("rx", now_ms=now + i, want=5, declared=10.0, horizon_ms=1000)
            for i in range(4)
        ]
    # 10/s: 5 requests are half a second; one after the other, never more than a
    # second ahead (the third finds the horizon full: it is told when to come back).
    spans = [(g.start_us, g.start_us + g.count * 100_000) for g in grants if g.count]
    assert [g.count for g in grants] == [5, 5, 0, 0]
    assert spans[0][1] <= spans[1][0]
    assert grants[2].start_us >= spans[1][1]


def test_rate_fields_are_read_in_their_three_forms() -> None:
    ietf = httpx.Headers({"RateLimit-Policy": '"default";q=100;w=10',
                          "RateLimit": '"default";r=0;t=4'})  # fmt: skip
    assert rate_hint(ietf, 0) == rate_hint(ietf, 0).__class__(10.0, 4.0, 0.0)  # type: ignore[union-attr]
    x = httpx.Headers({"X-RateLimit-Limit": "30", "X-RateLimit-Reset": "1"})
    assert (h := rate_hint(x, 0)) is not None and h.rate == 30.0
    older = httpx.Headers({"RateLimit-Limit": "60", "RateLimit-Reset": "2"})
    assert (h := rate_hint(older, 0)) is not None and h.rate == 30.0 and h.reset_seconds == 2
    assert rate_hint(httpx.Headers({"Retry-After": "1"}), 0) is None
    assert rate_hint(httpx.Headers({"X-RateLimit-Limit": "soon"}), 0) is None


def test_rate_fields_say_whether_the_budget_is_used_up() -> None:
    def hint(fields: dict[str, str]) -> Any:
        return rate_hint(httpx.Headers(fields), 0)

    assert hint({"RateLimit": '"default";r=0;t=4'}).exhausted
    assert not hint({"RateLimit": '"default";r=12;t=4'}).exhausted
    assert hint({"X-RateLimit-Limit": "30", "X-RateLimit-Remaining": "0"}).exhausted
    gateway = {"RateLimit-Limit": "100", "RateLimit-Remaining": "97", "RateLimit-Reset": "42"}
    assert hint(gateway).remaining == 97 and not hint(gateway).exhausted
    assert not hint({"X-RateLimit-Limit": "30"}).exhausted  # says nothing of what is left


def test_bad_limits_are_refused_at_configuration() -> None:
    from outbox.errors import ConfigurationError

    for bad in ({"rate_limit": 0}, {"rate_limit": float("nan")}, {"max_in_flight": 0},
                {"max_in_flight": 1.5}, {"rate_limit": True}):  # fmt: skip
        with pytest.raises(ConfigurationError):
            _endpoint("http://127.0.0.1:9", **bad)


# --------------------------------------------------------------------------- processes

OUTBOX_CLI = [sys.executable, "-m", "outbox"]


def test_three_dispatcher_processes_share_one_declared_limit(
    pg_url: str, rx: RemoteReceiver
) -> None:
    from outbox.store.engine import create_engine
    from outbox.store.migrate import upgrade

    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    rx.faults.rate_limit(30)  # the receiver admits what the endpoint declares
    with _outbox(pg_url, _endpoint(rx.url, rate_limit=30)) as ob:
        _enqueue(ob, 150)
    env = {**os.environ, "OUTBOX_TEST_DB": pg_url, "OUTBOX_TEST_RECEIVER_URL": rx.url,
           "OUTBOX_TEST_RATE_LIMIT": "30"}  # fmt: skip
    argv = [*OUTBOX_CLI, "--app", "tests.support.limits_app:outbox", "--log-level", "error",
            "dispatch"]  # fmt: skip
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL) for _ in range(3)]
    try:
        deadline = time.monotonic() + 120
        while rx.effect_count() < 150 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert rx.effect_count() == 150
    per_second = _per_second(rx)
    assert max(per_second) <= 30 * 1.1, per_second
    assert len(rx.requests()) <= 153  # <= 1.02 requests per operation
    with _outbox(pg_url, _endpoint(rx.url, rate_limit=30)) as ob:
        assert _states(ob, 150) == {State.SUCCEEDED: 150}


def test_a_throttled_endpoint_is_claimed_no_faster_than_half_a_lease_can_send(
    db_url: str,
) -> None:
    from outbox.dispatch.limits import Limits

    endpoint = _endpoint("http://127.0.0.1:9", rate_limit=2)
    with _outbox(db_url, endpoint) as ob:

        async def run_db(fn: Any, **kw: Any) -> Any:
            return fn(**kw)

        limits = Limits(store=ob.store, endpoints={"rx": endpoint}, owner="d1",
                        clock=ob.clock, run_db=run_db, log=None, lease_seconds=30.0)  # fmt: skip
        # 2 requests/s for half a 30 s lease: 30 operations, not the 100 asked for.
        assert limits.room(100, {}) == 30
        unlimited = _endpoint("http://127.0.0.1:9")
        free = Limits(store=ob.store, endpoints={"rx": unlimited}, owner="d2",
                      clock=ob.clock, run_db=run_db, log=None)  # fmt: skip
        assert free.room(100, {}) == 100
