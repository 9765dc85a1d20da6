"""Status lookups a dispatcher makes as operations become unresolved.

When an operation the dispatcher just wrote as unresolved has an endpoint with a
``status_lookup`` (``on_unresolved=True``), the receiver is asked at once; the answer is
settled on the dispatcher's database thread by the ``on_unresolved`` callback the client
gives (:func:`outbox.reconcile.probe.settle_after_dispatch`), so the dispatcher needs no
operator code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from outbox.base.logs import OutboxLogger
from outbox.config import Endpoint
from outbox.dispatch.outcomes import DispatchSummary
from outbox.model import Reason, State
from outbox.store.records import AttemptOutcome
from outbox.wire.lookup import lookup_status

if TYPE_CHECKING:
    from outbox.observe.hooks import Instrumentation
    from outbox.reconcile.probe import ProbeOutcome


#: Settles an operation that just became unresolved from its status lookup's answer,
#: on the dispatcher's database thread: ``(operation_id=, tenant=, result=)``.
OnUnresolved = Callable[..., "ProbeOutcome | None"]
#: Runs ``fn(**kwargs)`` on the dispatcher's database thread.
RunDb = Callable[..., Awaitable[Any]]


@dataclass(eq=False, slots=True)
class UnresolvedLookups:
    """The lookups one dispatcher has started; :meth:`drain` waits for them at stop."""

    on_unresolved: OnUnresolved | None
    _: KW_ONLY
    # What the owning dispatcher lends: its HTTP client per endpoint, its database
    # thread, its log, its instrumentation and the summary a settled lookup counts in.
    client: Callable[[Endpoint], httpx.AsyncClient]
    run_db: RunDb
    log: OutboxLogger
    observe: Instrumentation
    summary: DispatchSummary
    _tasks: set[asyncio.Task[None]] = field(init=False, default_factory=set)

    def maybe(self, out: AttemptOutcome, endpoint: Endpoint | None, names: dict[str, Any]) -> None:
        """Ask the receiver about an operation that just became unresolved, if it can be
        asked."""
        if (
            self.on_unresolved is None
            or endpoint is None
            or endpoint.status_lookup is None
            or not endpoint.status_lookup.on_unresolved
            or out.reason is Reason.KEY_CONFLICT
        ):
            return
        task = asyncio.create_task(
            self._look_up(self.on_unresolved, endpoint, names["operation_id"], names["tenant"])
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _look_up(
        self, settle: OnUnresolved, endpoint: Endpoint, operation_id: str, tenant: str
    ) -> None:
        log = self.log.bind(operation_id=operation_id, tenant=tenant, endpoint=endpoint.name)
        try:
            result = await lookup_status(self.client(endpoint), endpoint, operation_id, tenant)
            outcome = await self.run_db(
                settle, operation_id=operation_id, tenant=tenant, result=result
            )
        except Exception:
            log.exception("status_lookup_failed")
            return
        self.observe.status_lookup(endpoint.name, result.status.value)
        log.info(
            "status_lookup",
            answer=result.status.value,
            action=outcome.action.value if outcome else "none",
        )
        if outcome is not None and outcome.state is State.SUCCEEDED:
            self.summary.succeeded += 1
