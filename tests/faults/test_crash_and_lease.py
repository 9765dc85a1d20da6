"""Dispatcher crashes and lost leases, injected for real: SIGKILL at a named failpoint,
and pauses longer than the lease while a second dispatcher takes over.

Each dispatcher is a subprocess (``tests.support.dispatch_app``); the receiver's own
tables say what arrived and what took effect; the outbox's attempt rows say what the
dispatchers recorded. On SQLite and on PostgreSQL.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox import Delivery, Outbox, State
from outbox.testing.receiver import Receiver
from tests.faults.support import dispatchers, open_outbox, until

pytestmark = pytest.mark.slow


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def ob(db_url: str, receiver: Receiver) -> Iterator[Outbox]:
    outbox = open_outbox(db_url, receiver.url)
    yield outbox
    outbox.close()


def _enqueue(ob: Outbox, op_id: str) -> None:
    ob.enqueue(endpoint="receiver", method="POST", path="/orders",
               json={"operation_id": op_id, "qty": 1}, operation_id=op_id)  # fmt: skip


def _settled(ob: Outbox, op_id: str) -> bool:
    return ob.get(op_id).state.is_settled


def test_kill_between_attempt_commit_and_send(
    db_url: str, ob: Outbox, receiver: Receiver, tmp_path: Path
) -> None:
    """The attempt row is committed, then SIGKILL before a byte leaves: a later claim
    closes it as unknown, the retry sends, one effect."""
    _enqueue(ob, "k-before-send")
    with dispatchers(tmp_path) as start:
        crashed = start(db_url, receiver.url, name="a", failpoint_spec="after_attempt_commit=kill")
        assert crashed.wait(30) == -9
        op = ob.get("k-before-send")
        assert op.state is State.IN_FLIGHT
        assert [a.delivery for a in op.attempts] == [None]  # open: recorded, not closed
        assert receiver.requests(key="k-before-send") == []  # and never sent

        recovering = start(db_url, receiver.url, name="b")
        until(lambda: _settled(ob, "k-before-send"), 30, "recovery")
        recovering.stop()
    op = ob.get("k-before-send")
    assert op.state is State.SUCCEEDED
    first, second = op.attempts
    assert (first.delivery, first.error_class) == (Delivery.UNKNOWN, "LeaseExpired")
    assert second.delivery is Delivery.SENT and second.status_code == 201
    assert [r.request_id for r in receiver.requests(key="k-before-send")] == [second.request_id]
    assert receiver.effect_count(key="k-before-send") == 1


def test_kill_between_response_and_outcome_commit(
    db_url: str, ob: Outbox, receiver: Receiver, tmp_path: Path
) -> None:
    """The receiver applied it and answered; SIGKILL before the outcome commit: the
    retry is replayed by the receiver, one effect, succeeded."""
    _enqueue(ob, "k-after-response")
    with dispatchers(tmp_path) as start:
        crashed = start(db_url, receiver.url, name="a", failpoint_spec="after_response=kill")
        assert crashed.wait(30) == -9
        assert ob.get("k-after-response").state is State.IN_FLIGHT
        assert receiver.effect_count(key="k-after-response") == 1

        recovering = start(db_url, receiver.url, name="b")
        until(lambda: _settled(ob, "k-after-response"), 30, "recovery")
        recovering.stop()
    op = ob.get("k-after-response")
    assert op.state is State.SUCCEEDED
    assert [a.delivery for a in op.attempts] == [Delivery.UNKNOWN, Delivery.SENT]
    seen = receiver.requests(key="k-after-response")
    assert [r.outcome for r in seen] == ["applied", "replayed"]
    assert [r.request_id for r in seen] == [a.request_id for a in op.attempts]
    assert receiver.effect_count(key="k-after-response") == 1
    assert op.result is not None and op.result.headers.get("idempotent-replayed") == "true"


@pytest.mark.parametrize("point", ["after_attempt_commit", "after_response"])
def test_stale_owner_paused_past_its_lease_neither_sends_nor_writes(
    point: str, db_url: str, ob: Outbox, receiver: Receiver, tmp_path: Path
) -> None:
    """A pauses longer than its lease (before the send, or with the response in hand);
    B takes over and finishes; A wakes up: it sends nothing more and writes nothing."""
    op_id = f"stale-{point}"
    _enqueue(ob, op_id)
    lease, pause = 3.0, 7.0
    with dispatchers(tmp_path) as start:
        # Concurrency 1: while its one attempt is paused, A claims nothing else (so it
        # cannot take its own operation back); B is the one that takes over.
        a = start(db_url, receiver.url, name="a", lease=lease, concurrency=1,
                  failpoint_spec=f"{point}=pause:{pause}")  # fmt: skip
        until(lambda: ob.get(op_id).attempts, 20, "A's attempt row")
        b = start(db_url, receiver.url, name="b", lease=lease)
        until(lambda: _settled(ob, op_id), 30, "B to finish")
        done_by_b = ob.get(op_id)
        b.stop()
        # A wakes up (pause ends ~7 s after its claim) and then drains on SIGTERM.
        until(lambda: a.saw("write_fenced"), 30, "A's fenced write")
        a_summary = a.stop()
    final = ob.get(op_id)
    assert final == done_by_b  # A's late write changed nothing
    assert final.state is State.SUCCEEDED
    a_attempt, b_attempt = final.attempts
    assert (a_attempt.delivery, a_attempt.error_class) == (Delivery.UNKNOWN, "LeaseExpired")
    assert b_attempt.delivery is Delivery.SENT
    seen = receiver.requests(key=op_id)
    if point == "after_attempt_commit":
        # A never sent: the only request is B's.
        assert [r.request_id for r in seen] == [b_attempt.request_id]
        assert a_summary is not None and a_summary["lease_check_failed"] == 1
    else:
        # A sent inside its lease; its outcome write came too late and was dropped.
        assert [r.request_id for r in seen] == [a_attempt.request_id, b_attempt.request_id]
        assert [r.outcome for r in seen] == ["applied", "replayed"]
    assert a_summary is not None and a_summary["fenced"] == 1
    assert receiver.effect_count(key=op_id) == 1
