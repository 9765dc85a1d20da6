"""Receivers as they really answer, over real HTTP, on SQLite and PostgreSQL.

The receiver's own store (effects, request log) is the oracle; time is a FakeClock, so
backoff and windows are crossed by advancing it. Each test injects one way real
receivers answer: "in progress" forever, a replay sent as 409, a stale version sent as
409, a refusal after an attempt that may have been applied, a classifier that raises,
an operation no dispatcher can send, a window that closes between claim and send.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from tenacity import wait_fixed

from outbox import (
    Classification,
    Delivery,
    Endpoint,
    ErrorClass,
    FakeClock,
    Outbox,
    Reason,
    RetryPolicy,
    State,
    ValidationError,
    Verdict,
)
from outbox.dispatch import failpoints
from outbox.testing.receiver import Receiver, Refuse

BODY = {"sku": "TEST-BOLT", "quantity": 2}


@pytest.fixture
def rx(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as receiver:
        yield receiver


def endpoint(url: str, name: str = "rx", **options: Any) -> Endpoint:
    options.setdefault("key_retention", timedelta(hours=24))
    return Endpoint(name=name, base_url=url, timeout=2.0, **options)


def reserve(ob: Outbox, operation_id: str = "op-1", *, name: str = "rx", **kw: Any) -> None:
    ob.enqueue(endpoint=name, method="POST", path="/reservations", json=BODY,
               operation_id=operation_id, **kw)  # fmt: skip


def drive(ob: Outbox, operation_id: str = "op-1", *, limit: int = 200, tenant: str = "") -> Any:
    """Dispatch, moving the FakeClock to each next attempt, until the operation settles."""
    assert isinstance(ob.clock, FakeClock)
    for _ in range(limit):
        ob.dispatch_once()
        op = ob.get(operation_id, tenant=tenant)
        if op.is_settled:
            return op
        assert op.next_attempt_at_ms is not None
        ob.clock.advance(max(0.0, (op.next_attempt_at_ms - ob.clock.now_ms()) / 1000))
    raise AssertionError(f"{operation_id} not settled after {limit} dispatches")


def count_rows(url: str) -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM outbox_operations")).scalar_one())
    finally:
        engine.dispose()


# --------------------------------------------------------------------------- 409s


def test_in_progress_forever_is_bounded_by_its_budget(db_url: str, rx: Receiver) -> None:
    """Default policy, one-hour window, a receiver answering 409 "in progress" forever:
    the in-progress budget (10) bounds the requests, the backoff grows from one second."""
    rx.faults.stuck_in_progress("op-1")
    with Outbox(db_url, endpoints=[endpoint(rx.url)], clock=FakeClock()) as ob:
        reserve(ob)
        op = drive(ob)
        explanation = ob.reconcile.show("op-1").explanation
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.RECEIVER_BUSY)
    requests = rx.requests(key="op-1")
    budget = RetryPolicy().in_progress_budget
    assert len(requests) == budget == op.attempts_in_progress == op.attempts_total
    assert op.attempts_counted == 0  # "in progress" spends no attempt
    assert all(r.status == 409 for r in requests)
    starts = [a.started_at_ms for a in op.attempts]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    for n, gap in enumerate(gaps, start=1):
        floor = min(2 ** (n - 1), 60) * 1000
        assert floor <= gap <= 2 * floor, (n, gaps)
    assert "still processing" in explanation


def test_a_stale_version_sent_as_409_is_failed(db_url: str, tmp_path: Path) -> None:
    def stale(conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any) -> Any:
        raise Refuse(409, {"error": "version_conflict", "current_version": 7})

    with (
        Receiver(tmp_path / "rx.sqlite3", handler=stale) as receiver,
        Outbox(db_url, endpoints=[endpoint(receiver.url)], clock=FakeClock()) as ob,
    ):
        reserve(ob)
        op = drive(ob)
        assert op.state is State.FAILED
        assert [a.verdict for a in op.attempts] == [Verdict.FAILED]
        assert len(receiver.requests()) == 1
        assert receiver.effect_count() == 0


@pytest.mark.parametrize("declared", [True, False])
def test_a_replay_sent_as_409(db_url: str, tmp_path: Path, declared: bool) -> None:
    """django-idempotency-key's default: a replay is 409 with the original body."""
    options: dict[str, Any] = {"retry": RetryPolicy(in_progress_budget=3)}
    if declared:
        options["replay_status"] = 409
    with (
        Receiver(tmp_path / "rx.sqlite3", dialect="replay-409") as receiver,
        Outbox(db_url, endpoints=[endpoint(receiver.url, **options)], clock=FakeClock()) as ob,
    ):
        receiver.faults.drop_after_commit(times=1)
        reserve(ob)
        op = drive(ob)
        assert receiver.effect_count() == 1
        [effect] = receiver.effects()
        if declared:
            assert op.state is State.SUCCEEDED
            assert op.result is not None and op.result.status_code == 409
            assert op.result.body["effect_id"] == effect.id
            assert len(receiver.requests()) == 2
            assert "replayed" in ob.reconcile.show("op-1").as_dict()["attempts"][1]["description"]
        else:
            # Read as "in progress": bounded by the budget, never a stream of requests.
            assert (op.state, op.reason) == (State.UNRESOLVED, Reason.RECEIVER_BUSY)
            assert len(receiver.requests()) == 1 + 3


