"""enqueue's own transaction learns its PostgreSQL transaction ID from the INSERT's
RETURNING (no statement of its own): the ID ``outbox.store.commit`` asks
``pg_xact_status`` about after a failed COMMIT must be that transaction's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Connection, text

from outbox import Endpoint, Outbox
from outbox.canonical import CanonicalArgs, canonicalize
from outbox.store import marker
from outbox.store.rows import operation_row

pytestmark = pytest.mark.postgres


@pytest.fixture
def ob(pg_url: str) -> Iterator[Outbox]:
    outbox = Outbox(pg_url, endpoints=[Endpoint(name="rx", base_url="http://127.0.0.1:9")],
                    auto_migrate=True)  # fmt: skip
    yield outbox
    outbox.close()


def _args(n: int) -> CanonicalArgs:
    return canonicalize(endpoint="rx", method="POST", path="/x", json_body={"n": n},
                        headers={}, max_body_bytes=1 << 20)  # fmt: skip


def _current(conn: Connection) -> str:
    return str(conn.execute(text("SELECT pg_current_xact_id()::text")).scalar_one())


def test_the_insert_reports_its_own_transaction(ob: Outbox) -> None:
    with ob.engine.connect() as conn, conn.begin():
        slot = marker.open_slot(conn)
        row = operation_row(tenant="", operation_id="op-1", args=_args(1), ordering_key=None,
                            now_ms=0)  # fmt: skip
        ob.store.insert_operation(conn, row)
        reported = marker.close_slot(slot)
        assert reported is not None and reported == _current(conn)


def test_a_batch_reports_it_and_keys_already_stored_report_nothing(ob: Outbox) -> None:
    rows = [operation_row(tenant="", operation_id=f"m-{n}", args=_args(n), ordering_key=None,
                          now_ms=0) for n in range(3)]  # fmt: skip
    for expect_marker in (True, False):  # the second time every key is stored already
        with ob.engine.connect() as conn, conn.begin():
            slot = marker.open_slot(conn)
            created = ob.store.insert_operations(conn, rows)
            reported = marker.close_slot(slot)
            if expect_marker:
                assert len(created) == 3 and reported == _current(conn)
            else:
                assert created == {} and reported is None


def test_the_callers_connection_gets_no_slot(ob: Outbox) -> None:
    with ob.engine.connect() as conn, conn.begin():
        ob.enqueue(endpoint="rx", method="POST", path="/x", json={}, operation_id="c-1",
                   connection=conn)  # fmt: skip
        assert "outbox_transaction_marker" not in conn.info
