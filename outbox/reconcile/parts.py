"""What the layers below the client read of an :class:`~outbox.client.Outbox`.

Status, operator and probe actions, and metrics need an outbox's store, clock, endpoints
and transport factory, and to read one operation. They accept any object that has these
(an ``Outbox`` is one), so they do not import the client, which sits above them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import httpx

    from outbox.clock import Clock
    from outbox.config import Endpoint
    from outbox.model import Operation
    from outbox.store.base import Store


class OutboxParts(Protocol):
    """The parts of an outbox its status, operator actions and metrics use."""

    @property
    def store(self) -> Store: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...

    @property
    def transport_factory(
        self,
    ) -> Callable[[Endpoint], httpx.AsyncBaseTransport | None] | None: ...

    def get(self, operation_id: str, *, tenant: str = "") -> Operation:
        """The operation, or :class:`~outbox.errors.OperationNotFound`."""
        ...
