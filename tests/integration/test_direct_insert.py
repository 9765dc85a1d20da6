"""enqueue's own transaction on the driver's connection (``outbox.store.direct``) writes
exactly the row the SQLAlchemy path writes, keeps enqueue's answers for a key already
stored, and steps aside when something observes the engine's statements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import event, select

from outbox import Endpoint, OperationConflict, Outbox
from outbox.clock import FakeClock
from outbox.store.tables import operations

NOW_MS = 1_767_000_000_000


@pytest.fixture
def ob(db_url: str) -> Iterator[Outbox]:
    outbox = Outbox(db_url, endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9",
                                               tenant_header="X-Tenant")],
                    clock=FakeClock(NOW_MS), auto_migrate=True)  # fmt: skip
    yield outbox
    outbox.close()


def _enqueue(ob: Outbox, op_id: str, body: Any, **kwargs: Any) -> Any:
    return ob.enqueue(endpoint="rx", method="POST", path="/orders", json=body,
                      headers={"X-Trace": "t-1"}, operation_id=op_id, tenant="acme",
                      ordering_key="customer-7", **kwargs)  # fmt: skip


def _row(ob: Outbox, op_id: str) -> dict[str, Any]:
    with ob.engine.connect() as conn:
        row = conn.execute(select(operations).where(operations.c.operation_id == op_id)).one()
    return {k: v for k, v in row._mapping.items() if k not in ("id", "operation_id")}


class _Statements:
    """An engine listener, as an SQLAlchemy instrumentation installs one."""

    def __init__(self, ob: Outbox) -> None:
        self.engine = ob.engine
        self.seen: list[str] = []

    def __call__(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.seen.append(statement)

    def __enter__(self) -> _Statements:
        event.listen(self.engine, "before_cursor_execute", self)
        return self

    def __exit__(self, *_: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self)


def test_the_direct_row_is_the_sqlalchemy_row(ob: Outbox) -> None:
    body = {"sku": "A-1", "quantity": 2, "note": "ünïcode", "nested": [1, {"b": None}]}
    direct = _enqueue(ob, "direct-1", body)
    assert ob.store._direct is not None  # taken: nothing observes the statements
    with _Statements(ob) as statements:
        general = _enqueue(ob, "general-1", body)
    assert any("INSERT INTO outbox_operations" in s for s in statements.seen)
    with ob.engine.begin() as conn:
        caller = _enqueue(ob, "caller-1", body, connection=conn)
    assert _row(ob, "direct-1") == _row(ob, "general-1") == _row(ob, "caller-1")
    assert direct.pk < general.pk < caller.pk
    assert ob.get("direct-1", tenant="acme").body == body
    assert (direct.state, direct.created_at_ms, direct.policy) == (
        general.state, general.created_at_ms, general.policy
    )


def test_a_key_already_stored_keeps_enqueues_answers(ob: Outbox) -> None:
    first = _enqueue(ob, "again-1", {"n": 1})
    again = _enqueue(ob, "again-1", {"n": 1})
    assert again.pk == first.pk
    with pytest.raises(OperationConflict):
        _enqueue(ob, "again-1", {"n": 2})
    with ob.engine.connect() as conn:
        rows = conn.execute(
            select(operations.c.body).where(operations.c.operation_id == "again-1")
        ).all()
    assert [r.body for r in rows] == ['{"n":1}']


def test_many_enqueues_each_commit_on_a_pooled_connection(ob: Outbox) -> None:
    ops = [_enqueue(ob, f"many-{i}", {"i": i}) for i in range(50)]
    assert len({op.pk for op in ops}) == 50
    with ob.engine.connect() as conn:
        stored = conn.execute(
            select(operations.c.operation_id).where(operations.c.operation_id.like("many-%"))
        ).all()
    assert len(stored) == 50
