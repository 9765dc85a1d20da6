"""enqueue and get on a real SQLite file and a real PostgreSQL schema.

Effects are checked in the tables themselves (plain SQLAlchemy on a separate engine),
never only through the API's return values.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import outbox
from outbox import (
    Endpoint,
    Operation,
    OperationConflict,
    OperationNotFound,
    Outbox,
    State,
    ValidationError,
)

INVENTORY = Endpoint(
    name="inventory", base_url="https://inventory.example", tenant_header="X-Tenant"
)
BILLING = Endpoint(name="billing", base_url="https://billing.example", tenant_header="X-Tenant")

ARGS: dict[str, Any] = {
    "endpoint": "inventory",
    "method": "POST",
    "path": "/reservations",
    "json": {"sku": "TEST-BOLT", "quantity": 2},
    "headers": {"X-Trace": "t-1"},
    "operation_id": "order-17-reserve",
    "tenant": "acme",
}

OPS = sa.table(
    "outbox_operations",
    sa.column("id"),
    sa.column("tenant"),
    sa.column("operation_id"),
    sa.column("endpoint"),
    sa.column("method"),
    sa.column("path"),
    sa.column("headers"),
    sa.column("body"),
    sa.column("args_sha256"),
    sa.column("state"),
    sa.column("version"),
    sa.column("updated_at"),
)


def count(url: str, table: str = "outbox_operations") -> int:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return int(
                conn.execute(sa.select(sa.func.count()).select_from(sa.table(table))).scalar_one()
            )
    finally:
        engine.dispose()


def stored(url: str) -> list[sa.Row[Any]]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.select(OPS).order_by(OPS.c.id)))
    finally:
        engine.dispose()


@pytest.fixture
def ob(db_url: str) -> Iterator[Outbox]:
    with Outbox(db_url, endpoints=[INVENTORY, BILLING]) as box:
        yield box


def enqueue(box: Outbox, **overrides: Any) -> Operation:
    return box.enqueue(**{**ARGS, **overrides})


# -- round trip and idempotent re-enqueue -----------------------------------------


def test_enqueue_then_get_round_trips(ob: Outbox, db_url: str) -> None:
    op = enqueue(ob)
    assert op.state is State.PENDING
    assert (op.tenant, op.operation_id) == ("acme", "order-17-reserve")

    [row] = stored(db_url)
    assert row.id == op.pk
    assert (row.tenant, row.operation_id, row.state) == ("acme", "order-17-reserve", "pending")
    assert (row.endpoint, row.method, row.path) == ("inventory", "POST", "/reservations")
    assert json.loads(row.body) == {"sku": "TEST-BOLT", "quantity": 2}
    assert json.loads(row.headers) == {"x-trace": "t-1"}

    got = ob.get("order-17-reserve", tenant="acme")
    assert got.pk == op.pk
    assert got.state is State.PENDING
    assert got.body == {"sku": "TEST-BOLT", "quantity": 2}
    assert got.headers == {"x-trace": "t-1"}
    assert (got.endpoint, got.method, got.path) == ("inventory", "POST", "/reservations")
    assert got.attempts == ()
    assert got.attempts_total == 0


def test_get_of_an_unknown_operation_raises(ob: Outbox) -> None:
    enqueue(ob)
    with pytest.raises(OperationNotFound):
        ob.get("order-17-reserve", tenant="other")
    with pytest.raises(OperationNotFound):
        ob.get("order-18")


def test_same_arguments_return_the_same_operation_and_write_nothing(
    ob: Outbox, db_url: str
) -> None:
    first = enqueue(ob)
    before = stored(db_url)
    # The same intent spelled differently: key order, method case, header-name case.
    again = ob.enqueue(
        endpoint="inventory",
        method="post",
        path="/reservations",
        json={"quantity": 2, "sku": "TEST-BOLT"},
        headers={"x-trace": "t-1"},
        operation_id="order-17-reserve",
        tenant="acme",
    )
    assert again.pk == first.pk
    assert again.operation_id == first.operation_id
    assert again.state is State.PENDING
    assert stored(db_url) == before  # not even updated_at or version changed
    assert count(db_url) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"json": {"sku": "TEST-BOLT", "quantity": 3}},
        {"json": None},
        {"method": "PUT"},
        {"path": "/reservations/2"},
        {"endpoint": "billing"},
        {"headers": {"X-Trace": "t-2"}},
        {"headers": None},
    ],
    ids=["body", "no-body", "method", "path", "endpoint", "header", "no-headers"],
)
def test_different_arguments_raise_conflict_and_write_nothing(
    ob: Outbox, db_url: str, change: dict[str, Any]
) -> None:
    first = enqueue(ob)
    before = stored(db_url)
    with pytest.raises(OperationConflict) as info:
        enqueue(ob, **change)
    assert info.value.operation_id == "order-17-reserve"
    assert info.value.tenant == "acme"
    assert "different arguments" in str(info.value)
    assert stored(db_url) == before
    assert ob.get("order-17-reserve", tenant="acme").pk == first.pk


def test_operation_ids_are_scoped_by_tenant(ob: Outbox, db_url: str) -> None:
    a = enqueue(ob, tenant="acme")
    b = enqueue(ob, tenant="globex", json={"other": True})
    c = enqueue(ob, tenant="")
    assert len({a.pk, b.pk, c.pk}) == 3
    assert sorted(r.tenant for r in stored(db_url)) == ["", "acme", "globex"]


def test_a_missing_operation_id_is_minted_and_returned(ob: Outbox, db_url: str) -> None:
    args = {k: v for k, v in ARGS.items() if k != "operation_id"}
    first = ob.enqueue(**args)
    second = ob.enqueue(**args)  # equal payloads, two intents: two operations
    assert first.operation_id != second.operation_id
    for op in (first, second):
        assert str(uuid.UUID(op.operation_id)) == op.operation_id
        assert ob.get(op.operation_id, tenant="acme").pk == op.pk
    assert {r.operation_id for r in stored(db_url)} == {first.operation_id, second.operation_id}


def test_longest_operation_id_is_stored_intact(ob: Outbox, db_url: str) -> None:
    op_id = "a" * 250 + ".:_-9"
    enqueue(ob, operation_id=op_id)
    [row] = stored(db_url)
    assert row.operation_id == op_id


# -- concurrency ------------------------------------------------------------------

_RACER = textwrap.dedent(
    """
    import json, sys, threading
    from outbox import Endpoint, OperationConflict, Outbox

    url, mode, proc, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ob = Outbox(url, endpoints=[Endpoint(name="inventory", base_url="https://inv.example",
                                         tenant_header="X-Tenant")])
    barrier = threading.Barrier(n + 1)
    results = [None] * n

    def body(i):
        if mode == "same":
            return {"sku": "TEST-BOLT", "quantity": 2}
        if mode == "mixed":
            return {"sku": "TEST-BOLT", "quantity": 2 + i % 2}
        return {"sku": "TEST-BOLT", "proc": proc, "thread": i}

    def work(i):
        sent = body(i)
        barrier.wait()
        try:
            op = ob.enqueue(endpoint="inventory", method="POST", path="/r", json=sent,
                            operation_id="race-1", tenant="acme")
            results[i] = {"outcome": "op", "pk": op.pk, "body": op.body, "sent": sent}
        except OperationConflict as exc:
            results[i] = {"outcome": "conflict", "sent": sent, "id": exc.operation_id}
        except BaseException as exc:
            results[i] = {"outcome": "error", "error": repr(exc)}

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    barrier.wait()
    for t in threads:
        t.join()
    ob.close()
    print(json.dumps(results), flush=True)
    """
)

PROCESSES = 2
THREADS = 50


def race(url: str, mode: str) -> list[dict[str, Any]]:
    """PROCESSES fresh interpreters x THREADS threads enqueue one key at the same moment."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, url, mode, str(p), str(THREADS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p in range(PROCESSES)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "ready\n", (line, proc.stderr.read() if proc.stderr else "")
        for proc in procs:  # release both processes' threads together
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results: list[dict[str, Any]] = []
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err
            results.extend(json.loads(out))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


