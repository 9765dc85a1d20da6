"""Native async enqueue on aiosqlite and psycopg's async driver, against real databases.

Effects are read from the tables with a separate synchronous engine. Each test runs its
coroutine with ``asyncio.run``: a fresh event loop per test, no plugin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession
from tenacity import wait_fixed

import outbox
from outbox import (
    Endpoint,
    Intent,
    OperationConflict,
    OperationNotFound,
    Outbox,
    RetryPolicy,
    State,
    ValidationError,
)
from outbox.testing.receiver import Receiver

INVENTORY = Endpoint(name="inventory", base_url="https://inventory.example")
metadata = sa.MetaData()
orders = sa.Table("orders", metadata, sa.Column("id", sa.Integer, primary_key=True))

ARGS: dict[str, Any] = {
    "endpoint": "inventory",
    "method": "POST",
    "path": "/reservations",
    "json": {"sku": "TEST-BOLT", "quantity": 2},
    "operation_id": "order-17-reserve",
}


def rows(url: str) -> tuple[list[int], list[tuple[str, str]]]:
    """(order ids, (operation_id, body)) as stored, read with a plain sync engine."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            order_ids = list(conn.execute(sa.select(orders.c.id).order_by(orders.c.id)).scalars())
            ops = [
                (r.operation_id, r.body)
                for r in conn.execute(
                    sa.text("SELECT operation_id, body FROM outbox_operations ORDER BY id")
                )
            ]
    finally:
        engine.dispose()
    return order_ids, ops


@pytest.fixture
def ob(db_url: str) -> Iterator[Outbox]:
    with Outbox(db_url, endpoints=[INVENTORY]) as box:
        yield box


Scenario = Callable[[AsyncEngine], Awaitable[None]]


def run(db_url: str, scenario: Scenario) -> None:
    async def main() -> None:
        engine = outbox.create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(metadata.create_all)
            await scenario(engine)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_create_async_engine_picks_the_async_drivers(db_url: str) -> None:
    async def check(engine: AsyncEngine) -> None:
        assert engine.dialect.driver in ("aiosqlite", "psycopg")
        assert engine.dialect.is_async

    run(db_url, check)


