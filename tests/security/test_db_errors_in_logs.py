"""A database error never carries statement parameters into the logs.

The receiver answers with a body holding a planted card number; a TCP proxy in front
of PostgreSQL cuts the connection whenever a statement carries it, so every outcome
write fails mid-statement until the dispatcher gives up (its lease runs out) and logs
the failure with its traceback. The rendered log lines (the CLI's processor chain)
must name the error and never the parameters: engines we create set
``hide_parameters=True``.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from tenacity import wait_fixed

from outbox import DispatcherSettings, Endpoint, Outbox, RetryPolicy, State
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from tests.faults.pgproxy import pg_proxy
from tests.security.support import EchoServer, rendered_logs

CARD = "4111-1111-1111-1111"


@pytest.mark.postgres
def test_failed_outcome_write_logs_no_parameters(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()

    def respond(method: str, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
        return 201, json.dumps({"charged": CARD}).encode()

    with EchoServer(respond) as rx, pg_proxy(pg_url) as proxy, \
            rendered_logs(monkeypatch) as log:  # fmt: skip
        endpoint = Endpoint(name="rx", base_url=rx.url, timeout=1.0,
                            retry=RetryPolicy(window=timedelta(minutes=5), wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))  # fmt: skip
        settings = DispatcherSettings(lease_seconds=3.0, lease_margin_seconds=0.5)
        with Outbox(proxy.url, endpoints=[endpoint], dispatcher=settings) as ob:
            ob.enqueue(endpoint="rx", method="POST", path="/pay", json={"amount": 5},
                       operation_id="pay-1")  # fmt: skip
            proxy.cut_on(CARD.encode(), every=True)
            ob.dispatch_once()
            assert proxy.cut_done.is_set()  # the outcome write was cut mid-statement
            assert ob.get("pay-1").state is State.IN_FLIGHT  # its outcome was not written
        text = log.getvalue()
    events = [json.loads(line) for line in text.splitlines()]
    failed = [e for e in events if e["event"] == "outcome_write_failed"]
    assert len(failed) == 1
    assert "OperationalError" in failed[0]["exception"]  # the traceback is there
    assert any(e["event"] == "outcome_write_retry" for e in events)
    assert CARD not in text
