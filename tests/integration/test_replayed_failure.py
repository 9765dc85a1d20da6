"""A stored 5xx that the receiver replays (issue 24): unresolved at once, not retried.

Stripe and the test receiver keep the first result of a key, a 500 included, and answer
every later request with it, marked ``Idempotent-Replayed: true``. Retrying such an
answer until ``max_attempts`` only replays it again; the operation goes to
reconciliation as ``outcome_unknown`` on the first replay, with the marker in the
evidence. Real receiver over 127.0.0.1, SQLite and PostgreSQL, FakeClock.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from tenacity import wait_fixed

from outbox import Endpoint, ErrorClass, FakeClock, Outbox, Reason, RetryPolicy, State
from outbox.testing.receiver import Receiver


@pytest.fixture(params=["ietf", "stripe-like"])
def receiver(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3", dialect=request.param) as rx:
        yield rx


def _outbox(db_url: str, receiver: Receiver) -> Outbox:
    retry = RetryPolicy(max_attempts=10, window=timedelta(minutes=10), wait=wait_fixed(1))
    endpoint = Endpoint(name="rx", base_url=receiver.url, retry=retry,
                        key_retention=timedelta(hours=1))  # fmt: skip
    return Outbox(db_url, endpoints=[endpoint], clock=FakeClock())


def _run(ob: Outbox, rounds: int) -> None:
    clock = ob.clock
    assert isinstance(clock, FakeClock)
    for _ in range(rounds):
        ob.dispatch_once()
        clock.advance(2)


def test_a_replayed_stored_500_is_outcome_unknown_on_the_first_replay(
    db_url: str, receiver: Receiver
) -> None:
    receiver.faults.fail_after_commit(500, stored=True, key="charge-1")
    ob = _outbox(db_url, receiver)
    try:
        ob.enqueue(endpoint="rx", method="POST", path="/charges", json={"amount": 5},
                   operation_id="charge-1")  # fmt: skip
        _run(ob, 5)
        op = ob.get("charge-1")
        assert op.state is State.UNRESOLVED
        assert op.reason is Reason.OUTCOME_UNKNOWN
        # The first 500 (not a replay) is retried once; its replay ends it.
        assert [a.status_code for a in op.attempts] == [500, 500]
        first, replay = op.attempts
        assert first.error_class is None
        assert replay.error_class == ErrorClass.STORED_FAILURE_REPLAYED
        assert replay.error_message is not None
        assert replay.error_message.startswith("Idempotent-Replayed: true; ")
        # At the receiver: one effect, two requests, the second answered as a replay.
        assert receiver.effect_count(key="charge-1") == 1
        seen = receiver.requests(key="charge-1")
        assert [r.outcome for r in seen] == ["fault:fail_after_commit_stored", "replayed"]
    finally:
        ob.close()


def test_reconcile_show_says_the_stored_failure_is_replayed(
    db_url: str, receiver: Receiver
) -> None:
    receiver.faults.fail_after_commit(500, stored=True, key="charge-2")
    ob = _outbox(db_url, receiver)
    try:
        ob.enqueue(endpoint="rx", method="POST", path="/charges", json={"amount": 7},
                   operation_id="charge-2")  # fmt: skip
        _run(ob, 3)
        assert ob.get("charge-2").reason is Reason.OUTCOME_UNKNOWN
    finally:
        ob.close()
    from outbox.cli import main

    result = CliRunner().invoke(main, ["--db", db_url, "reconcile", "show", "charge-2", "--json"])
    assert result.exit_code == 0, result.output
    shown: dict[str, Any] = json.loads(result.output)
    assert (
        "replayed the 500 it stored for this key (Idempotent-Replayed: true)"
        in (shown["explanation"])
    )
    assert "every retry would get the same answer" in shown["explanation"]
