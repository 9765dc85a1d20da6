"""The dispatcher against a real receiver over 127.0.0.1, on SQLite and PostgreSQL.

Effects are counted in the receiver's own tables; states and attempts in the outbox's.
Time is a FakeClock, so windows and backoff are crossed without sleeping.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from tenacity import wait_fixed

from outbox import (
    Delivery,
    DispatcherSettings,
    Endpoint,
    FakeClock,
    Outbox,
    Reason,
    RetryPolicy,
    State,
)
from outbox.base import logs
from outbox.dispatch import failpoints
from outbox.testing.receiver import Receiver, Refuse

MakeOutbox = Callable[..., Outbox]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path.startswith("/invalid"):
            raise Refuse(400, {"error": "invalid_sku"})
        return 201, {"reserved": body}

    with Receiver(tmp_path / "receiver.sqlite3", handler=handler) as rx:
        yield rx


@pytest.fixture
def make_ob(db_url: str, receiver: Receiver) -> Iterator[MakeOutbox]:
    made: list[Outbox] = []

    def make(
        *,
        base_url: str | None = None,
        timeout: float = 1.0,
        max_attempts: int = 4,
        window: timedelta = timedelta(seconds=60),
        wait: Any = None,
        **endpoint: Any,
    ) -> Outbox:
        retry = RetryPolicy(max_attempts=max_attempts, window=window, wait=wait or wait_fixed(1))
        ob = Outbox(
            db_url,
            endpoints=[
                Endpoint(
                    name="rx",
                    base_url=base_url or receiver.url,
                    timeout=timeout,
                    retry=retry,
                    key_retention=timedelta(hours=1),
                    **endpoint,
                )
            ],
            clock=FakeClock(),
        )
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()


def _clock(ob: Outbox) -> FakeClock:
    assert isinstance(ob.clock, FakeClock)
    return ob.clock


def _enqueue(ob: Outbox, op_id: str, path: str = "/orders", **kw: Any) -> None:
    ob.enqueue(endpoint="rx", method="POST", path=path, json={"op": op_id}, operation_id=op_id,
               **kw)


def test_lost_response_after_commit_is_retried_and_replayed(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    receiver.faults.drop_after_commit(times=1, key="order-1")
    _enqueue(ob, "order-1")

    ob.dispatch_once()
    op = ob.get("order-1")
    assert op.state is State.PENDING
    assert [a.delivery for a in op.attempts] == [Delivery.UNKNOWN]
    assert receiver.effect_count(key="order-1") == 1  # the receiver committed

    _clock(ob).advance(2)
    ob.dispatch_once()
    op = ob.get("order-1")
    assert op.state is State.SUCCEEDED
    seen = receiver.requests(key="order-1")
    assert len(seen) == 2
    assert {r.key for r in seen} == {"order-1"}
    assert [r.request_id for r in seen] == [a.request_id for a in op.attempts]
    assert len({a.request_id for a in op.attempts}) == 2
    assert receiver.effect_count(key="order-1") == 1
    assert op.result is not None
    assert op.result.headers["x-request-id"] == op.attempts[1].request_id
    assert op.result.headers["idempotent-replayed"] == "true"
    assert op.result.body["reserved"] == {"op": "order-1"}


def test_retry_after_is_honoured_then_503_forever_exhausts_retries(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    # The retry policy alone: under the fleet's throttle a 503 spends no attempt
    # (tests/integration/test_rate_limits.py).
    ob = make_ob(max_attempts=3, wait=wait_fixed(0), throttle=None)
    receiver.faults.fail_before_work(503, retry_after="2", key="busy")
    _enqueue(ob, "busy")

    ob.dispatch_once()
    op = ob.get("busy")
    assert op.state is State.PENDING
    assert op.next_attempt_at_ms is not None
    assert op.next_attempt_at_ms - op.attempts[0].started_at_ms >= 2000

    _clock(ob).advance(1)
    assert ob.dispatch_once().claimed == 0  # not before Retry-After
    _clock(ob).advance(1.1)
    assert ob.dispatch_once().attempts == 1
    _clock(ob).advance(2.1)
    ob.dispatch_once()
    op = ob.get("busy")
    assert op.state is State.UNRESOLVED
    assert op.reason is Reason.RETRIES_EXHAUSTED
    assert op.attempts_total == 3
    assert receiver.effect_count(key="busy") == 0
    _clock(ob).advance(60)
    assert ob.dispatch_once().claimed == 0  # never sent again on its own
    assert len(receiver.requests(key="busy")) == 3


def test_retry_after_beyond_the_window_goes_to_reconciliation_now(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(window=timedelta(seconds=10), throttle=None)  # the window, not deliver_within
    receiver.faults.fail_before_work(503, retry_after="3600", key="later")
    _enqueue(ob, "later")
    ob.dispatch_once()
    op = ob.get("later")
    assert op.state is State.UNRESOLVED
    assert op.reason is Reason.RETRIES_EXHAUSTED
    assert len(receiver.requests(key="later")) == 1


def test_receiver_that_never_answers_ends_unresolved_within_the_window(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(timeout=0.3, max_attempts=10, window=timedelta(seconds=5), wait=wait_fixed(2))
    receiver.faults.hang_after_commit(key="slow", replays=True)
    _enqueue(ob, "slow")
    for _ in range(10):
        ob.dispatch_once()
        _clock(ob).advance(2)
    op = ob.get("slow")
    assert op.state is State.UNRESOLVED
    assert op.reason is Reason.OUTCOME_UNKNOWN
    assert all(a.delivery is Delivery.UNKNOWN for a in op.attempts)
    first = op.attempts[0].started_at_ms
    assert all(a.started_at_ms <= first + 5000 for a in op.attempts)  # none after the window
    assert 2 <= len(receiver.requests(key="slow")) <= 10
    assert len(receiver.requests(key="slow")) == op.attempts_total
    assert receiver.effect_count(key="slow") == 1


def test_key_mismatch_is_key_conflict_and_400_is_failed(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    # Someone else already used the key with other arguments.
    httpx.post(f"{receiver.url}/orders", json={"op": "other"}, headers={"Idempotency-Key": "k1"})
    _enqueue(ob, "k1")
    _enqueue(ob, "bad", path="/invalid")
    ob.dispatch_once()
    conflict, bad = ob.get("k1"), ob.get("bad")
    assert (conflict.state, conflict.reason) == (State.UNRESOLVED, Reason.KEY_CONFLICT)
    assert conflict.attempts[0].status_code == 422
    assert bad.state is State.FAILED
    assert bad.result is not None
    assert bad.result.status_code == 400
    assert receiver.effect_count(key="k1") == 1  # the other intent's, not ours
    assert json.loads(receiver.effects(key="k1")[0].body) == {"op": "other"}
    assert receiver.effect_count(key="bad") == 0


def test_connection_refused_throughout_is_never_delivered(make_ob: MakeOutbox) -> None:
    ob = make_ob(base_url="http://127.0.0.1:9", max_attempts=3, wait=wait_fixed(1))
    _enqueue(ob, "nowhere")
    for _ in range(4):
        ob.dispatch_once()
        _clock(ob).advance(1.5)
    op = ob.get("nowhere")
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.NEVER_DELIVERED)
    assert [a.delivery for a in op.attempts] == [Delivery.NOT_SENT] * 3


def test_stuck_key_409_spends_no_attempt_but_the_window_bounds_it(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(max_attempts=2, window=timedelta(seconds=8), wait=wait_fixed(1))
    receiver.faults.stuck_in_progress("stuck")
    _enqueue(ob, "stuck")
    for _ in range(12):
        ob.dispatch_once()
        _clock(ob).advance(1)
    op = ob.get("stuck")
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.OUTCOME_UNKNOWN)
    assert op.attempts_total > 2  # more than max_attempts: 409s do not count
    assert all(not a.counted for a in op.attempts)
    assert all(a.status_code == 409 for a in op.attempts)


def test_ordering_key_holds_later_operations_until_the_earlier_succeeds(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob(wait=wait_fixed(0))
    receiver.faults.fail_before_work(503, retry_after="1", times=1, key="A")
    _enqueue(ob, "A", ordering_key="cust-9")
    _enqueue(ob, "B", ordering_key="cust-9")
    _enqueue(ob, "C")  # no ordering key: not held
    ob.dispatch_once()
    assert ob.get("A").state is State.PENDING
    assert ob.get("B").attempts_total == 0
    assert ob.get("C").state is State.SUCCEEDED
    assert ob.reconcile.show("B").blocked_by == "A"
    _clock(ob).advance(1.1)
    ob.dispatch_once()  # A succeeds; B may only go in a later claim
    assert ob.get("A").state is State.SUCCEEDED
    ob.dispatch_once()
    assert ob.get("B").state is State.SUCCEEDED
    a_done = receiver.requests(key="A")[-1].seq
    assert receiver.requests(key="B")[0].seq > a_done


def test_tenant_is_sent_and_scopes_keys(make_ob: MakeOutbox, receiver: Receiver) -> None:
    ob = make_ob(tenant_header="X-Tenant")
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={"n": 1}, operation_id="same",
               tenant="acme")
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={"n": 1}, operation_id="same",
               tenant="globex")
    ob.dispatch_once()
    assert ob.get("same", tenant="acme").state is State.SUCCEEDED
    assert ob.get("same", tenant="globex").state is State.SUCCEEDED
    assert sorted(e.tenant for e in receiver.effects(key="same")) == ["acme", "globex"]


def test_outcome_write_carries_the_next_claim(make_ob: MakeOutbox, receiver: Receiver) -> None:
    """With every slot taken the claim loop waits; the transaction that writes the
    outcomes freeing slots also claims for it. Each operation is sent once, recorded once."""
    ob = make_ob()
    for i in range(6):
        _enqueue(ob, f"piped-{i}")
    carried: list[tuple[int, int]] = []
    record_and_claim = ob.store.record_and_claim

    def counting(**kwargs: Any) -> Any:
        written, result = record_and_claim(**kwargs)
        carried.append((len(written), len(result.started)))
        return written, result

    ob.store.record_and_claim = counting  # type: ignore[method-assign]
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=2, batch_size=2))
    summary = asyncio.run(dispatcher.run(until_empty=True))
    assert summary.succeeded == 6
    assert carried and carried[0][0] >= 1 and carried[0][1] >= 1
    assert sum(started for _, started in carried) <= 4  # the first claim took 2
    for i in range(6):
        op = ob.get(f"piped-{i}")
        assert op.state is State.SUCCEEDED and len(op.attempts) == 1
        assert receiver.effect_count(key=f"piped-{i}") == 1


def test_stop_during_a_claim_carried_by_the_outcome_write_drains_it(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    """Stop is requested while the outcome writer's claim is committed but its work not
    yet started: that work still runs and its outcome is written before the dispatcher
    returns. No operation is left leased with an open attempt."""
    ob = make_ob()
    for i in range(3):
        _enqueue(ob, f"stopping-{i}")
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=1, batch_size=1))
    stop = asyncio.Event()
    hits: list[int] = []

    async def stop_at_the_carried_claim(name: str) -> None:
        hits.append(dispatcher.in_flight)
        if len(hits) == 2:  # the first claim is the loop's; the second rides an outcome
            stop.set()
            await asyncio.sleep(0.2)  # the loop sees the stop and starts its drain

    failpoints.register("after_claim", stop_at_the_carried_claim)
    try:
        summary = asyncio.run(dispatcher.run(stop))
    finally:
        failpoints.clear("after_claim")
    assert len(hits) == 2
    assert summary.succeeded == 2
    states = sorted(ob.get(f"stopping-{i}").state.value for i in range(3))
    assert states == ["pending", "succeeded", "succeeded"]
    for i in range(3):
        op = ob.get(f"stopping-{i}")
        assert all(a.delivery is not None for a in op.attempts)
    assert len(receiver.requests()) == 2


def test_a_writer_failing_after_a_carried_claim_does_not_hang_the_stop(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    """The outcome writer's bookkeeping raises after it has carried a claim: the claim's
    work still starts and its reserved slots are given back, so a stop ends (the
    writer's error surfaces from run()) instead of waiting forever for that claim."""
    ob = make_ob()
    for i in range(4):
        _enqueue(ob, f"writer-{i}")
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=1, batch_size=1))
    stop = asyncio.Event()
    claiming: list[int] = []

    async def fail_once(name: str) -> None:
        claiming.append(dispatcher._claiming)
        if len(claiming) == 1:
            stop.set()
            raise RuntimeError("bookkeeping failed after the outcome write")

    async def run() -> None:
        await asyncio.wait_for(dispatcher.run(stop), timeout=60)

    failpoints.register("after_outcome", fail_once)
    try:
        with pytest.raises(RuntimeError, match="bookkeeping failed"):
            asyncio.run(run())
    finally:
        failpoints.clear("after_outcome")
    assert claiming[0] == 1  # the failing batch had carried the next claim
    assert dispatcher._claiming == 0


