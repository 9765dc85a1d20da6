"""Hostile input at enqueue and at the operator's desk: SQL-shaped identifiers are
refused or stored verbatim; oversized and deeply nested payloads are refused before
any write. On SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect
from sqlalchemy.engine import make_url
from tenacity import wait_fixed

from outbox import (
    Endpoint,
    FakeClock,
    Intent,
    Outbox,
    RetryPolicy,
    State,
    ValidationError,
)
from outbox.testing.receiver import Receiver

SQLISH = [
    "x'; DROP TABLE outbox_operations;--",
    "1 OR 1=1",
    "robert'); DELETE FROM outbox_attempts; --",
    'a"b',
    "x%' OR '1'='1",
    "op\n1",
    "op\x00",
]
#: Allowed by the ID grammar yet SQL-looking: stored and sent verbatim.
SQLISH_BUT_VALID = ["--", "a--b", "x.y:z", "1:OR:1", "drop.table:outbox_operations--"]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    with Receiver(tmp_path / "receiver.sqlite3") as rx:
        yield rx


@pytest.fixture
def ob(db_url: str, receiver: Receiver) -> Iterator[Outbox]:
    outbox = Outbox(
        db_url,
        endpoints=[Endpoint(name="rx", base_url=receiver.url, timeout=1.0, tenant_header="X-Tenant",
                            retry=RetryPolicy(max_attempts=1, window=timedelta(minutes=5),
                                              wait=wait_fixed(1)),
                            key_retention=timedelta(hours=1))],
        clock=FakeClock(),
    )  # fmt: skip
    yield outbox
    outbox.close()


def _tables(ob: Outbox) -> set[str]:
    return set(inspect(ob.engine).get_table_names())


def _fingerprint(ob: Outbox) -> Any:
    """Every row of every outbox table (and, on SQLite, the files' bytes)."""
    from sqlalchemy import select

    from outbox.store.tables import metadata

    with ob.engine.connect() as conn:
        rows = {t.name: conn.execute(select(t)).all() for t in metadata.sorted_tables}
    if ob.engine.dialect.name == "sqlite":
        database = make_url(str(ob.engine.url)).database
        assert database
        files = [Path(database), Path(f"{database}-wal")]
        rows["files"] = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.exists()]  # type: ignore[assignment]
    return rows


@pytest.mark.parametrize("value", SQLISH)
def test_sql_shaped_operation_ids_and_tenants_are_refused(ob: Outbox, value: str) -> None:
    before = _fingerprint(ob)
    with pytest.raises(ValueError):
        ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id=value)
    with pytest.raises(ValueError):
        ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="ok",
                   tenant=value)  # fmt: skip
    with pytest.raises(ValueError):
        ob.get(value)
    assert _fingerprint(ob) == before
    assert {"outbox_operations", "outbox_attempts", "outbox_audit"} <= _tables(ob)


def test_sql_shaped_values_that_are_allowed_are_stored_and_sent_verbatim(
    ob: Outbox, receiver: Receiver
) -> None:
    body = {"note": "'); DROP TABLE outbox_operations; --", "q": "x%' OR '1'='1", "n": "\\'"}
    path = "/items/o'brien;--/x%27"
    headers = {"X-Note": "1' OR '1'='1 -- ;"}
    for op_id in SQLISH_BUT_VALID:
        ob.enqueue(endpoint="rx", method="POST", path=path, json=body, headers=headers,
                   operation_id=op_id, tenant="t--1")  # fmt: skip
    ob.dispatch_once()
    for op_id in SQLISH_BUT_VALID:
        op = ob.get(op_id, tenant="t--1")
        assert (op.operation_id, op.tenant, op.path, op.body) == (op_id, "t--1", path, body)
        assert op.headers == {"x-note": headers["X-Note"]}
        assert op.state is State.SUCCEEDED
        [effect] = receiver.effects(key=op_id, tenant="t--1")
        assert effect.path == path
    assert {"outbox_operations", "outbox_attempts", "outbox_audit"} <= _tables(ob)


def test_sql_shaped_operator_notes_and_names_are_stored_verbatim(
    ob: Outbox, receiver: Receiver
) -> None:
    # A 500 (maybe applied): unresolved at once. A 503 would now wait under the
    # fleet's throttle for deliver_within.
    receiver.faults.fail_before_work(500, retry_after=None, key="to-resolve")
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="to-resolve")
    ob.dispatch_once()
    assert ob.get("to-resolve").state is State.UNRESOLVED
    note = 'checked\'); DROP TABLE outbox_audit; --\n"and" ünïcødé\t\\ %s %(x)s'
    operator = "mallory'); --"
    ob.reconcile.resolve("to-resolve", outcome="failed", note=note, operator=operator)
    [entry] = [a for a in ob.reconcile.show("to-resolve").audit if a.action == "resolve"]
    assert (entry.note, entry.actor) == (note, operator)
    assert {"outbox_operations", "outbox_attempts", "outbox_audit"} <= _tables(ob)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda: {"blob": "x" * (1024 * 1024)}, id="over-1MiB"),
        pytest.param(lambda: ["é" * 1000] * 600, id="over-1MiB-in-utf8-bytes"),
        pytest.param(lambda: _nested(65), id="nested-65"),
        pytest.param(lambda: _nested(200_000), id="nested-200000"),
        pytest.param(lambda: {"n": float("nan")}, id="nan"),
        pytest.param(lambda: {"b": b"bytes"}, id="not-json"),
    ],
)
def test_oversized_or_deep_payloads_are_refused_before_any_write(ob: Outbox, payload: Any) -> None:
    body = payload()
    before = _fingerprint(ob)
    with pytest.raises(ValidationError):
        ob.enqueue(endpoint="rx", method="POST", path="/o", json=body, operation_id="big")
    # A batch with one bad item writes none of them.
    with pytest.raises(ValidationError):
        ob.enqueue_many([
            Intent("rx", "POST", "/o", {"fine": 1}, operation_id="fine-1"),
            Intent("rx", "POST", "/o", body, operation_id="big"),
        ])  # fmt: skip
    assert _fingerprint(ob) == before


def test_the_size_limit_is_inclusive_and_counts_bytes(ob: Outbox) -> None:
    # {"blob":"..."} is 11 bytes of framing around the string.
    at_limit = {"blob": "x" * (1024 * 1024 - 11)}
    ob.enqueue(endpoint="rx", method="POST", path="/o", json=at_limit, operation_id="at-limit")
    assert ob.get("at-limit").body == at_limit
    with pytest.raises(ValidationError):
        ob.enqueue(endpoint="rx", method="POST", path="/o",
                   json={"blob": "x" * (1024 * 1024 - 10)}, operation_id="over")  # fmt: skip
