"""An outcome write that hits a transient database failure is retried, not dropped.

Dropping it is safe (the lease expires, the next claim closes the attempt as unknown
and the receiver replays the retry) but costs a resend and turns a known outcome into
an unknown one. So while the lease holds, the dispatcher retries with backoff.

PostgreSQL: a TCP proxy cuts every connection of the dispatcher while it holds a
response, and refuses new ones until the dispatcher has failed at least twice.
SQLite: another process holds the write lock past the busy timeout.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from tenacity import wait_fixed

from outbox import (
    Delivery,
    DispatcherSettings,
    Endpoint,
    ErrorClass,
    Outbox,
    RetryPolicy,
    State,
)
from outbox.config import CircuitBreaker
from outbox.dispatch import failpoints
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.testing.receiver import Receiver
from tests.faults.pgproxy import PgProxy, pg_proxy
from tests.faults.support import Events, Hold, outbox_events, until
from tests.faults.test_store_faults import WriteLock, _db_path

pytestmark = pytest.mark.slow


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture(autouse=True)
def _no_failpoints() -> Iterator[None]:
    failpoints.clear()
    yield
    failpoints.clear()


def _endpoint(receiver: Receiver) -> Endpoint:
    return Endpoint(name="receiver", base_url=receiver.url, timeout=2.0,
                    retry=RetryPolicy(window=timedelta(minutes=5), wait=wait_fixed(0.1)),
                    key_retention=timedelta(hours=1))  # fmt: skip


def _outbox(url: str, receiver: Receiver) -> Outbox:
    settings = DispatcherSettings(lease_seconds=30.0, idle_poll_seconds=0.05)
    return Outbox(url, endpoints=[_endpoint(receiver)], dispatcher=settings)


class _Running:
    """A dispatcher in thread ``dispatcher-A`` (the thread Hold acts in)."""

    def __init__(self, ob: Outbox) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ob,), name="dispatcher-A")
        self.summary: Any = None
        self.thread.start()

    def _run(self, ob: Outbox) -> None:
        self.summary = ob.run_dispatcher(stop=self.stop)

    def join(self) -> Any:
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive()
        return self.summary


def _events(logs: Events, name: str) -> list[dict[str, Any]]:
    return logs.named(name)


@contextmanager
def _proxied(
    pg_url: str, endpoint: Endpoint, settings: DispatcherSettings
) -> Iterator[tuple[PgProxy, Events, Outbox]]:
    """A migrated PostgreSQL behind a TCP proxy, the logs, and an Outbox through it."""
    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    with pg_proxy(pg_url) as proxy, outbox_events() as logs, Outbox(
        proxy.url, endpoints=[endpoint], dispatcher=settings
    ) as ob:
        yield proxy, logs, ob


def _assert_one_attempt_recorded(ob: Outbox, receiver: Receiver, op_id: str) -> None:
    op = ob.get(op_id)
    assert op.state is State.SUCCEEDED
    (attempt,) = op.attempts  # no LeaseExpired attempt, no resend
    assert attempt.delivery is Delivery.SENT and attempt.status_code == 201
    assert [r.request_id for r in receiver.requests(key=op_id)] == [attempt.request_id]
    assert receiver.effect_count(key=op_id) == 1


@pytest.mark.postgres
def test_postgres_connection_lost_during_the_outcome_write_is_retried(
    pg_url: str, receiver: Receiver
) -> None:
    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    with pg_proxy(pg_url) as proxy, _outbox(proxy.url, receiver) as ob, outbox_events() as logs:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="pg-outcome")  # fmt: skip
        with Hold("after_response") as hold:
            running = _Running(ob)
            assert hold.reached.wait(30)
            proxy.refuse = True
            proxy.cut_all()
            hold.release.set()
            until(lambda: len(_events(logs, "outcome_write_retry")) >= 2, 30, "two retries")
            proxy.refuse = False
            until(lambda: ob.get("pg-outcome").state.is_settled, 30, "the outcome")
        summary = running.join()
        assert summary.succeeded == 1 and summary.fenced == 0
        assert _events(logs, "outcome_write_failed") == []
        _assert_one_attempt_recorded(ob, receiver, "pg-outcome")


def test_sqlite_locked_past_the_busy_timeout_during_the_outcome_write_is_retried(
    sqlite_url: str, receiver: Receiver
) -> None:
    with _outbox(sqlite_url, receiver) as ob, outbox_events() as logs:
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="lite-outcome")  # fmt: skip
        with Hold("after_response") as hold:
            running = _Running(ob)
            assert hold.reached.wait(30)
            with WriteLock(_db_path(sqlite_url)):
                hold.release.set()
                until(lambda: _events(logs, "outcome_write_retry"), 30, "a retry")
            until(lambda: ob.get("lite-outcome").state.is_settled, 30, "the outcome")
        summary = running.join()
        assert summary.succeeded == 1 and summary.fenced == 0
        (retry, *_) = _events(logs, "outcome_write_retry")
        assert "locked" in retry["detail"]
        assert _events(logs, "outcome_write_failed") == []
        _assert_one_attempt_recorded(ob, receiver, "lite-outcome")


@pytest.mark.postgres
def test_outcomes_whose_lost_commit_applied_are_logged_as_applied(
    pg_url: str, receiver: Receiver
) -> None:
    """The COMMIT of the transaction that writes an outcome and carries the next claim
    reaches PostgreSQL, which applies it, but its answer is lost. The outcome written
    alone afterwards finds the lease released; the log and the summary still say what
    the database holds: succeeded, not fenced."""
    endpoint = _endpoint(receiver)
    settings = DispatcherSettings(lease_seconds=15.0, idle_poll_seconds=0.05, concurrency=1,
                                  batch_size=1)  # fmt: skip
    with _proxied(pg_url, endpoint, settings) as (proxy, logs, ob):
        for n in (1, 2):
            ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": n},
                       operation_id=f"lost-commit-{n}")  # fmt: skip
        with Hold("after_response") as hold:
            running = _Running(ob)
            assert hold.reached.wait(30)
            # The outcome write's COMMIT (it carries the claim), not a heartbeat's.
            proxy.arm_commit("forward", after=b"UPDATE outbox_attempts SET finished_at")
            hold.release.set()
            assert proxy.commit_done.wait(30)
            until(lambda: all(ob.get(f"lost-commit-{n}").state.is_settled for n in (1, 2)),
                  60, "both outcomes")  # fmt: skip
        summary = running.join()
        # The claim that COMMIT carried (lost-commit-2) was given back at once, not left
        # to its lease: its first attempt says never sent, none was called maybe applied.
        _assert_given_back_then_sent(ob, receiver, "lost-commit-2")
    assert _events(logs, "outcome_claim_failed"), "the COMMIT was not the combined one"
    assert _events(logs, "outcome_commit_applied")
    assert _events(logs, "write_fenced") == []
    assert summary.fenced == 0 and summary.succeeded == 2
    assert [e["count"] for e in _events(logs, "claim_given_back")] == [1]


def _assert_given_back_then_sent(ob: Outbox, receiver: Receiver, op_id: str) -> None:
    op = ob.get(op_id)
    assert op.state is State.SUCCEEDED and op.attempts_counted == 1
    lost, sent = op.attempts
    assert (lost.delivery, lost.error_class, lost.counted) == (
        Delivery.NOT_SENT, ErrorClass.CLAIM_COMMIT_LOST, False
    )
    assert sent.delivery is Delivery.SENT and sent.status_code == 201
    assert [r.request_id for r in receiver.requests(key=op_id)] == [sent.request_id]


@pytest.mark.postgres
def test_a_claim_whose_lost_commit_applied_is_given_back_not_left_to_its_lease(
    pg_url: str, receiver: Receiver
) -> None:
    """The claim loop's COMMIT (claim and attempt rows) reaches PostgreSQL, which
    applies it, and the answer is lost. The dispatcher finds the claim under its token
    and gives it back as never sent; the operation is sent long before the 60 s lease
    would have expired (the old code waited it out, then recorded LeaseExpired)."""
    settings = DispatcherSettings(lease_seconds=60.0, idle_poll_seconds=0.05)
    with _proxied(pg_url, _endpoint(receiver), settings) as (proxy, logs, ob):
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="lost-claim")  # fmt: skip
        proxy.arm_commit("forward", after=b"INSERT INTO outbox_attempts")
        running = _Running(ob)
        assert proxy.commit_done.wait(30)
        until(lambda: ob.get("lost-claim").state.is_settled, 30, "the outcome, within the lease")
        summary = running.join()
        _assert_given_back_then_sent(ob, receiver, "lost-claim")
    assert [e["count"] for e in _events(logs, "claim_given_back")] == [1]
    assert summary.succeeded == 1 and summary.recovered == 0


@pytest.mark.postgres
def test_a_lost_claim_is_given_back_once_the_database_answers_again(
    pg_url: str, receiver: Receiver
) -> None:
    """The claim's COMMIT is applied, its answer lost, and the database then refuses
    every connection: the give-back cannot read it. It stays pending (no retries that
    hold up the claim loop) and is done by the first claim step after the database
    is back, long before the 60 s lease: the operation is sent once, its first attempt
    never sent."""
    settings = DispatcherSettings(lease_seconds=60.0, idle_poll_seconds=0.05)
    with _proxied(pg_url, _endpoint(receiver), settings) as (proxy, logs, ob):
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="lost-away")  # fmt: skip
        proxy.arm_commit("forward", then_isolate=True, after=b"INSERT INTO outbox_attempts")
        running = _Running(ob)
        assert proxy.commit_done.wait(30)
        # Deferred at least twice: at the failure, and at a later claim step.
        until(lambda: len(_events(logs, "claim_give_back_deferred")) >= 2, 30, "deferred")
        assert _events(logs, "claim_given_back") == []
        proxy.refuse = False
        until(lambda: ob.get("lost-away").state.is_settled, 30, "the outcome, within the lease")
        summary = running.join()
        _assert_given_back_then_sent(ob, receiver, "lost-away")
    assert [e["count"] for e in _events(logs, "claim_given_back")] == [1]
    assert _events(logs, "claim_give_back_abandoned") == []
    assert summary.succeeded == 1 and summary.recovered == 0


@pytest.mark.postgres
def test_a_stop_while_the_database_is_away_does_not_wait_for_a_failed_claim(
    pg_url: str, receiver: Receiver
) -> None:
    """A claim fails (its COMMIT never reaches the server) and the database refuses
    every connection after it. The stop returns without waiting out the claim's 60 s
    lease (the give-back used to retry until about then), and nothing was claimed."""
    settings = DispatcherSettings(lease_seconds=60.0, idle_poll_seconds=0.05,
                                  stop_timeout_seconds=10.0)  # fmt: skip
    with _proxied(pg_url, _endpoint(receiver), settings) as (proxy, logs, ob):
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="stop-away")  # fmt: skip
        proxy.arm_commit("drop", then_isolate=True, after=b"INSERT INTO outbox_attempts")
        running = _Running(ob)
        assert proxy.commit_done.wait(30)  # the claim is failing: stop now
        began = time.monotonic()
        running.join()
        assert time.monotonic() - began < 30, "the stop waited for the failed claim's lease"
        proxy.refuse = False
        op = ob.get("stop-away")
    assert op.state is State.PENDING and op.attempts == ()
    assert receiver.requests(key="stop-away") == []
    assert _events(logs, "claim_given_back") == []


@pytest.mark.postgres
def test_a_probe_whose_lost_commit_applied_gives_back_its_probe_lease_too(
    pg_url: str, receiver: Receiver
) -> None:
    """503s open the circuit and the dispatcher stops. The receiver recovers; the next
    dispatcher's half-open probe has its claim COMMIT applied and its answer lost: the
    operation is given back, and so is the probe lease (it used to hold the circuit
    until the 60 s lease ended), so the next probe, about a second later, sends it and
    closes the circuit."""
    endpoint = dataclasses.replace(_endpoint(receiver), circuit_breaker=CircuitBreaker(
        failure_threshold=3, probe_wait=timedelta(seconds=1),
        probe_max_wait=timedelta(seconds=2), refresh_seconds=0.1,
    ))  # fmt: skip
    settings = DispatcherSettings(lease_seconds=60.0, idle_poll_seconds=0.05)
    receiver.faults.fail_before_work(503, retry_after=None)
    with _proxied(pg_url, endpoint, settings) as (proxy, logs, ob):
        ob.enqueue(endpoint="receiver", method="POST", path="/orders", json={"n": 1},
                   operation_id="lost-probe")  # fmt: skip
        running = _Running(ob)
        until(lambda: _events(logs, "circuit_opened"), 30, "the circuit to open")
        running.join()
        receiver.faults.clear()
        # The circuit is open: only a probe claims (and writes attempt rows).
        proxy.arm_commit("forward", after=b"INSERT INTO outbox_attempts")
        running = _Running(ob)
        assert proxy.commit_done.wait(30)
        until(lambda: ob.get("lost-probe").state.is_settled, 30, "the outcome, within the lease")
        summary = running.join()
        op = ob.get("lost-probe")
    assert op.state is State.SUCCEEDED
    *refused, lost, sent = op.attempts
    assert len(refused) >= 3 and {a.status_code for a in refused} == {503}
    assert (lost.delivery, lost.error_class, lost.counted) == (
        Delivery.NOT_SENT, ErrorClass.CLAIM_COMMIT_LOST, False
    )
    assert sent.delivery is Delivery.SENT and sent.status_code == 201
    assert receiver.effect_count(key="lost-probe") == 1
    assert [e["count"] for e in _events(logs, "claim_given_back")] == [1]
    assert _events(logs, "circuit_closed")
    assert summary.recovered == 0