@pytest.mark.parametrize("via", ["connection", "session"])
def test_commit_stores_the_order_and_the_operation(ob: Outbox, db_url: str, via: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        if via == "connection":
            async with engine.begin() as conn:
                await conn.execute(orders.insert().values(id=17))
                op = await ob.enqueue_async(**ARGS, connection=conn)
        else:
            async with AsyncSession(engine) as session, session.begin():
                await session.execute(orders.insert().values(id=17))
                op = await ob.enqueue_async(**ARGS, connection=session)
        assert op.state is State.PENDING
        assert op.operation_id == "order-17-reserve"

    run(db_url, scenario)
    assert rows(db_url) == ([17], [("order-17-reserve", '{"quantity":2,"sku":"TEST-BOLT"}')])


@pytest.mark.parametrize("via", ["connection", "session"])
def test_rollback_leaves_neither(ob: Outbox, db_url: str, via: str) -> None:
    class Declined(Exception):
        pass

    async def scenario(engine: AsyncEngine) -> None:
        with pytest.raises(Declined):
            if via == "connection":
                async with engine.begin() as conn:
                    await conn.execute(orders.insert().values(id=17))
                    await ob.enqueue_async(**ARGS, connection=conn)
                    raise Declined
            else:
                async with AsyncSession(engine) as session, session.begin():
                    await session.execute(orders.insert().values(id=17))
                    await ob.enqueue_async(**ARGS, connection=session)
                    raise Declined

    run(db_url, scenario)
    assert rows(db_url) == ([], [])


def test_enqueue_never_commits_the_callers_transaction(ob: Outbox, db_url: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with engine.connect() as conn:
            await conn.execute(orders.insert().values(id=17))
            await ob.enqueue_async(**ARGS, connection=conn)
            assert conn.in_transaction()
            await conn.rollback()

    run(db_url, scenario)
    assert rows(db_url) == ([], [])


def test_same_arguments_return_the_stored_operation_and_conflicts_write_nothing(
    ob: Outbox, db_url: str
) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            first = await ob.enqueue_async(**ARGS, connection=conn)
        async with engine.begin() as conn:
            again = await ob.enqueue_async(**ARGS, connection=conn)
        assert again.pk == first.pk
        with pytest.raises(OperationConflict):
            async with engine.begin() as conn:
                await conn.execute(orders.insert().values(id=18))
                await ob.enqueue_async(**{**ARGS, "json": {"sku": "OTHER"}}, connection=conn)

    run(db_url, scenario)
    # The conflicting call raised inside the caller's transaction, which rolled back.
    assert rows(db_url) == ([], [("order-17-reserve", '{"quantity":2,"sku":"TEST-BOLT"}')])


def test_bad_input_is_refused_before_the_database_is_touched(ob: Outbox, db_url: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            await conn.execute(orders.insert().values(id=17))
            with pytest.raises(ValidationError, match="operation_id"):
                await ob.enqueue_async(**{**ARGS, "operation_id": "bad id"}, connection=conn)
            with pytest.raises(ValidationError, match="unknown endpoint"):
                await ob.enqueue_many_async(
                    [Intent("inventory", "POST", "/a"), Intent("nowhere", "POST", "/b")],
                    connection=conn,
                )
            # The caller's transaction is intact (on PostgreSQL, not aborted): it commits.

    run(db_url, scenario)
    assert rows(db_url) == ([17], [])


def test_enqueue_many_async_stores_all_in_the_callers_transaction(ob: Outbox, db_url: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            ops = await ob.enqueue_many_async(
                [
                    Intent("inventory", "POST", "/r", {"n": n}, operation_id=f"op-{n}")
                    for n in (1, 2)
                ],
                connection=conn,
            )
            assert [op.operation_id for op in ops] == ["op-1", "op-2"]
            await conn.rollback()
        async with engine.begin() as conn:
            await ob.enqueue_many_async(
                [Intent("inventory", "POST", "/r", {"n": 3}, operation_id="op-3")], connection=conn
            )

    run(db_url, scenario)
    assert [op for op, _ in rows(db_url)[1]] == ["op-3"]


def test_two_tasks_racing_on_one_key_store_one_row(ob: Outbox, db_url: str) -> None:
    """A holds its transaction with the operation inserted; B enqueues the same key in
    its own transaction and must wait for A; A commits; B gets A's operation."""

    async def scenario(engine: AsyncEngine) -> None:
        a_inserted = asyncio.Event()
        a_may_commit = asyncio.Event()
        b_started = asyncio.Event()
        b_pid: list[int] = []

        async def task_a() -> int:
            async with engine.begin() as conn:
                await conn.execute(orders.insert().values(id=1))
                op = await ob.enqueue_async(**ARGS, connection=conn)
                a_inserted.set()
                await a_may_commit.wait()
            return op.pk

        async def task_b() -> int:
            await a_inserted.wait()
            async with engine.connect() as conn:
                if engine.dialect.name == "postgresql":
                    b_pid.append(
                        (await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar_one()
                    )
                    await conn.commit()
                b_started.set()
                async with conn.begin():
                    op = await ob.enqueue_async(**ARGS, connection=conn)
            return op.pk

        a = asyncio.create_task(task_a())
        b = asyncio.create_task(task_b())
        await b_started.wait()
        if engine.dialect.name == "postgresql":
            # Proof that B is inside its INSERT, blocked on A's uncommitted row.
            async with engine.connect() as watcher:
                while True:
                    wait = (
                        await watcher.execute(
                            sa.text("SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p"),
                            {"p": b_pid[0]},
                        )
                    ).scalar()
                    await watcher.commit()
                    if wait == "Lock":
                        break
                    await asyncio.sleep(0.01)
        assert not b.done()  # SQLite: B cannot begin its write until A's lock is released
        a_may_commit.set()
        assert await a == await b

    run(db_url, scenario)
    assert rows(db_url) == ([1], [("order-17-reserve", '{"quantity":2,"sku":"TEST-BOLT"}')])


def test_an_async_connection_given_to_the_sync_api_names_the_async_method(
    ob: Outbox, db_url: str
) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with engine.begin() as conn:
            await conn.execute(orders.insert().values(id=17))
            with pytest.raises(ValidationError, match=r"await ob\.enqueue_async\("):
                ob.enqueue(**ARGS, connection=conn)
            with pytest.raises(ValidationError, match=r"await ob\.enqueue_many_async\("):
                ob.enqueue_many([Intent(**ARGS)], connection=conn)
            async with AsyncSession(engine) as session:
                with pytest.raises(ValidationError, match=r"await ob\.enqueue_async\("):
                    ob.enqueue(**ARGS, connection=session)
            refused = pytest.raises(ValidationError, match=r"async with ob\.transaction_async")
            with refused, ob.transaction(engine):
                pass

    run(db_url, scenario)
    assert rows(db_url) == ([17], [])


def test_a_sync_connection_given_to_the_async_api_names_the_sync_method(
    ob: Outbox, db_url: str
) -> None:
    sync_engine = sa.create_engine(db_url)

    async def scenario(engine: AsyncEngine) -> None:
        refused = pytest.raises(ValidationError, match=r"ob\.enqueue\(")
        with sync_engine.connect() as conn, refused:
            await ob.enqueue_async(**ARGS, connection=conn)
        with pytest.raises(ValidationError, match="synchronous"):
            async with ob.transaction_async(sync_engine):
                pass

    try:
        run(db_url, scenario)
    finally:
        sync_engine.dispose()
    assert rows(db_url) == ([], [])


def test_transaction_async_commits_or_rolls_back_with_the_block(ob: Outbox, db_url: str) -> None:
    async def scenario(engine: AsyncEngine) -> None:
        async with ob.transaction_async(engine) as tx:
            assert isinstance(tx.connection, AsyncConnection)
            await tx.connection.execute(orders.insert().values(id=17))
            await tx.enqueue(**ARGS)
        with pytest.raises(RuntimeError):
            async with ob.transaction_async(engine) as tx:
                await tx.connection.execute(orders.insert().values(id=18))
                await tx.enqueue(**{**ARGS, "operation_id": "order-18-reserve"})
                raise RuntimeError("declined")
        # Joining an AsyncSession's transaction leaves its end to the session.
        async with AsyncSession(engine) as session:
            await session.execute(orders.insert().values(id=19))
            async with ob.transaction_async(session) as tx:
                await tx.enqueue_many([Intent(**{**ARGS, "operation_id": "order-19-reserve"})])
            assert session.in_transaction()
            await session.rollback()

    run(db_url, scenario)
    assert rows(db_url) == ([17], [("order-17-reserve", '{"quantity":2,"sku":"TEST-BOLT"}')])


def test_own_transaction_enqueue_async_and_reads(ob: Outbox, db_url: str) -> None:
    async def scenario(_engine: AsyncEngine) -> None:
        op = await ob.enqueue_async(**ARGS)
        assert (await ob.get_async("order-17-reserve")).pk == op.pk
        assert await ob.find_async("order-18-reserve") is None
        with pytest.raises(OperationNotFound):
            await ob.get_async("order-18-reserve")
        with pytest.raises(OperationNotFound):
            await ob.wait_async("order-18-reserve", timeout=1)

    run(db_url, scenario)
    assert [op for op, _ in rows(db_url)[1]] == ["order-17-reserve"]


def test_wait_async_lets_a_dispatcher_in_the_same_loop_deliver(db_url: str, tmp_path: Path) -> None:
    with Receiver(tmp_path / "receiver.sqlite3") as receiver:
        endpoint = Endpoint(
            name="inventory",
            base_url=receiver.url,
            timeout=2.0,
            retry=RetryPolicy(max_attempts=3, window=timedelta(seconds=30), wait=wait_fixed(0.1)),
            key_retention=timedelta(hours=1),
        )
        with Outbox(db_url, endpoints=[endpoint]) as box:

            async def scenario(engine: AsyncEngine) -> None:
                async with box.transaction_async(engine) as tx:
                    await tx.connection.execute(orders.insert().values(id=17))
                    await tx.enqueue(**ARGS)
                stop = asyncio.Event()
                dispatcher = asyncio.create_task(box.run_dispatcher_async(stop=stop))
                try:
                    op = await box.wait_async("order-17-reserve", timeout=30)
                finally:
                    stop.set()
                    await dispatcher
                assert op.state is State.SUCCEEDED

            run(db_url, scenario)
        assert receiver.effect_count(key="order-17-reserve") == 1


def test_sqlite_own_transaction_enqueue_async_inside_the_tasks_transaction_fails_at_once(
    sqlite_url: str,
) -> None:
    with Outbox(sqlite_url, endpoints=[INVENTORY]) as box:

        async def scenario(engine: AsyncEngine) -> None:
            async with engine.begin() as conn:
                await conn.execute(orders.insert().values(id=17))
                with pytest.raises(ValidationError, match=r"pass connection=… \(you are inside"):
                    await box.enqueue_async(**ARGS)
                with pytest.raises(ValidationError, match=r"pass connection=…"):
                    await box.enqueue_many_async([Intent(**ARGS)])
            # The transaction ended: the same task may now enqueue on its own.
            await box.enqueue_async(**ARGS)

        run(sqlite_url, scenario)
    assert rows(sqlite_url) == ([17], [("order-17-reserve", '{"quantity":2,"sku":"TEST-BOLT"}')])
