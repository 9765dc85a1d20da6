"""The metrics a crash or a takeover produces, driven deterministically in-process: a
failpoint callback crashes an attempt or lets another dispatcher take the lease at an
exact point, on a FakeClock. Read through the registry, compared with the tables.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy, State
from outbox.dispatch import failpoints
from outbox.testing.receiver import Receiver


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def ob(db_url: str, receiver: Receiver) -> Iterator[Outbox]:
    outbox = Outbox(
        db_url,
        endpoints=[Endpoint(name="rx", base_url=receiver.url, timeout=1.0,
                            retry=RetryPolicy(max_attempts=3, window=timedelta(minutes=5),
                                              wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=FakeClock(),
        auto_migrate=True,
    )  # fmt: skip
    yield outbox
    failpoints.clear()
    outbox.close()


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_a_crashed_attempt_counts_as_a_lease_expiration_then_unknown(
    ob: Outbox, receiver: Receiver
) -> None:
    registry = CollectorRegistry()
    ob.metrics(registry=registry)
    clock = ob.clock
    assert isinstance(clock, FakeClock)

    async def crash(_: str) -> None:
        raise RuntimeError("the process dies here")

    failpoints.register("after_attempt_commit", crash)
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="crashed")
    ob.dispatch_once()  # the attempt row is committed, then the "process" dies
    failpoints.clear()
    assert _value(registry, "outbox_attempts_total", endpoint="rx", delivery="unknown",
                  verdict="none") == 0  # fmt: skip

    clock.advance(ob.dispatcher().lease_seconds + 1)
    ob.dispatch_once()  # claims it again: closes the open attempt, then succeeds
    op = ob.get("crashed")
    assert op.state is State.SUCCEEDED
    assert [(a.delivery, a.error_class) for a in op.attempts] == [
        ("unknown", "LeaseExpired"), ("sent", None)
    ]  # fmt: skip
    assert _value(registry, "outbox_lease_expirations_total", endpoint="rx") == 1
    assert _value(registry, "outbox_attempts_total", endpoint="rx", delivery="unknown",
                  verdict="none") == 1  # fmt: skip
    assert _value(registry, "outbox_attempts_total", endpoint="rx", delivery="sent",
                  verdict="success") == 1  # fmt: skip
    assert _value(registry, "outbox_operations_finished_total", endpoint="rx",
                  state="succeeded", reason="") == 1  # fmt: skip
    # Never sent before the crash: the receiver saw one request.
    assert len(receiver.requests(key="crashed")) == 1


def test_an_outcome_fenced_off_by_a_takeover_is_counted_apart(
    ob: Outbox, receiver: Receiver
) -> None:
    registry = CollectorRegistry()
    ob.metrics(registry=registry)
    clock = ob.clock
    assert isinstance(clock, FakeClock)
    lease_ms = int(ob.dispatcher().lease_seconds * 1000)

    async def take_over(_: str) -> None:
        # The response is in; before its outcome is written, the lease expires and
        # another dispatcher claims the operation.
        clock.advance(lease_ms / 1000 + 1)
        claimed, _recovered = ob.store.claim(
            owner="other", token=str(uuid.uuid4()), now_ms=clock.now_ms(), lease_ms=lease_ms,
            limit=10,
        )  # fmt: skip
        assert [c.operation_id for c in claimed] == ["fenced"]

    failpoints.register("after_response", take_over)
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="fenced")
    summary = ob.dispatch_once()
    assert summary.fenced == 1
    assert _value(registry, "outbox_fenced_writes_total", endpoint="rx") == 1
    # The fenced-off outcome is not an attempt this dispatcher recorded, nor a finish.
    for delivery in ("sent", "unknown", "not_sent"):
        for verdict in ("success", "retry", "none"):
            assert _value(registry, "outbox_attempts_total", endpoint="rx",
                          delivery=delivery, verdict=verdict) == 0  # fmt: skip
    assert ob.get("fenced").state is State.IN_FLIGHT  # the other dispatcher holds it


def test_an_unsendable_operation_ends_with_its_not_sent_evidence_counted(
    db_url: str, receiver: Receiver
) -> None:
    """An operation naming an endpoint no dispatcher registered: when its window closes,
    it is settled with a not-sent attempt as evidence; the counters say the same."""
    clock = FakeClock()
    ghost = Endpoint(name="ghost", base_url=receiver.url, key_retention=timedelta(hours=24))
    app = Outbox(db_url, endpoints=[ghost], clock=clock, auto_migrate=True)
    dispatcher = Outbox(
        db_url, endpoints=[Endpoint(name="rx", base_url=receiver.url)], clock=clock
    )
    registry = CollectorRegistry()
    dispatcher.metrics(registry=registry)
    try:
        app.enqueue(endpoint="ghost", method="POST", path="/o", json={}, operation_id="g-1")
        dispatcher.dispatch_once()
        clock.advance(3601)
        dispatcher.dispatch_once()
        op = app.get("g-1")
        assert (op.state, op.reason) == (State.UNRESOLVED, "never_delivered")
        assert [a.delivery for a in op.attempts] == ["not_sent"]
    finally:
        app.close()
        dispatcher.close()
    assert _value(registry, "outbox_attempts_total", endpoint="ghost", delivery="not_sent",
                  verdict="none") == 1  # fmt: skip
    assert _value(registry, "outbox_operations_finished_total", endpoint="ghost",
                  state="unresolved", reason="never_delivered") == 1  # fmt: skip
    assert receiver.requests() == []
