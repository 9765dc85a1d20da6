"""A COMMIT whose answer is lost: enqueue must not call a stored operation "not stored".

A TCP proxy between the outbox and PostgreSQL acts on the COMMIT message itself: it
passes the COMMIT on and cuts the client off before the answer (the row is committed),
or cuts both sides instead of passing it on (the server rolls back). enqueue reconnects
and asks the database what became of the transaction. With the database unreachable
after the cut, it cannot tell, and says so with StoreOutcomeUnknown.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from outbox import Endpoint, Intent, NotStoredError, Outbox, State, StoreOutcomeUnknown
from outbox.store import commit
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from tests.faults.pgproxy import PgProxy, pg_proxy
from tests.faults.support import outbox_events

pytestmark = pytest.mark.postgres


@pytest.fixture
def migrated(pg_url: str) -> str:
    engine = create_engine(pg_url)
    upgrade(engine)
    engine.dispose()
    return pg_url


@pytest.fixture
def proxy(migrated: str) -> Iterator[PgProxy]:
    with pg_proxy(migrated) as p:
        yield p


@pytest.fixture
def ob(proxy: PgProxy) -> Iterator[Outbox]:
    outbox = Outbox(proxy.url, endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")])
    yield outbox
    outbox.close()


def _rows(url: str) -> list[tuple[str, str]]:
    """(operation ID, state) of every stored operation, read beside the proxy."""
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("SELECT operation_id, state FROM outbox_operations ORDER BY id")
            ).all()
        return [(r[0], r[1]) for r in rows]
    finally:
        engine.dispose()


def _enqueue(ob: Outbox, op_id: str, **kwargs: Any) -> Any:
    return ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"id": op_id},
                      operation_id=op_id, **kwargs)  # fmt: skip


def test_commit_applied_but_answer_lost_is_reported_stored(
    ob: Outbox, proxy: PgProxy, migrated: str
) -> None:
    proxy.arm_commit("forward")
    with outbox_events() as logs:
        op = _enqueue(ob, "lost-answer")
    assert proxy.commit_done.is_set()  # the COMMIT really was cut
    assert op.operation_id == "lost-answer" and op.state is State.PENDING
    assert _rows(migrated) == [("lost-answer", "pending")]
    assert len(logs.named("enqueue_commit_failed")) == 1
    assert logs.named("enqueue_outcome_unknown") == []
    # The caller who enqueues again (same ID) gets the same operation, still one row.
    assert _enqueue(ob, "lost-answer").pk == op.pk
    assert _rows(migrated) == [("lost-answer", "pending")]


def test_commit_never_reaching_the_server_is_reported_not_stored(
    ob: Outbox, proxy: PgProxy, migrated: str
) -> None:
    proxy.arm_commit("drop")
    with pytest.raises(NotStoredError, match="confirms the transaction did not commit"):
        _enqueue(ob, "dropped-commit")
    assert proxy.commit_done.is_set()
    assert _rows(migrated) == []


def test_unreachable_after_a_lost_commit_is_unknown_not_not_stored(
    ob: Outbox, proxy: PgProxy, migrated: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(commit, "COMMIT_CHECK_SECONDS", 1.0)
    # Once the COMMIT is cut, nothing gets through to the database any more.
    proxy.arm_commit("forward", then_isolate=True)
    with pytest.raises(StoreOutcomeUnknown) as caught:
        _enqueue(ob, "unknown-fate")
    assert not isinstance(caught.value, NotStoredError)
    assert "SAME operation ID" in str(caught.value)
    assert caught.value.keys == (("", "unknown-fate"),)
    # It was in fact stored; the advice given is safe: the same ID returns it.
    assert _rows(migrated) == [("unknown-fate", "pending")]
    proxy.refuse = False
    again = _enqueue(ob, "unknown-fate")
    assert again.state is State.PENDING
    assert _rows(migrated) == [("unknown-fate", "pending")]


@pytest.mark.parametrize("action", ["forward", "drop"])
def test_enqueue_many_resolves_a_lost_commit_for_the_whole_batch(
    action: str, ob: Outbox, proxy: PgProxy, migrated: str
) -> None:
    _enqueue(ob, "before")  # already stored: found again, not created by the batch
    batch = [Intent("rx", "POST", "/orders", {"id": f"m{i}"}, operation_id=f"m{i}")
             for i in range(3)] + [Intent("rx", "POST", "/orders", {"id": "before"},
                                          operation_id="before")]  # fmt: skip
    proxy.arm_commit(action)
    if action == "forward":
        ops = ob.enqueue_many(batch)
        assert [op.operation_id for op in ops] == ["m0", "m1", "m2", "before"]
        assert [r[0] for r in _rows(migrated)] == ["before", "m0", "m1", "m2"]
    else:
        with pytest.raises(NotStoredError):
            ob.enqueue_many(batch)
        assert [r[0] for r in _rows(migrated)] == ["before"]
    assert proxy.commit_done.is_set()


def test_failure_before_commit_is_not_stored(ob: Outbox, proxy: PgProxy, migrated: str) -> None:
    """The INSERT itself is cut, on the first connection and on the fresh one enqueue
    tries next: provably nothing stored, no look-up needed."""
    proxy.cut_on(b"cut-at-insert", every=True)
    with outbox_events() as logs, pytest.raises(NotStoredError):
        _enqueue(ob, "cut-at-insert")
    assert proxy.cut_done.is_set()
    assert len(logs.named("enqueue_connection_replaced")) == 1
    assert logs.named("enqueue_commit_failed") == []
    assert _rows(migrated) == []


def test_a_connection_lost_before_commit_is_written_again_once(
    ob: Outbox, proxy: PgProxy, migrated: str
) -> None:
    """The INSERT is cut once: no COMMIT was sent, so nothing can be stored; enqueue
    writes again on a fresh connection and returns the operation, stored once."""
    proxy.cut_on(b"cut-once")
    with outbox_events() as logs:
        op = _enqueue(ob, "cut-once")
    assert proxy.cut_done.is_set()
    assert op.operation_id == "cut-once"
    assert len(logs.named("enqueue_connection_replaced")) == 1
    assert logs.named("enqueue_commit_failed") == []
    assert _rows(migrated) == [("cut-once", "pending")]


def test_a_database_refusing_connections_is_not_stored(
    ob: Outbox, proxy: PgProxy, migrated: str
) -> None:
    """No connection can be made (the server restarting, the network down): the
    enqueue raises NotStoredError, the library's own answer, and nothing is stored."""
    ob.engine.dispose()  # the next enqueue needs a new connection
    proxy.refuse = True
    with pytest.raises(NotStoredError):
        _enqueue(ob, "refused")
    with pytest.raises(NotStoredError):
        ob.enqueue_many([Intent("rx", "POST", "/orders", {"id": "r2"}, operation_id="r2")])
    proxy.refuse = False
    assert _rows(migrated) == []

