"""The fleet's circuit breaker against a real receiver that goes down (a closed port)
and comes back, on SQLite and PostgreSQL. Time is a FakeClock: a receiver down for
twice the retry window takes no sleeping."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select
from tenacity import wait_fixed

from outbox import Delivery, Endpoint, FakeClock, Outbox, Reason, RetryPolicy, State
from outbox.config import CircuitBreaker
from outbox.store.endpoints import Circuit
from outbox.store.tables import attempts
from outbox.testing.receiver import Receiver

WINDOW = timedelta(seconds=10)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 201, {"ok": True}

    with Receiver(tmp_path / "receiver.sqlite3", handler=handler) as rx:
        yield rx


def _outbox(db_url: str, receiver: Receiver, clock: FakeClock) -> Outbox:
    return Outbox(
        db_url,
        endpoints=[
            Endpoint(
                name="rx",
                base_url=receiver.url,
                timeout=1.0,
                retry=RetryPolicy(max_attempts=4, window=WINDOW, wait=wait_fixed(1),
                                  deliver_within=timedelta(minutes=10)),
                key_retention=timedelta(hours=1),
                circuit_breaker=CircuitBreaker(
                    failure_threshold=3, probe_wait=timedelta(seconds=1),
                    probe_max_wait=timedelta(seconds=4), refresh_seconds=0.1,
                ),
            )
        ],
        clock=clock,
    )  # fmt: skip


def _attempt_rows(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(select(func.count()).select_from(attempts)).scalar_one())


def _circuit(ob: Outbox) -> Circuit:
    states = {s.name: s for s in ob.store.endpoint_states()}
    return states["rx"].circuit if "rx" in states else Circuit.CLOSED


def test_outage_of_twice_the_window_ends_without_an_operator(
    db_url: str, receiver: Receiver
) -> None:
    clock = FakeClock()
    ob = _outbox(db_url, receiver, clock)
    receiver.stop()  # down: its port is closed
    ids = [f"op-{i}" for i in range(20)]
    for op_id in ids:
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"op": op_id},
                   operation_id=op_id)  # fmt: skip
    ob.dispatch_once()  # every one refused a connection: the circuit opens
    assert _circuit(ob) is Circuit.OPEN
    first_round = _attempt_rows(ob)
    assert first_round == 20
    runs = probes = 0
    down_for = 0.0
    while down_for < 2 * WINDOW.total_seconds():
        before = _attempt_rows(ob)
        ob.dispatch_once()
        runs += 1
        made = _attempt_rows(ob) - before
        assert made <= 1  # at most the probe
        probes += made
        clock.advance(0.5)
        down_for += 0.5
    # Backoff spaces the probes: far fewer than the claims made meanwhile.
    assert 1 <= probes < runs / 2
    for op_id in ids:
        op = ob.get(op_id)
        assert op.state is State.PENDING  # not in reconciliation: never sent
        assert op.attempts_counted <= 1  # the outage spent no attempts
    receiver.start()  # up again, on the same port
    for _ in range(40):
        ob.dispatch_once()
        if all(ob.get(i).state is State.SUCCEEDED for i in ids):
            break
        clock.advance(0.5)
    assert _circuit(ob) is Circuit.CLOSED
    assert [ob.get(i).state for i in ids] == [State.SUCCEEDED] * 20
    assert all(receiver.effect_count(key=i) == 1 for i in ids)
    sent = [a for i in ids for a in ob.get(i).attempts if a.delivery is not Delivery.NOT_SENT]
    assert len(sent) == 20  # one request per operation once the receiver was back
    ob.close()


def test_a_per_enqueue_deliver_within_ends_its_operation_while_the_others_wait(
    db_url: str, receiver: Receiver
) -> None:
    # The endpoint's policy gives never-sent operations 10 minutes; one operation is
    # given 2 seconds of its own at enqueue (its business deadline).
    clock = FakeClock()
    ob = _outbox(db_url, receiver, clock)
    receiver.stop()  # down: its port is closed, every connection refused
    ids = ["patient-0", "urgent", "patient-1", "patient-2"]
    for op_id in ids:
        own = timedelta(seconds=2) if op_id == "urgent" else None
        ob.enqueue(
            endpoint="rx",
            method="POST",
            path="/orders",
            json={},
            operation_id=op_id,
            deliver_within=own,
        )
    urgent = ob.get("urgent")
    assert urgent.deliver_within_ms == 2000
    ob.dispatch_once()  # all refused: the circuit opens
    assert _circuit(ob) is Circuit.OPEN
    assert ob.get("urgent").state is State.PENDING  # before its deadline
    for _ in range(40):  # 20 s down: ten times the urgent one's deadline
        ob.dispatch_once()
        clock.advance(0.5)
    ended = ob.get("urgent")
    assert (ended.state, ended.reason) == (State.UNRESOLVED, Reason.NEVER_DELIVERED)
    assert ended.updated_at_ms - ended.created_at_ms >= 2000 - 1000  # not before its last try
    assert {a.delivery for a in ended.attempts} == {Delivery.NOT_SENT}
    for op_id in ids:
        if op_id != "urgent":
            op = ob.get(op_id)
            assert op.state is State.PENDING  # the policy's 10 minutes still run
            assert op.deliver_within_ms is None
    receiver.start()  # back: the others are sent, the urgent one is not
    for _ in range(40):
        ob.dispatch_once()
        if all(ob.get(i).state is State.SUCCEEDED for i in ids if i != "urgent"):
            break
        clock.advance(0.5)
    states = {i: ob.get(i).state for i in ids}
    assert states == {i: State.SUCCEEDED for i in ids} | {"urgent": State.UNRESOLVED}
    assert receiver.effect_count(key="urgent") == 0
    ob.close()


def test_the_open_circuit_survives_a_dispatcher_restart(db_url: str, receiver: Receiver) -> None:
    clock = FakeClock()
    ob = _outbox(db_url, receiver, clock)
    receiver.stop()
    for i in range(5):
        ob.enqueue(endpoint="rx", method="POST", path="/o", json={"i": i}, operation_id=f"r{i}")
    ob.dispatch_once()
    assert _circuit(ob) is Circuit.OPEN
    rows = _attempt_rows(ob)
    ob.close()
    receiver.start()
    again = _outbox(db_url, receiver, clock)  # a new process's view: same database
    assert _circuit(again) is Circuit.OPEN
    clock.advance(0.2)  # before the first probe is due: nothing is claimed
    again.dispatch_once()
    assert _attempt_rows(again) == rows
    clock.advance(2)  # the probe is due: one operation goes, succeeds, closes the circuit
    again.dispatch_once()
    assert _attempt_rows(again) == rows + 1
    assert _circuit(again) is Circuit.CLOSED
    again.dispatch_once()
    assert all(again.get(f"r{i}").state is State.SUCCEEDED for i in range(5))
    again.close()


def test_a_paused_endpoint_sends_nothing_and_spends_nothing(
    db_url: str, receiver: Receiver
) -> None:
    clock = FakeClock()
    ob = _outbox(db_url, receiver, clock)
    ob.store.set_paused("rx", paused=True, now_ms=clock.now_ms(), actor="ops", note="maint")
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="p1")
    for _ in range(3):
        ob.dispatch_once()
        clock.advance(5)
    assert _attempt_rows(ob) == 0
    assert receiver.requests() == []
    ob.store.set_paused("rx", paused=False, now_ms=clock.now_ms(), actor="ops", note="done")
    ob.dispatch_once()
    assert ob.get("p1").state is State.SUCCEEDED
    trail = ob.store.audit_trail("@endpoint", "rx")
    assert [(a.action, a.actor) for a in trail] == [("pause", "ops"), ("resume", "ops")]
    ob.close()