def test_a_carried_claim_that_fails_to_start_leaves_no_bookkeeping_behind(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    """The outcome writer carries a claim whose accounting then fails: its attempt rows
    are committed (their leases expire and the next claim closes them as unknown), and
    the dispatcher keeps nothing about them in memory."""
    ob = make_ob()
    for i in range(3):
        _enqueue(ob, f"carried-{i}")
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=1, batch_size=1))
    hits: list[str] = []

    async def fail_the_carried_claim(name: str) -> None:
        hits.append(name)
        if len(hits) == 2:  # the first claim is the loop's; the second rides an outcome
            raise RuntimeError("accounting failed after the carried claim")

    failpoints.register("after_claim", fail_the_carried_claim)
    try:
        summary = asyncio.run(dispatcher.run(until_empty=True))
    finally:
        failpoints.clear("after_claim")
    assert len(hits) >= 2
    assert dispatcher._names == {} and dispatcher._lease_ends == {}
    states = [ob.get(f"carried-{i}").state for i in range(3)]
    assert states.count(State.IN_FLIGHT) == 1  # leased, its attempt open, never sent
    assert summary.succeeded == 2 and len(receiver.requests()) == 2


def test_fenced_write_from_a_lost_lease_changes_nothing(make_ob: MakeOutbox) -> None:
    """A claims, its lease expires, B claims; A's late writes match nothing."""
    from outbox.store.records import AttemptOutcome

    ob = make_ob()
    _enqueue(ob, "fenced")
    clock = _clock(ob)
    now = clock.now_ms()
    claimed_a, _ = ob.store.claim(owner="A", token="token-a", now_ms=now, lease_ms=1000, limit=10)
    [started_a] = ob.store.begin_attempts(token="token-a", owner="A", now_ms=now,
                                          lease_until=now + 1000,
                                          request_ids={claimed_a[0].pk: "req-a"})
    clock.advance(2)
    _, recovered = ob.store.claim(owner="B", token="token-b", now_ms=clock.now_ms(),
                                          lease_ms=1000, limit=10)
    assert [r.request_id for r in recovered] == ["req-a"]
    before = ob.get("fenced")
    late = AttemptOutcome(
        pk=started_a.pk, lease_token="token-a", request_id="req-a", delivery=Delivery.SENT,
        verdict=None, counted=True, status_code=201, receiver_request_id=None, error_class=None,
        error_message=None, duration_ms=5, state=State.SUCCEEDED, reason=None,
        next_attempt_at=None, maybe_delivered=True, saw_refusal=False,
    )
    assert ob.store.record_outcomes(now_ms=clock.now_ms(), outcomes=[late]) == set()
    assert ob.store.begin_attempts(token="token-a", owner="A", now_ms=clock.now_ms(),
                                   lease_until=0, request_ids={started_a.pk: "req-a2"}) == []
    after = ob.get("fenced")
    assert after == before
    assert after.state is State.IN_FLIGHT
    assert after.attempts[0].delivery is Delivery.UNKNOWN  # closed by B's claim


def test_logs_carry_ids_but_never_bodies_or_credentials(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    secret = "Bearer sk-live-PLANTED-0451"
    ob = make_ob(auth=lambda: {"Authorization": secret})
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("outbox")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        receiver.faults.drop_after_commit(times=1, key="logged")
        ob.enqueue(endpoint="rx", method="POST", path="/orders",
                   json={"card": "PLANTED-BODY-4242"}, operation_id="logged")
        ob.dispatch_once()
        _clock(ob).advance(2)
        ob.dispatch_once()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    events = {line["event"] for line in lines}
    assert {"attempt_started", "attempt_finished", "retry_scheduled",
            "operation_succeeded"} <= events
    started = [line for line in lines if line["event"] == "attempt_started"]
    assert all(line["operation_id"] == "logged" and line["request_id"] for line in started)
    text = buffer.getvalue()
    assert "PLANTED-BODY-4242" not in text
    assert "sk-live-PLANTED" not in text
    # and the credential did reach the receiver only on the wire, never the database
    assert receiver.effect_count(key="logged") == 1
