"""Fair claims, priorities, scheduled sends and the per-tenant in-flight limit, on
SQLite and PostgreSQL; the HTTP cases against the real test receiver over 127.0.0.1.

Fairness is asserted on claim order and on the receiver's arrival order, never on wall
time. Time is a FakeClock.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from tenacity import wait_fixed

import outbox
from outbox import (
    DispatcherSettings,
    Endpoint,
    FakeClock,
    Intent,
    Outbox,
    RetryPolicy,
    State,
    ValidationError,
)
from outbox.store.tables import operations
from outbox.testing.receiver import Receiver

MakeOutbox = Callable[..., Outbox]


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    def handler(conn: Any, tenant: str, method: str, path: str, body: Any) -> tuple[int, Any]:
        return 201, {"ok": True}

    with Receiver(tmp_path / "receiver.sqlite3", handler=handler) as rx:
        yield rx


@pytest.fixture
def make_ob(db_url: str, receiver: Receiver) -> Iterator[MakeOutbox]:
    made: list[Outbox] = []

    def make(**endpoint: Any) -> Outbox:
        ob = Outbox(
            db_url,
            endpoints=[
                Endpoint(
                    name="rx",
                    base_url=receiver.url,
                    timeout=2.0,
                    retry=RetryPolicy(
                        max_attempts=4, window=timedelta(seconds=60), wait=wait_fixed(1)
                    ),
                    key_retention=timedelta(hours=1),
                    tenant_header="X-Tenant",
                    **endpoint,
                )
            ],
            clock=FakeClock(),
        )
        made.append(ob)
        return ob

    yield make
    for ob in made:
        ob.close()


def _clock(ob: Outbox) -> FakeClock:
    assert isinstance(ob.clock, FakeClock)
    return ob.clock


def _intent(op_id: str, tenant: str, **kw: Any) -> Intent:
    return Intent("rx", "POST", "/orders", {"op": op_id}, None, op_id, tenant, **kw)


def _claim(ob: Outbox, limit: int, lease: str = "t") -> list[str]:
    claimed, _ = ob.store.claim(
        owner="test", token=lease, now_ms=ob.clock.now_ms(), lease_ms=60_000, limit=limit
    )
    return [c.operation_id for c in claimed]


def _rows(ob: Outbox) -> int:
    with ob.engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(operations)).scalar_one())


# -- fairness ------------------------------------------------------------------------


def test_a_small_tenant_is_sent_in_the_first_batch_behind_a_big_backlog(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(400)])
    _clock(ob).advance(1.0)  # B's one operation comes strictly after A's backlog
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={"op": "b"},
               operation_id="b-0", tenant="B")  # fmt: skip
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=8, batch_size=8))
    summary = asyncio.run(dispatcher.run(until_empty=True))
    assert summary.succeeded == 401
    arrivals = [r.key for r in receiver.requests()]
    assert len(arrivals) == 401
    # Oldest-first would have sent it 401st; dealt round robin it is in the first
    # claim (two batches of slack for the concurrent sends' arrival order).
    assert arrivals.index("b-0") < 16
    assert receiver.effect_count(key="b-0") == 1


def test_claims_deal_rounds_across_tenants_and_rotate(make_ob: MakeOutbox) -> None:
    ob = make_ob()
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(20)])
    ob.enqueue_many([_intent(f"b-{i}", "B") for i in range(2)])
    ob.enqueue_many([_intent(f"c-{i}", "C") for i in range(20)])
    _clock(ob).advance(0.001)
    first = _claim(ob, 6, "t1")
    assert Counter(op[0] for op in first) == {"a": 2, "b": 2, "c": 2}
    second = _claim(ob, 6, "t2")
    assert Counter(op[0] for op in second) == {"a": 3, "c": 3}  # B has nothing left
    # In each tenant, its own order (enqueue order at one priority).
    assert sorted(op for op in first + second if op[0] == "a") == [f"a-{i}" for i in range(5)]


def test_more_tenants_than_a_batch_are_all_served_in_turn(make_ob: MakeOutbox) -> None:
    ob = make_ob()
    tenants = [f"t{i:02d}" for i in range(10)]
    ob.enqueue_many([_intent(f"{t}-{i}", t) for t in tenants for i in range(3)])
    _clock(ob).advance(0.001)
    served: list[str] = []
    for n in range(3):
        got = _claim(ob, 4, f"tok-{n}")
        assert len(got) == 4 and len({op.split("-")[0] for op in got}) == 4
        served += [op.split("-")[0] for op in got]
    # Three claims of four, one row per tenant each, the rotation moving on: every one
    # of the ten tenants served, two of them (the rotation wrapped) twice.
    assert sorted(set(served)) == tenants
    assert sorted(Counter(served).values()) == [1] * 8 + [2] * 2


def test_tenants_with_nothing_claimable_take_no_share_of_the_batch(make_ob: MakeOutbox) -> None:
    ob = make_ob()
    ob.enqueue_many([_intent(f"s{i:02d}", f"s{i:02d}") for i in range(20)])
    _clock(ob).advance(0.001)
    assert len(_claim(ob, 20, "t1")) == 20  # each small tenant's one row now in flight
    ob.enqueue_many([_intent(f"big-{i}", "big") for i in range(50)])
    _clock(ob).advance(0.001)
    assert len(_claim(ob, 30, "t2")) == 30  # the whole batch, not a 1/21 share


def test_ordering_keys_in_a_tenant_do_not_hold_others(make_ob: MakeOutbox) -> None:
    ob = make_ob()
    ob.enqueue_many([_intent(f"k-{i}", "A", ordering_key="cust-1") for i in range(50)])
    ob.enqueue_many([_intent(f"free-{i}", "A") for i in range(3)])
    _clock(ob).advance(0.001)
    assert sorted(_claim(ob, 10)) == ["free-0", "free-1", "free-2", "k-0"]


# -- priority --------------------------------------------------------------------------


def test_higher_priority_is_sent_first_within_the_tenant(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    ob.enqueue_many([_intent(f"low-{i}", "A") for i in range(5)])
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={}, operation_id="urgent",
               tenant="A", priority=10)  # fmt: skip
    ob.enqueue(endpoint="rx", method="POST", path="/orders", json={}, operation_id="later",
               tenant="A", priority=-1)  # fmt: skip
    _clock(ob).advance(0.001)
    dispatcher = ob.dispatcher(DispatcherSettings(concurrency=1, batch_size=1))
    assert asyncio.run(dispatcher.run(until_empty=True)).succeeded == 7
    arrivals = [r.key for r in receiver.requests()]
    assert arrivals[0] == "urgent" and arrivals[-1] == "later"
    assert arrivals[1:-1] == [f"low-{i}" for i in range(5)]
    assert ob.get("urgent", tenant="A").priority == 10


# -- not_before ----------------------------------------------------------------------


def test_not_before_holds_the_send_and_the_window_starts_at_it(
    make_ob: MakeOutbox, receiver: Receiver
) -> None:
    ob = make_ob()
    clock = _clock(ob)
    at = datetime.fromtimestamp(clock.now_ms() / 1000, UTC) + timedelta(minutes=10)
    op = ob.enqueue(endpoint="rx", method="POST", path="/orders", json={}, operation_id="s",
                    not_before=at)  # fmt: skip
    assert op.next_attempt_at_ms == op.not_before_ms == int(at.timestamp() * 1000)
    ob.dispatch_once()
    assert receiver.requests() == [] and ob.get("s").state is State.PENDING
    clock.advance(9 * 60)
    ob.dispatch_once()
    assert receiver.requests() == []
    clock.advance(61)
    ob.dispatch_once()
    done = ob.get("s")
    assert done.state is State.SUCCEEDED and receiver.effect_count(key="s") == 1
    # The window (60 s) counts from the first send, not from the enqueue 10 min before.
    assert done.window_started_at_ms is not None
    assert done.window_started_at_ms >= int(at.timestamp() * 1000)


def test_not_before_in_the_past_is_due_now(make_ob: MakeOutbox) -> None:
    ob = make_ob()
    past = datetime.fromtimestamp(ob.clock.now_ms() / 1000, UTC) - timedelta(days=1)
    op = ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="p",
                    not_before=past)  # fmt: skip
    assert op.next_attempt_at_ms == ob.clock.now_ms()
    assert _claim(ob, 5) == ["p"]


# -- validation: a clear error, nothing written, every enqueue variant -------------------

BAD = [
    ({"priority": "high"}, "priority must be an int"),
    ({"priority": True}, "priority must be an int"),
    ({"priority": 1.5}, "priority must be an int"),
    ({"priority": 2**31}, "priority must be an int"),
    ({"not_before": datetime(2030, 1, 1)}, "must be timezone-aware"),  # noqa: DTZ001
    ({"not_before": "2030-01-01T00:00:00Z"}, "timezone-aware datetime"),
    ({"deliver_within": timedelta(0)}, "deliver_within must be a positive timedelta"),
    ({"deliver_within": timedelta(seconds=-5)}, "deliver_within must be a positive timedelta"),
    ({"deliver_within": 3600}, "deliver_within must be a positive timedelta"),
    ({"deliver_within": "2h"}, "deliver_within must be a positive timedelta"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_scheduling_input_is_refused_and_nothing_written(
    make_ob: MakeOutbox, bad: dict[str, Any], message: str
) -> None:
    ob = make_ob()
    args: dict[str, Any] = {"endpoint": "rx", "method": "POST", "path": "/o", "json": {},
                            "operation_id": "x"}  # fmt: skip
    with pytest.raises(ValidationError, match=message):
        ob.enqueue(**args, **bad)
    with pytest.raises(ValidationError, match=message):
        asyncio.run(ob.enqueue_async(**args, **bad))
    with pytest.raises(ValidationError, match=message), ob.transaction(ob.engine) as tx:
        tx.enqueue(**args, **bad)
    asyncio.run(_async_transaction(ob, args | bad, message))
    with pytest.raises(ValidationError, match=message):
        ob.enqueue_many([Intent("rx", "POST", "/o", {}, None, "y", "", None, **bad)])
    assert _rows(ob) == 0


async def _async_transaction(ob: Outbox, args: dict[str, Any], message: str) -> None:
    engine = outbox.create_async_engine(str(ob.engine.url.render_as_string(False)))
    try:
        with pytest.raises(ValidationError, match=message):
            async with ob.transaction_async(engine) as atx:
                await atx.enqueue(**args)
    finally:
        await engine.dispose()


def test_every_enqueue_variant_stores_priority_not_before_and_deliver_within(
    make_ob: MakeOutbox,
) -> None:
    ob = make_ob()
    at = datetime.fromtimestamp(ob.clock.now_ms() / 1000, UTC) + timedelta(hours=1)
    kw: dict[str, Any] = {"endpoint": "rx", "method": "POST", "path": "/o", "json": {},
                          "priority": 3, "not_before": at}  # fmt: skip
    kw["deliver_within"] = timedelta(hours=2)
    ob.enqueue(operation_id="sync", **kw)
    ob.enqueue_many([Intent(operation_id="many", **kw)])
    asyncio.run(ob.enqueue_async(operation_id="async", **kw))
    with ob.transaction(ob.engine) as tx:
        tx.enqueue(operation_id="tx", **kw)

    async def in_async_transaction() -> None:
        engine = outbox.create_async_engine(str(ob.engine.url.render_as_string(False)))
        try:
            async with ob.transaction_async(engine) as atx:
                await atx.enqueue(operation_id="atx", **kw)
        finally:
            await engine.dispose()

    asyncio.run(in_async_transaction())
    for op_id in ("sync", "many", "async", "tx", "atx"):
        op = ob.get(op_id)
        assert (op.priority, op.not_before_ms) == (3, int(at.timestamp() * 1000))
        assert op.next_attempt_at_ms == op.not_before_ms
        assert op.deliver_within_ms == 2 * 3600 * 1000
    plain = ob.enqueue(operation_id="plain", **(kw | {"deliver_within": None}))
    assert plain.deliver_within_ms is None
    assert ob.get("plain").deliver_within_ms is None  # the endpoint policy's


def test_scheduling_is_not_part_of_the_fingerprint(make_ob: MakeOutbox) -> None:
    # An enqueue again of the same intent (a retried request handler, say) with other
    # scheduling returns the stored operation as it is: the first enqueue's scheduling.
    ob = make_ob()
    kw: dict[str, Any] = {"endpoint": "rx", "method": "POST", "path": "/o", "json": {"a": 1}}
    kw["operation_id"] = "same"
    first = ob.enqueue(**kw, deliver_within=timedelta(seconds=30))
    again = ob.enqueue(**kw, deliver_within=timedelta(days=3), priority=5)
    assert again.pk == first.pk
    assert (again.deliver_within_ms, again.priority) == (30_000, 0)
    assert ob.enqueue(**kw).deliver_within_ms == 30_000
    assert _rows(ob) == 1


# -- per-tenant in-flight limit --------------------------------------------------------


def test_tenant_max_in_flight_is_kept_across_claims(make_ob: MakeOutbox) -> None:
    ob = make_ob(tenant_max_in_flight=2)
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(10)])
    ob.enqueue_many([_intent(f"b-{i}", "B") for i in range(10)])
    _clock(ob).advance(0.001)
    first = _claim(ob, 10, "t1")
    assert Counter(op[0] for op in first) == {"a": 2, "b": 2}
    assert _claim(ob, 10, "t2") == []  # both tenants at their limit while leases live
    # One of A's finishes: A has room for one more, B none.
    pk = ob.get(first[0] if first[0][0] == "a" else first[1], tenant="A").pk
    with ob.engine.begin() as conn:
        conn.execute(sa.update(operations).where(operations.c.id == pk)
                     .values(state="succeeded", lease_token=None))  # fmt: skip
    assert [op[0] for op in _claim(ob, 10, "t3")] == ["a"]


def test_tenant_max_in_flight_over_http(make_ob: MakeOutbox, receiver: Receiver) -> None:
    ob = make_ob(tenant_max_in_flight=2)
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(10)])
    ob.enqueue_many([_intent(f"b-{i}", "B") for i in range(10)])
    _clock(ob).advance(0.001)
    # One batch of 8 slots: the claim keeps each tenant to 2 in flight.
    summary = asyncio.run(ob.dispatcher(DispatcherSettings(concurrency=8, batch_size=8))
                          .run(once=True))  # fmt: skip
    assert summary.succeeded == 4
    assert Counter(r.tenant for r in receiver.requests()) == {"A": 2, "B": 2}


def test_an_expired_lease_does_not_count_against_the_limit(make_ob: MakeOutbox) -> None:
    ob = make_ob(tenant_max_in_flight=1)
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(3)])
    _clock(ob).advance(0.001)
    assert len(_claim(ob, 5, "t1")) == 1
    _clock(ob).advance(61)  # the lease (60 s) expired: the row is due again
    assert len(_claim(ob, 5, "t2")) == 1


def test_tenant_max_in_flight_must_be_a_positive_int() -> None:
    from outbox import ConfigurationError

    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigurationError, match="tenant_max_in_flight"):
            Endpoint(name="x", base_url="http://127.0.0.1:1", tenant_max_in_flight=bad)


# -- the operator sees them --------------------------------------------------------------


def test_show_displays_priority_not_before_and_deadline(make_ob: MakeOutbox, db_url: str) -> None:
    import json

    from click.testing import CliRunner

    from outbox.cli import main
    from outbox.model import ms_to_iso

    ob = make_ob()
    at = datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)
    options = {"priority": 7, "not_before": at, "deliver_within": timedelta(hours=2)}
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="s", **options)
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="plain")
    stored = ob.get("s")
    assert stored is not None
    by = ms_to_iso(stored.created_at_ms + 7_200_000)
    shown = CliRunner().invoke(main, ["--db", db_url, "show", "s", "--json"])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.output)
    data = data.get("operation", data)
    assert (data["priority"], data["not_before"]) == (7, "2031-05-04T03:02:01.000Z")
    assert (data["deliver_within_ms"], data["deliver_by"]) == (7_200_000, by)
    table = CliRunner().invoke(main, ["--db", db_url, "show", "s"])
    assert "priority: 7" in table.output
    assert "not before: 2031-05-04T03:02:01.000Z" in table.output
    assert f"deliver by: {by} (its own deadline, if never sent)" in table.output
    plain = CliRunner().invoke(main, ["--db", db_url, "show", "plain"])
    assert "priority" not in plain.output and "not before" not in plain.output
    assert "deliver by" not in plain.output
    plain_data = json.loads(
        CliRunner().invoke(main, ["--db", db_url, "show", "plain", "--json"]).output
    )
    assert plain_data.get("operation", plain_data)["deliver_by"] is None


def test_the_console_page_shows_priority_not_before_and_deadline(make_ob: MakeOutbox) -> None:
    import html

    from starlette.testclient import TestClient

    from outbox.console import Credentials, create_app

    ob = make_ob()
    at = datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)
    options = {"priority": 7, "not_before": at, "deliver_within": timedelta(hours=2)}
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="s", **options)
    ob.enqueue(endpoint="rx", method="POST", path="/o", json={}, operation_id="plain")
    token = "alice-" + "a" * 20
    credentials = Credentials.parse(f"alice:{token}\n", default_name="nobody", source="test")
    c = TestClient(create_app(ob, credentials), base_url="http://127.0.0.1")
    assert c.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
    page = html.unescape(c.get("/operation?tenant=&id=s").text)
    assert "priority 7" in page and "not before 2031-05-04" in page
    assert "deliver by" in page and "(its own deadline, if never sent)" in page
    plain = html.unescape(c.get("/operation?tenant=&id=plain").text)
    assert "deliver by" not in plain and "not before" not in plain and "priority 7" not in plain


# -- the claim stays on its indexes ------------------------------------------------------


def test_concurrent_claims_on_postgresql_take_disjoint_rows_not_none(
    make_ob: MakeOutbox, db_url: str
) -> None:
    # Two dispatchers claim at once (one claim's transaction is held open here): the
    # second must take the next rows, not skip the first's locked candidates and come
    # back empty while work is due (it would then sleep until its next wake-up).
    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite claims under its single write lock")
    ob = make_ob()
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(12)])
    _clock(ob).advance(0.001)
    held = ob.engine.connect()
    try:
        with held.begin():
            first, _ = ob.store._claim_on(  # the first claim, not yet committed
                held, owner="one", token="t1", now_ms=ob.clock.now_ms(), lease_ms=60_000,
                limit=5,
            )  # fmt: skip
            second = _claim(ob, 5, "t2")
            mine = [c.operation_id for c in first]
            assert len(mine) == 5 and len(second) == 5
            assert not set(mine) & set(second)
    finally:
        held.close()


def test_the_claim_plan_uses_only_indexes_on_sqlite(make_ob: MakeOutbox, db_url: str) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("SQLite's plan; PostgreSQL's is the next test")
    from outbox.store.fairness import fair_claim_sql

    ob = make_ob()
    ob.enqueue_many([_intent(f"a-{i}", "A") for i in range(50)])
    with ob.engine.connect() as conn:
        rows = [(r[0], r[1], str(r[3])) for r in conn.exec_driver_sql(
            "EXPLAIN QUERY PLAN " + fair_claim_sql("sqlite"),
            {"now_ms": 0, "limit": 32, "cursor": "", "caps": "{}", "steady_ms": 2**62,
             "gone": "[]"},
        )]  # fmt: skip
    plan = [detail for _, _, detail in rows]
    tables = [line for line in plan if re.search(r"\b(outbox_operations|o|e|f)\b", line)]
    indexed = re.compile(r"USING (COVERING )?INDEX ix_outbox_|USING INTEGER PRIMARY KEY")
    assert tables and all(indexed.search(line) for line in tables), plan
    # A tenant's next rows come in the index's order: no sort inside the tenant's lookup.
    lookup = next(i for i, _, d in rows if "CORRELATED LIST SUBQUERY" in d)
    inside = [d for _, parent, d in rows if parent == lookup]
    assert "SEARCH o USING INDEX ix_outbox_operations_fair (tenant=?)" in inside, inside
    assert not any("TEMP B-TREE" in d for d in inside), inside


def test_the_claim_plan_is_index_scans_on_postgresql(db_url: str) -> None:
    if not db_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's plan; SQLite's is the test before")
    from benchmarks.claim_plan import drop_schema, explain, make_schema

    now = 1_800_000_000_000
    schema, engine, _ = make_schema(rows=50_000, tenants=200, now=now)
    try:
        plan = "\n".join(explain(engine, now))
    finally:
        drop_schema(schema, engine)
    # The endpoints' fleet state (store.endpoints) is one row per endpoint: scanned
    # whole, as it should be; the operations never are.
    assert "Seq Scan on outbox_operations" not in plan, plan
    assert "Index Scan using ix_outbox_operations_fair" in plan
    # The tenant walk stays on the due index, never on one that holds finished rows too.
    assert "uq_outbox_operations_tenant_operation_id" not in plan, plan


def test_the_guide_s_python_blocks_run(db_url: str) -> None:
    if not db_url.startswith("sqlite"):
        pytest.skip("the guide's examples use SQLite")
    guide = Path(__file__).parents[2] / "docs" / "guide" / "fairness-and-scheduling.md"
    blocks = re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S)
    assert len(blocks) >= 4
    exec(compile("\n".join(blocks), str(guide), "exec"), {})  # noqa: S102