@pytest.fixture
def race_url(db_url: str) -> str:
    # Create the SQLite schema before the racers open it (PostgreSQL is migrated already).
    Outbox(db_url).close()
    return db_url


def test_race_same_arguments_one_row_every_caller_gets_it(race_url: str) -> None:
    results = race(race_url, "same")
    assert len(results) == PROCESSES * THREADS
    assert [r for r in results if r["outcome"] != "op"] == []
    [row] = stored(race_url)
    assert {r["pk"] for r in results} == {row.id}
    assert all(r["body"] == json.loads(row.body) for r in results)


def test_race_mixed_arguments_one_row_others_conflict(race_url: str) -> None:
    results = race(race_url, "mixed")
    assert len(results) == PROCESSES * THREADS
    assert [r for r in results if r["outcome"] == "error"] == []
    [row] = stored(race_url)
    winner = json.loads(row.body)
    for r in results:
        if r["sent"] == winner:
            assert r["outcome"] == "op", r
            assert r["pk"] == row.id
        else:
            assert r["outcome"] == "conflict", r
            assert r["id"] == "race-1"
    assert sum(r["outcome"] == "op" for r in results) == PROCESSES * THREADS // 2


def test_race_all_different_arguments_one_winner(race_url: str) -> None:
    results = race(race_url, "distinct")
    assert [r for r in results if r["outcome"] == "error"] == []
    winners = [r for r in results if r["outcome"] == "op"]
    assert len(winners) == 1
    assert sum(r["outcome"] == "conflict" for r in results) == PROCESSES * THREADS - 1
    [row] = stored(race_url)
    assert winners[0]["pk"] == row.id
    assert json.loads(row.body) == winners[0]["sent"]


