"""``ob.transaction()``: your transaction and an ``enqueue`` that cannot miss it.

The recommended way to enqueue atomically with your own rows::

    with ob.transaction(engine) as tx:
        tx.connection.execute(orders.insert().values(id=17))
        tx.enqueue(endpoint="inventory", method="POST", path="/reservations",
                   json={"sku": "TEST-BOLT"}, operation_id="order-17-reserve")

``tx.enqueue`` is bound to ``tx.connection``, so the operation cannot go to another
transaction by accident. Given an Engine (or AsyncEngine), the helper begins the
transaction and commits it at the end of the block (rolls back on an exception). Given
a Connection or Session already in a transaction, it joins that transaction and leaves
its end to you; one not in a transaction gets one for the block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Unpack, cast

from sqlalchemy import Connection, Engine

from outbox.aio import EnqueueHost, is_async_connection
from outbox.errors import ValidationError
from outbox.model import Operation

if TYPE_CHECKING:
    from outbox.canonical import EnqueueArgs, Intent


class Transaction:
    """What ``with ob.transaction(...)`` yields."""

    def __init__(self, outbox: EnqueueHost, connection: Any) -> None:
        self.outbox = outbox
        #: The Connection the block runs in (or the Session you passed): run your own
        #: statements on it.
        self.connection = connection

    def enqueue(self, **kw: Unpack[EnqueueArgs]) -> Operation:
        """:meth:`Outbox.enqueue` in this transaction, with the same arguments."""
        return self.outbox.enqueue(connection=self.connection, **kw)

    def enqueue_many(self, intents: Sequence[Intent]) -> list[Operation]:
        """:meth:`Outbox.enqueue_many` in this transaction."""
        return self.outbox.enqueue_many(intents, connection=self.connection)


class AsyncTransaction:
    """What ``async with ob.transaction_async(...)`` yields."""

    def __init__(self, outbox: EnqueueHost, connection: Any) -> None:
        self.outbox = outbox
        #: The AsyncConnection the block runs in (or the AsyncSession you passed).
        self.connection = connection

    async def enqueue(self, **kw: Unpack[EnqueueArgs]) -> Operation:
        """:meth:`Outbox.enqueue_async` in this transaction, with the same arguments."""
        return await self.outbox.enqueue_async(connection=self.connection, **kw)

    async def enqueue_many(self, intents: Sequence[Intent]) -> list[Operation]:
        """:meth:`Outbox.enqueue_many_async` in this transaction."""
        return await self.outbox.enqueue_many_async(intents, connection=self.connection)


def _is_session(obj: object) -> bool:
    return callable(getattr(obj, "in_transaction", None)) and callable(
        getattr(obj, "connection", None)
    )


class TransactionMethods:
    """``Outbox.transaction`` and ``Outbox.transaction_async`` (a mixin)."""

    @contextmanager
    def transaction(self, target: Any) -> Iterator[Transaction]:
        """Your transaction on ``target`` (an Engine, Connection or ORM Session) and an
        ``enqueue`` bound to it. See the module docstring."""
        ob = cast("EnqueueHost", self)
        if is_async_connection(target):
            raise ValidationError(
                f"{type(target).__name__} is asynchronous: use "
                "`async with ob.transaction_async(...) as tx`"
            )
        if isinstance(target, Engine):
            with target.begin() as conn:
                yield Transaction(ob, conn)
            ob.store.announce()  # committed: wake this process's dispatchers (SQLite)
        elif isinstance(target, Connection) or _is_session(target):
            if target.in_transaction():
                yield Transaction(ob, target)  # the caller's: its end is theirs
            else:
                with target.begin():
                    yield Transaction(ob, target)
                ob.store.announce()
        else:
            raise ValidationError(
                "transaction() takes a SQLAlchemy Engine, Connection or ORM Session"
            )

    @asynccontextmanager
    async def transaction_async(self, target: Any) -> AsyncIterator[AsyncTransaction]:
        """:meth:`transaction` for an AsyncEngine, AsyncConnection or AsyncSession."""
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

        ob = cast("EnqueueHost", self)
        if isinstance(target, AsyncEngine):
            async with target.begin() as conn:
                yield AsyncTransaction(ob, conn)
            ob.store.announce()
        elif isinstance(target, AsyncConnection | AsyncSession):
            if target.in_transaction():
                yield AsyncTransaction(ob, target)
            else:
                async with target.begin():
                    yield AsyncTransaction(ob, target)
                ob.store.announce()
        elif isinstance(target, Engine | Connection) or _is_session(target):
            raise ValidationError(
                f"{type(target).__name__} is synchronous: use `with ob.transaction(...) as tx`"
            )
        else:
            raise ValidationError(
                "transaction_async() takes an AsyncEngine, AsyncConnection or AsyncSession"
            )


#: Own-transaction enqueue from a caller that holds the SQLite file's write lock.
INSIDE_A_TRANSACTION = (
    "pass connection=… (you are inside a transaction on this database): this thread (or task) "
    "already holds the write lock on {path}, so an enqueue in a transaction of its own "
    "would wait for a lock only you can release. Enqueue on the connection (or Session) "
    "of your transaction, or use `with ob.transaction(engine) as tx: tx.enqueue(...)`."
)


def connection_of(connection: Any, method: str = "enqueue") -> Connection:
    if isinstance(connection, Connection):
        return connection
    if is_async_connection(connection):
        raise ValidationError(
            f"{type(connection).__name__} is asynchronous: use "
            f"`await ob.{method}_async(..., connection=...)`"
        )
    get = getattr(connection, "connection", None)
    if callable(get):  # an ORM Session: join its transaction
        conn = get()
        if isinstance(conn, Connection):
            return conn
    raise ValidationError("connection must be a SQLAlchemy Connection or ORM Session")