def test_a_refusal_after_a_maybe_applied_attempt_is_conflicting_evidence(
    db_url: str, tmp_path: Path
) -> None:
    calls: list[int] = []

    def flaky(conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("database went away")  # 500: may have been applied
        raise Refuse(400, {"error": "invalid_state"})

    policy = RetryPolicy(wait=wait_fixed(1))
    with (
        Receiver(tmp_path / "rx.sqlite3", handler=flaky) as receiver,
        Outbox(db_url, endpoints=[endpoint(receiver.url, retry=policy)], clock=FakeClock()) as ob,
    ):
        reserve(ob)
        op = drive(ob)
        assert (op.state, op.reason) == (State.UNRESOLVED, Reason.CONFLICTING_EVIDENCE)
        assert [a.status_code for a in op.attempts] == [500, 400]
        assert "does not prove" in ob.reconcile.show("op-1").explanation


# --------------------------------------------------------------------------- classifiers


def test_a_classifier_sees_the_read_body_and_one_that_raises_does_not_stall(
    db_url: str, rx: Receiver
) -> None:
    seen: list[Any] = []

    def classify(answer: httpx.Response | BaseException) -> Classification | None:
        if isinstance(answer, httpx.Response):
            seen.append(answer.json())  # the body is already read
            if len(seen) == 1:
                raise KeyError("effect_id")
        return None

    policy = RetryPolicy(wait=wait_fixed(1))
    ep = endpoint(rx.url, retry=policy, classify=classify)
    with Outbox(db_url, endpoints=[ep], clock=FakeClock()) as ob:
        reserve(ob)
        ob.dispatch_once()
        op = ob.get("op-1")
        assert op.state is State.PENDING  # carries on, never held until a lease expires
        [attempt] = op.attempts
        assert attempt.delivery is Delivery.UNKNOWN
        assert attempt.error_class == ErrorClass.CLASSIFIER_FAILED
        assert "KeyError" in (attempt.error_message or "")
        assert attempt.status_code == 201
        op = drive(ob)
    assert op.state is State.SUCCEEDED
    assert rx.effect_count() == 1
    assert [body["effect_id"] for body in seen] == [1, 1]  # the second was a replay


# --------------------------------------------------------------------------- windows


def test_the_last_attempt_starts_before_the_deadline(db_url: str, rx: Receiver) -> None:
    rx.faults.fail_before_work(503, retry_after=None)
    policy = RetryPolicy(window=timedelta(seconds=3), wait=wait_fixed(10))
    # The window bounds refusals outside the fleet's throttle (under it: deliver_within).
    rx_endpoint = endpoint(rx.url, retry=policy, throttle=None)
    with Outbox(db_url, endpoints=[rx_endpoint], clock=FakeClock()) as ob:
        reserve(ob)
        op = drive(ob)
    assert (op.state, op.reason) == (State.UNRESOLVED, Reason.RETRIES_EXHAUSTED)
    first, second = op.attempts
    assert second.started_at_ms < first.started_at_ms + 3000
    assert len(rx.requests()) == 2


def test_a_window_closing_between_claim_and_send_is_named_as_such(
    db_url: str, rx: Receiver
) -> None:
    clock = FakeClock()

    async def close_the_window(point: str) -> None:
        clock.jump_wall(61)  # wall time only: the lease (monotonic) is still fine

    # Never sent, the operation is bounded by its delivery deadline, not by the window.
    policy = RetryPolicy(window=timedelta(seconds=60), deliver_within=timedelta(seconds=60))
    with Outbox(db_url, endpoints=[endpoint(rx.url, retry=policy)], clock=clock) as ob:
        reserve(ob)
        failpoints.register("after_attempt_commit", close_the_window)
        try:
            ob.dispatch_once()
        finally:
            failpoints.clear("after_attempt_commit")
        [attempt] = ob.get("op-1").attempts
        assert attempt.delivery is Delivery.NOT_SENT
        assert attempt.error_class == ErrorClass.WINDOW_CLOSED_BEFORE_SEND
        ob.dispatch_once()
        op = ob.get("op-1")
        assert (op.state, op.reason) == (State.UNRESOLVED, Reason.NEVER_DELIVERED)
        assert "window closed before it could start" in ob.reconcile.show("op-1").as_dict()[
            "attempts"][0]["description"]  # fmt: skip
    assert rx.requests() == []


# --------------------------------------------------------------------------- unsendable


def test_an_operation_naming_an_unregistered_endpoint_says_so_and_ends(
    db_url: str, rx: Receiver
) -> None:
    clock = FakeClock()
    app = Outbox(db_url, endpoints=[endpoint(rx.url, name="ghost")], clock=clock)
    dispatcher = Outbox(db_url, endpoints=[endpoint(rx.url, name="rx")], clock=clock)
    try:
        reserve(app, name="ghost")
        dispatcher.dispatch_once()
        op = app.get("op-1")
        assert op.state is State.PENDING
        assert op.last_error is not None
        assert "'ghost' is not registered in dispatcher" in op.last_error
        report = dispatcher.reconcile.show("op-1")
        assert "no dispatcher could send it" in report.explanation
        assert report.as_dict()["last_error"] == op.last_error
        status = dispatcher.reconcile.status(max_unsendable=0)
        assert status.as_dict()["unsendable"] == 1
        assert any("cannot be sent by any dispatcher" in p for p in status.problems)
        # The CLI's status --check fails on it.
        cli = subprocess.run(
            [sys.executable, "-m", "outbox.cli", "--db", db_url, "status", "--check",
             "--max-pending-age", "100d"],
            check=False, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 1, cli.stdout + cli.stderr
        assert "cannot be sent by any dispatcher" in cli.stdout
        # Its window (the default hour, from the first claim that could not send it).
        clock.advance(3599)
        dispatcher.dispatch_once()
        assert app.get("op-1").state is State.PENDING
        clock.advance(2)
        dispatcher.dispatch_once()
        op = app.get("op-1")
        assert (op.state, op.reason) == (State.UNRESOLVED, Reason.NEVER_DELIVERED)
        [evidence] = op.attempts  # unresolved always carries an attempt as evidence
        assert evidence.delivery is Delivery.NOT_SENT
        assert evidence.error_class == ErrorClass.ENDPOINT_NOT_REGISTERED
        assert "'ghost'" in (evidence.error_message or "")
        explanation = dispatcher.reconcile.show("op-1").explanation
        assert "never sent" in explanation and "'ghost'" in explanation
        assert dispatcher.reconcile.status().as_dict()["unsendable"] == 0
    finally:
        app.close()
        dispatcher.close()
    assert rx.requests() == []


def test_a_stored_tenant_operation_is_never_sent_to_an_unscoped_endpoint(
    db_url: str, rx: Receiver
) -> None:
    """A row written when the endpoint was scoped (or by older code) is not sent once
    the endpoint declares no tenant scope: that is how two tenants share one effect."""
    clock = FakeClock()
    with Outbox(db_url, endpoints=[endpoint(rx.url, tenant_header="X-Tenant")],
                clock=clock) as scoped:  # fmt: skip
        reserve(scoped, tenant="acme")
    with Outbox(db_url, endpoints=[endpoint(rx.url)], clock=clock) as unscoped:
        unscoped.dispatch_once()
        op = unscoped.get("op-1", tenant="acme")
        assert op.state is State.PENDING
        assert "declares no tenant scope" in (op.last_error or "")
    assert rx.requests() == []


# --------------------------------------------------------------------------- enqueue


def test_an_endpoint_key_pattern_is_checked_at_enqueue(db_url: str, rx: Receiver) -> None:
    ep = endpoint(rx.url, key_pattern=r"[A-Za-z0-9_-]{1,64}", tenant_scope="key_prefix")
    with Outbox(db_url, endpoints=[ep], clock=FakeClock()) as ob:
        with pytest.raises(ValidationError, match=r"accepts keys matching.*'order\.17'"):
            reserve(ob, "order.17")
        with pytest.raises(ValidationError, match="'acme/order_17'"):
            reserve(ob, "order_17", tenant="acme")  # the prefixed key has a "/"
        assert count_rows(db_url) == 0
        reserve(ob, "order_17")
        assert drive(ob, "order_17").state is State.SUCCEEDED
    assert [r.key for r in rx.requests()] == ["order_17"]


# --------------------------------------------------------------------------- evidence


def test_a_2xx_body_over_the_limit_keeps_its_type(db_url: str, tmp_path: Path) -> None:
    def big(conn: sqlite3.Connection, tenant: str, method: str, path: str, body: Any) -> Any:
        return 201, {"items": ["x" * 100] * body["quantity"]}

    with (
        Receiver(tmp_path / "rx.sqlite3", handler=big) as receiver,
        Outbox(
            db_url, endpoints=[endpoint(receiver.url, result_body_limit=1024)], clock=FakeClock()
        ) as ob,
    ):
        ob.enqueue(endpoint="rx", method="POST", path="/r", json={"quantity": 2},
                   operation_id="small")  # fmt: skip
        ob.enqueue(endpoint="rx", method="POST", path="/r", json={"quantity": 50},
                   operation_id="large")  # fmt: skip
        small, large = drive(ob, "small"), drive(ob, "large")
        [receipt] = receiver.receipts(key="large")
    assert small.result is not None and small.result.body == {"items": ["x" * 100] * 2}
    assert not small.result.truncated
    assert large.result is not None
    assert large.result.body is None and large.result.truncated
    stored = (receipt.response_body or "").encode()
    assert large.result.body_size == len(stored) > 1024
    assert large.result.body_sha256 == hashlib.sha256(stored).hexdigest()


class _OwnIdHandler(BaseHTTPRequestHandler):
    """A receiver that names its own request ID and marks replays the other way."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Request-ID", self.headers.get("X-Request-ID", ""))
        self.send_header("Request-Id", "req_7Hq2")
        self.send_header("Idempotency-Replayed", "true")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_receiver_request_id_only_when_the_receiver_sent_its_own(db_url: str, rx: Receiver) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _OwnIdHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        own = endpoint(f"http://127.0.0.1:{server.server_port}", name="own")
        with Outbox(db_url, endpoints=[endpoint(rx.url), own], clock=FakeClock()) as ob:
            reserve(ob, "echoing")
            reserve(ob, "naming", name="own")
            echoing, naming = drive(ob, "echoing"), drive(ob, "naming")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert [a.receiver_request_id for a in echoing.attempts] == [None]  # only our echo
    assert [a.receiver_request_id for a in naming.attempts] == ["request-id: req_7Hq2"]
    assert naming.result is not None
    assert naming.result.headers["idempotency-replayed"] == "true"


def test_a_key_prefix_scoped_operation_is_looked_up_by_the_key_it_was_sent(
    db_url: str, rx: Receiver
) -> None:
    from outbox import StatusLookup

    rx.faults.drop_after_commit(times=1)  # applied, the answer lost: unresolved at once
    ep = endpoint(
        rx.url,
        tenant_scope="key_prefix",
        status_lookup=StatusLookup(),
        retry=RetryPolicy(max_attempts=1),
    )
    with Outbox(db_url, endpoints=[ep], clock=FakeClock()) as ob:
        reserve(ob, tenant="acme")
        op = drive(ob, tenant="acme")
        assert op.state is State.SUCCEEDED  # settled by the receiver's answer to the lookup
    lookups = [r for r in rx.requests() if r.outcome == "lookup"]
    assert [r.path for r in lookups] == ["/operations/acme%2Fop-1"]
    assert rx.effect_count() == 1