# -- inside the caller's transaction ----------------------------------------------

orders_md = sa.MetaData()
ORDERS = sa.Table(
    "orders",
    orders_md,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("ref", sa.String(50), nullable=False),
)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orm_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    ref: Mapped[str] = mapped_column(sa.String(50))


class Boom(Exception):
    pass


@pytest.fixture
def app_engine(ob: Outbox, db_url: str) -> Iterator[sa.Engine]:
    """The application's own engine (outbox.create_engine: BEGIN IMMEDIATE on SQLite)."""
    engine = outbox.create_engine(db_url)
    orders_md.create_all(engine)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


def test_caller_connection_rollback_keeps_neither_row(
    ob: Outbox, app_engine: sa.Engine, db_url: str
) -> None:
    with pytest.raises(Boom), app_engine.begin() as conn:
        conn.execute(ORDERS.insert().values(ref="order-17"))
        op = enqueue(ob, connection=conn)
        assert op.state is State.PENDING
        # Visible inside the caller's transaction, invisible outside it.
        assert conn.execute(sa.select(sa.func.count()).select_from(OPS)).scalar_one() == 1
        assert count(db_url) == 0
        raise Boom
    assert count(db_url) == 0
    assert count(db_url, "orders") == 0
    with pytest.raises(OperationNotFound):
        ob.get("order-17-reserve", tenant="acme")


def test_caller_connection_commit_keeps_both_rows(
    ob: Outbox, app_engine: sa.Engine, db_url: str
) -> None:
    with app_engine.begin() as conn:
        conn.execute(ORDERS.insert().values(ref="order-17"))
        op = enqueue(ob, connection=conn)
        # Re-enqueue inside the same transaction sees the uncommitted row.
        assert enqueue(ob, connection=conn).pk == op.pk
        with pytest.raises(OperationConflict):
            enqueue(ob, connection=conn, json={"sku": "TEST-BOLT", "quantity": 9})
        with pytest.raises(OperationNotFound):
            ob.get("order-17-reserve", tenant="acme")  # not committed yet
    assert count(db_url) == 1
    assert count(db_url, "orders") == 1
    assert ob.get("order-17-reserve", tenant="acme").pk == op.pk
    [row] = stored(db_url)
    assert json.loads(row.body) == {"sku": "TEST-BOLT", "quantity": 2}


