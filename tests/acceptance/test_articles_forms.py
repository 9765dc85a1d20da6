"""The article contracts with form bodies against the Stripe-shaped dialect of the test
receiver: one effect per operation across a lost response, the first result kept for a
changed payload under a used key (400 idempotency_error -> key_conflict), and replays
marked Idempotent-Replayed. Effects are read from the receiver's store."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from urllib.parse import parse_qsl

import pytest
from tenacity import wait_fixed

from outbox import Delivery, Endpoint, FakeClock, Operation, Outbox, Reason, RetryPolicy, State
from outbox.testing.receiver import Receiver

CHARGE: dict[str, object] = {"amount": "2000", "currency": "eur", "metadata": {"order": "17"}}


@pytest.fixture
def stripe(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "stripe.sqlite3", dialect="stripe-like") as rx:
        yield rx.start()


def _outbox(url: str, rx: Receiver) -> Outbox:
    endpoint = Endpoint(
        name="stripe", base_url=rx.url, timeout=2.0, key_retention=timedelta(hours=1),
        retry=RetryPolicy(max_attempts=6, window=timedelta(seconds=60), wait=wait_fixed(1)),
    )  # fmt: skip
    return Outbox(url, endpoints=[endpoint], clock=FakeClock())


def _settle(ob: Outbox, op_id: str) -> Operation:
    for _ in range(20):
        ob.dispatch_once()
        op = ob.get(op_id)
        if op.is_settled:
            return op
        assert isinstance(ob.clock, FakeClock)
        ob.clock.advance(1.5)
    raise AssertionError("not settled")


def _charge(ob: Outbox, op_id: str, charge: dict[str, object]) -> None:
    ob.enqueue(endpoint="stripe", method="POST", path="/v1/charges", data=charge,
               form_style="stripe", operation_id=op_id)  # fmt: skip


def test_lost_response_one_form_effect_replay_marked(db_url: str, stripe: Receiver) -> None:
    ob = _outbox(db_url, stripe)
    try:
        stripe.faults.drop_after_commit(times=1)
        _charge(ob, "ch-17", CHARGE)
        ob.dispatch_once()
        assert [a.delivery for a in ob.get("ch-17").attempts] == [Delivery.UNKNOWN]
        op = _settle(ob, "ch-17")
        assert op.state is State.SUCCEEDED
        assert stripe.effect_count() == 1
        [effect] = stripe.effects()
        assert dict(parse_qsl(effect.body)) == {
            "amount": "2000", "currency": "eur", "metadata[order]": "17",
        }  # fmt: skip
        assert op.result is not None
        assert op.result.headers["idempotent-replayed"] == "true"
        assert op.result.body["received"]["amount"] == "2000"
    finally:
        ob.close()


def test_changed_form_under_a_used_key_is_a_key_conflict(
    db_url: str, stripe: Receiver, tmp_path: Path
) -> None:
    first = _outbox(db_url, stripe)
    other = _outbox(f"sqlite:///{tmp_path / 'other.sqlite3'}", stripe)
    try:
        _charge(first, "ch-18", CHARGE)
        assert _settle(first, "ch-18").state is State.SUCCEEDED
        # Only the receiver remembers the key: its payload binding must refuse the change.
        _charge(other, "ch-18", {**CHARGE, "amount": "2001"})
        op = _settle(other, "ch-18")
        assert (op.state, op.reason) == (State.UNRESOLVED, Reason.KEY_CONFLICT)
        assert [a.status_code for a in op.attempts] == [400]
        assert stripe.effect_count() == 1
        [effect] = stripe.effects()
        assert dict(parse_qsl(effect.body))["amount"] == "2000"  # the first result is kept
    finally:
        first.close()
        other.close()
