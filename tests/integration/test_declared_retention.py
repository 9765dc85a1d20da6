"""The receiver's declared key retention bounds the retries (issue 26).

A receiver that says how long it keeps keys (``Idempotency-Key-Retention``, as
``outbox.receiver`` does on every answer) is believed over the endpoint's configured
``key_retention``: a retry after a maybe-applied answer is scheduled only while the
receiver still remembers the key. Real HTTP over 127.0.0.1 to a receiver that answers
500 (maybe applied) with or without the header; both databases; time is a FakeClock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from tenacity import wait_fixed

from outbox import Endpoint, FakeClock, Outbox, Reason, RetryPolicy, State


class _Failing(BaseHTTPRequestHandler):
    """500 to everything; declares ``server.retention`` seconds if set."""

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        self.server.requests += 1  # type: ignore[attr-defined]
        self.send_response(500)
        retention = self.server.retention  # type: ignore[attr-defined]
        if retention is not None:
            self.send_header("Idempotency-Key-Retention", str(retention))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[Any]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    srv.requests = 0  # type: ignore[attr-defined]
    srv.retention = None  # type: ignore[attr-defined]
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _outbox(db_url: str, url: str) -> Outbox:
    return Outbox(
        db_url,
        endpoints=[
            Endpoint(
                name="rx",
                base_url=url,
                timeout=2.0,
                retry=RetryPolicy(
                    max_attempts=10, window=timedelta(minutes=30), wait=wait_fixed(60)
                ),
                key_retention=timedelta(hours=1),
                key_retention_margin=timedelta(seconds=30),
            )
        ],
        clock=FakeClock(),
    )


@pytest.mark.parametrize("declared", [None, 3600, 90])
def test_a_declared_retention_shorter_than_the_backoff_ends_the_retries(
    db_url: str, server: Any, declared: int | None
) -> None:
    server.retention = declared
    host, port = server.server_address[:2]
    with _outbox(db_url, f"http://{host}:{port}") as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 1},
                   operation_id="op-1")  # fmt: skip
        ob.dispatch_once()
        op = ob.get("op-1")
        assert server.requests == 1 and len(op.attempts) == 1
        first = op.attempts[0].started_at_ms
        if declared == 90:
            # Kept 90 s, minus the 30 s margin: the 60 s backoff is cut so that the last
            # try starts before the receiver may forget the key (not at first + 60 s).
            assert op.state is State.PENDING
            assert op.next_attempt_at_ms is not None
            assert op.next_attempt_at_ms < first + (90 - 30) * 1000
        else:
            # None declared, or as long as configured: the window allows the full wait.
            assert op.state is State.PENDING
            assert op.next_attempt_at_ms == first + 60_000


def test_a_retry_the_declared_retention_does_not_allow_goes_to_an_operator(
    db_url: str, server: Any
) -> None:
    server.retention = 30  # no longer than the margin: no retry may be sent at all
    host, port = server.server_address[:2]
    with _outbox(db_url, f"http://{host}:{port}") as ob:
        ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"n": 1},
                   operation_id="op-1")  # fmt: skip
        ob.dispatch_once()
        op = ob.get("op-1")
        assert server.requests == 1
        assert op.state is State.UNRESOLVED and op.reason is Reason.OUTCOME_UNKNOWN