def test_validation_error_inside_caller_transaction_writes_nothing(
    ob: Outbox, app_engine: sa.Engine, db_url: str
) -> None:
    with app_engine.begin() as conn:
        conn.execute(ORDERS.insert().values(ref="order-17"))
        with pytest.raises(ValidationError):
            enqueue(ob, connection=conn, headers={"Authorization": "Bearer x"})
    assert count(db_url) == 0
    assert count(db_url, "orders") == 1  # the caller's transaction was not spoiled


def test_orm_session_rollback_keeps_neither_row(
    ob: Outbox, app_engine: sa.Engine, db_url: str
) -> None:
    with Session(app_engine) as session, pytest.raises(Boom), session.begin():
        session.add(Order(ref="order-17"))
        session.flush()
        enqueue(ob, connection=session)
        raise Boom
    assert count(db_url) == 0
    assert count(db_url, "orm_orders") == 0


def test_orm_session_commit_keeps_both_rows(ob: Outbox, app_engine: sa.Engine, db_url: str) -> None:
    with Session(app_engine) as session, session.begin():
        session.add(Order(ref="order-17"))
        op = enqueue(ob, connection=session)
    assert count(db_url) == 1
    assert count(db_url, "orm_orders") == 1
    assert ob.get("order-17-reserve", tenant="acme").pk == op.pk


def test_connection_must_be_a_connection_or_session(ob: Outbox, db_url: str) -> None:
    with pytest.raises(ValidationError, match="Connection or ORM Session"):
        enqueue(ob, connection=object())
    assert count(db_url) == 0


# -- bad input: ValidationError, nothing written ----------------------------------

BAD_INPUTS: list[tuple[str, dict[str, Any], str]] = [
    ("empty operation id", {"operation_id": ""}, "operation_id"),
    ("256-char operation id", {"operation_id": "x" * 256}, "operation_id"),
    ("space in operation id", {"operation_id": "order 17"}, "operation_id"),
    ("slash in operation id", {"operation_id": "order/17"}, "operation_id"),
    ("newline in operation id", {"operation_id": "order\n17"}, "operation_id"),
    ("trailing newline in operation id", {"operation_id": "order-17\n"}, "operation_id"),
    ("unicode operation id", {"operation_id": "commande-é"}, "operation_id"),
    (
        "SQL-shaped operation id",
        {"operation_id": "x'; DROP TABLE outbox_operations;--"},
        "operation_id",
    ),
    ("tenant with space", {"tenant": "ac me"}, "tenant"),
    ("tenant with slash", {"tenant": "acme/eu"}, "tenant"),
    ("tenant with quote", {"tenant": "acme'--"}, "tenant"),
    ("unknown endpoint", {"endpoint": "shipping"}, "unknown endpoint 'shipping'"),
    ("bad method", {"method": "BREW"}, "method"),
    ("method with CRLF", {"method": "POST\r\n"}, "method"),
    ("absolute URL path", {"path": "https://evil.example/x"}, "path"),
    ("scheme-only path", {"path": "http:/evil"}, "path"),
    ("protocol-relative path", {"path": "//evil.example/x"}, "path"),
    ("path without leading slash", {"path": "reservations"}, "path"),
    ("path with CRLF", {"path": "/r\r\nHost: evil.example"}, "path"),
    ("path with NUL", {"path": "/r\x00"}, "path"),
    ("set body", {"json": {1, 2}}, "not JSON-serialisable"),
    ("object body", {"json": {"when": object()}}, "not JSON-serialisable"),
    ("NaN body", {"json": {"price": float("nan")}}, "NaN or Infinity"),
    ("deep Infinity body", {"json": {"a": [{"b": [float("inf")]}]}}, "NaN or Infinity"),
    ("-Infinity body", {"json": [float("-inf")]}, "NaN or Infinity"),
    ("body over 1 MiB", {"json": {"blob": "x" * (1024 * 1024)}}, "over the limit of 1048576"),
    ("nested too deep", {"json": json.loads("[" * 65 + "]" * 65)}, "nested deeper than 64"),
    ("Authorization header", {"headers": {"Authorization": "Bearer t"}}, "credentials"),
    ("Cookie header", {"headers": {"Cookie": "s=1"}}, "credentials"),
    ("Proxy-Authorization header", {"headers": {"Proxy-Authorization": "Basic x"}}, "credentials"),
    ("X-Api-Key header", {"headers": {"X-Api-Key": "k"}}, "credentials"),
    ("lower-case authorization", {"headers": {"authorization": "Bearer t"}}, "credentials"),
    ("header value with CRLF", {"headers": {"X-Trace": "a\r\nX-Evil: 1"}}, "control"),
    ("header value with LF", {"headers": {"X-Trace": "a\nb"}}, "control"),
    ("header value with CR", {"headers": {"X-Trace": "a\rb"}}, "control"),
    ("header name with newline", {"headers": {"X-Trace\n": "a"}}, "header name"),
    ("Idempotency-Key header", {"headers": {"Idempotency-Key": "k"}}, "set by the dispatcher"),
    ("bad ordering key", {"ordering_key": "a b"}, "ordering_key"),
]


