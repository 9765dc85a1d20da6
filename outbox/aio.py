"""Native asyncio for applications on SQLAlchemy's ``AsyncEngine``.

``await ob.enqueue_async(..., connection=conn)`` joins the caller's ``AsyncConnection``
or ``AsyncSession`` transaction and never commits it. It shares the synchronous code
path exactly: the arguments are validated and canonicalised in the event loop (pure,
nothing touched), then the very same store call runs on the async connection's
synchronous facade through ``AsyncConnection.run_sync`` — one SQL, one conflict rule.
Without ``connection`` the operation commits in a transaction of its own, run in a
worker thread so the event loop never blocks on the database.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, Unpack, cast

from sqlalchemy import Connection

from outbox.canonical import Checked, EnqueueArgs, Intent, check_operation_id, check_tenant
from outbox.errors import OperationNotFound, ValidationError, WaitTimeout
from outbox.model import Operation

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    from outbox.store.base import Store


def is_async_connection(obj: object) -> bool:
    """Whether ``obj`` is an AsyncConnection, AsyncSession or AsyncEngine."""
    aio = sys.modules.get("sqlalchemy.ext.asyncio")  # never imported: cannot be one
    if aio is None:
        return False
    return isinstance(obj, aio.AsyncConnection | aio.AsyncSession | aio.AsyncEngine)


async def async_connection_of(connection: Any, method: str) -> AsyncConnection:
    """The AsyncConnection of an AsyncConnection or AsyncSession (joining its transaction)."""
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(connection, AsyncConnection):
        return connection
    if isinstance(connection, AsyncSession):
        return await connection.connection()
    if isinstance(connection, Connection) or callable(getattr(connection, "connection", None)):
        raise ValidationError(
            f"{type(connection).__name__} is synchronous: use "
            f"`ob.{method}(..., connection=...)`, or pass an AsyncConnection or AsyncSession"
        )
    raise ValidationError("connection must be a SQLAlchemy AsyncConnection or AsyncSession")


class EnqueueHost(Protocol):
    """What the mixins here and in :mod:`outbox.transaction` use of the
    :class:`~outbox.client.Outbox` they are mixed into (the client checks it has them)."""

    @property
    def store(self) -> Store: ...

    # The enqueue methods as outbox.client.Outbox spells them; only their results are
    # restated here, so their parameter lists are written once, on the Outbox.
    def enqueue(self, *args: Any, **kwargs: Any) -> Operation: ...

    def enqueue_many(self, *args: Any, **kwargs: Any) -> list[Operation]: ...

    async def enqueue_async(self, *args: Any, **kwargs: Any) -> Operation: ...

    async def enqueue_many_async(self, *args: Any, **kwargs: Any) -> list[Operation]: ...

    def get(self, operation_id: str, *, tenant: str = "") -> Operation: ...

    def find(self, operation_id: str, *, tenant: str = "") -> Operation | None: ...

    def _refuse_if_caller_holds_the_lock(self) -> None: ...

    def _validate(self, intent: Intent) -> Checked: ...

    def _enqueue_checked(self, conn: Connection, checked: Checked) -> Operation: ...

    def _enqueue_many_on(self, conn: Connection, checked: list[Checked]) -> list[Operation]: ...


def _outbox(obj: object) -> EnqueueHost:
    return cast("EnqueueHost", obj)


class AsyncMethods:
    """The ``*_async`` methods of :class:`outbox.Outbox` (a mixin; use them on an Outbox)."""

    async def enqueue_async(
        self, *, connection: Any = None, **kw: Unpack[EnqueueArgs]
    ) -> Operation:
        """:meth:`Outbox.enqueue` for asyncio, with the same arguments: with
        ``connection`` (an ``AsyncConnection`` or ``AsyncSession``) the operation joins
        that transaction and is never committed by us; same validation, same idempotent
        re-enqueue, same :class:`OperationConflict`."""
        ob = _outbox(self)
        intent = Intent(**kw)
        if connection is None:
            # Checked here, in the caller's task: the worker thread is not the lock holder.
            ob._refuse_if_caller_holds_the_lock()
            return await asyncio.to_thread(functools.partial(ob.enqueue, **kw))
        conn = await async_connection_of(connection, "enqueue")
        checked = ob._validate(intent)  # before the database is touched
        return await conn.run_sync(ob._enqueue_checked, checked)

    async def enqueue_many_async(
        self, intents: Sequence[Intent], *, connection: Any = None
    ) -> list[Operation]:
        """:meth:`Outbox.enqueue_many` for asyncio: all are stored, or none."""
        ob = _outbox(self)
        checked = [ob._validate(intent) for intent in intents]
        if connection is None:
            # Checked here, in the caller's task: the worker thread is not the lock holder.
            ob._refuse_if_caller_holds_the_lock()
            return await asyncio.to_thread(ob.enqueue_many, intents)
        conn = await async_connection_of(connection, "enqueue_many")
        return await conn.run_sync(ob._enqueue_many_on, checked)

    async def get_async(self, operation_id: str, *, tenant: str = "") -> Operation:
        """:meth:`Outbox.get` without blocking the event loop."""
        return await asyncio.to_thread(_outbox(self).get, operation_id, tenant=tenant)

    async def find_async(self, operation_id: str, *, tenant: str = "") -> Operation | None:
        """:meth:`Outbox.find` without blocking the event loop."""
        return await asyncio.to_thread(_outbox(self).find, operation_id, tenant=tenant)

    async def wait_async(
        self, operation_id: str, *, tenant: str = "", timeout: float = 30.0, poll: float = 0.05
    ) -> Operation:
        """Until the operation is terminal or unresolved (raises WaitTimeout); the event
        loop keeps running, so a dispatcher in the same loop makes progress."""
        ob = _outbox(self)
        tenant = check_tenant(tenant)
        check_operation_id(operation_id)
        deadline = time.monotonic() + timeout
        while True:
            state = await asyncio.to_thread(ob.store.get_state, tenant, operation_id)
            if state is None:
                raise OperationNotFound(f"no operation {operation_id!r} in tenant {tenant!r}")
            if state.is_settled:
                return await self.get_async(operation_id, tenant=tenant)
            if time.monotonic() >= deadline:
                raise WaitTimeout(
                    f"operation {operation_id!r} is still {state.value} after {timeout}s"
                )
            await asyncio.sleep(poll)
