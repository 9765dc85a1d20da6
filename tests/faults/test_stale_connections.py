"""A pooled PostgreSQL connection cut while it sat in the pool (a server restart, a
failover, a firewall's idle timeout; here: pg_terminate_backend on this test's own
connections, found by application name) never turns into a "not stored" enqueue.

Idle long enough, the connection is pinged when checked out and replaced before use;
used a moment ago, it is found dead by the INSERT, and enqueue writes again on a fresh
connection (no COMMIT was sent, so nothing can have been stored). Which of the two
happens is set by ``liveness.PING_AFTER_IDLE_SECONDS``, not by timing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox import Endpoint, Intent, Outbox
from outbox.store import liveness
from tests.conftest import POSTGRES_URL
from tests.faults.support import outbox_events, terminate_backends

pytestmark = pytest.mark.postgres


@pytest.fixture
def named(pg_url: str) -> Iterator[tuple[Outbox, str]]:
    name = f"outbox-stale-{uuid.uuid4().hex[:8]}"
    url = make_url(pg_url).update_query_dict({"application_name": name})
    ob = Outbox(url.render_as_string(hide_password=False),
                endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")],
                auto_migrate=True)  # fmt: skip
    try:
        yield ob, name
    finally:
        ob.close()


def _stored(ob: Outbox) -> list[str]:
    with ob.engine.connect() as conn:
        return list(conn.execute(text(
            "SELECT operation_id FROM outbox_operations ORDER BY id")).scalars())  # fmt: skip


def test_an_idle_connection_cut_in_the_pool_is_replaced_before_use(
    named: tuple[Outbox, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ob, name = named
    ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="before")
    assert terminate_backends(POSTGRES_URL, name) >= 1  # the pooled connection, idle
    monkeypatch.setattr(liveness, "PING_AFTER_IDLE_SECONDS", 0.0)  # any idle time counts
    with outbox_events() as events:
        ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="after")
    assert _stored(ob) == ["before", "after"]
    assert events.named("enqueue_connection_replaced") == []  # the ping found it first


def test_a_connection_cut_a_moment_ago_is_found_by_the_insert_and_written_again(
    named: tuple[Outbox, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ob, name = named
    ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="before")
    monkeypatch.setattr(liveness, "PING_AFTER_IDLE_SECONDS", 3600.0)  # never pinged
    assert terminate_backends(POSTGRES_URL, name) >= 1
    with outbox_events() as events:
        op = ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="after")
        assert op.operation_id == "after"
        assert _stored(ob) == ["before", "after"]
        assert len(events.named("enqueue_connection_replaced")) == 1
        # A batch too: one statement, written once.
        assert terminate_backends(POSTGRES_URL, name) >= 1
        intents = [Intent("rx", "POST", "/x", {}, operation_id=f"b-{n}") for n in range(3)]
        ob.enqueue_many(intents)
        assert _stored(ob) == ["before", "after", "b-0", "b-1", "b-2"]
        assert len(events.named("enqueue_connection_replaced")) == 2