def test_bad_input_raises_validation_error_and_writes_nothing(
    ob: Outbox, db_url: str, subtests: pytest.Subtests
) -> None:
    enqueue(ob, operation_id="already-there")  # a row the bad calls must leave alone
    before = stored(db_url)
    for name, overrides, message in BAD_INPUTS:
        with subtests.test(name):
            with pytest.raises(ValidationError, match=message) as info:
                enqueue(ob, **overrides)
            assert isinstance(info.value, ValueError)
            assert count(db_url) == 1, name
    assert stored(db_url) == before
    # The SQL-shaped ID was data, not SQL: the table is still there and intact.
    assert count(db_url) == 1


def test_configured_body_limit(db_url: str) -> None:
    with Outbox(db_url, endpoints=[INVENTORY], max_body_bytes=1000) as box:
        with pytest.raises(ValidationError, match="over the limit of 1000"):
            enqueue(box, json={"blob": "x" * 1000})
        assert count(db_url) == 0
        enqueue(box, json={"blob": "x" * 900})
        assert count(db_url) == 1


def test_configured_secret_header(db_url: str) -> None:
    with Outbox(db_url, endpoints=[INVENTORY], secret_headers=["X-Shop-Token"]) as box:
        for name in ("X-Shop-Token", "x-shop-token"):
            with pytest.raises(ValidationError, match="credentials"):
                enqueue(box, headers={name: "s3cret"})
            assert count(db_url) == 0
    with Outbox(db_url, endpoints=[INVENTORY]) as box:  # not configured: an ordinary header
        enqueue(box, headers={"X-Shop-Token": "not-secret"})
    [row] = stored(db_url)
    assert json.loads(row.headers) == {"x-shop-token": "not-secret"}


def test_credentials_never_reach_the_database(ob: Outbox, db_url: str) -> None:
    for header in ("Authorization", "Cookie", "Proxy-Authorization", "X-Api-Key"):
        with pytest.raises(ValidationError):
            enqueue(ob, operation_id=f"op-{header}", headers={header: "TOPSECRET-1"})
    enqueue(ob, operation_id="ok", headers={"X-Trace": "t"})
    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            dump = [tuple(r) for r in conn.execute(sa.text("SELECT * FROM outbox_operations"))]
    finally:
        engine.dispose()
    assert len(dump) == 1
    assert "TOPSECRET" not in repr(dump)
