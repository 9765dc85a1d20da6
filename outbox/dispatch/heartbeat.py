"""Dispatcher heartbeats: each running dispatcher writes its row in ``outbox_dispatchers``
every few seconds, marks it stopped on a graceful exit, and deletes rows of dispatchers
gone for a day. A crashed dispatcher's row simply stops moving: ``outbox status`` lists
it as lost once it has been silent longer than the dispatcher timeout.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING

from outbox.base.logs import OutboxLogger, get_logger
from outbox.base.version import __version__
from outbox.store import monitoring

if TYPE_CHECKING:
    from outbox.observe.hooks import RunningDispatcher

logger = get_logger("outbox.dispatch")

#: Rows of dispatchers not seen for this long are deleted (by any running dispatcher).
FORGET_AFTER_MS = 24 * 3_600_000
_PRUNE_EVERY_BEATS = 120


async def beat(dispatcher: RunningDispatcher) -> None:
    """Write the dispatcher's row until cancelled; a failed write is logged, never raised."""
    log = logger.bind(dispatcher_id=dispatcher.dispatcher_id)
    started_at = dispatcher.clock.now_ms()
    host, pid = socket.gethostname(), os.getpid()
    beats = 0
    steps = getattr(dispatcher.clock, "steps", 0)
    while True:
        try:
            now = dispatcher.clock.now_ms()
            steps = _report_steps(dispatcher, log, steps)
            await dispatcher.run_db(
                monitoring.heartbeat,
                store=dispatcher.store,
                dispatcher_id=dispatcher.dispatcher_id,
                host=host,
                pid=pid,
                version=__version__,
                concurrency=dispatcher.settings.concurrency,
                in_flight=dispatcher.in_flight,
                started_at_ms=started_at,
                now_ms=now,
                wake_mode=dispatcher.wake_mode,
            )
            if beats % _PRUNE_EVERY_BEATS == 0:
                await dispatcher.run_db(
                    monitoring.prune_dispatchers,
                    store=dispatcher.store,
                    seen_before_ms=now - FORGET_AFTER_MS,
                )
            beats += 1
        except Exception as exc:
            log.warning("heartbeat_failed", error=type(exc).__name__, detail=str(exc)[:300])
        await asyncio.sleep(dispatcher.settings.heartbeat_seconds)


def _report_steps(dispatcher: RunningDispatcher, log: OutboxLogger, seen: int) -> int:
    """Log the wall-clock steps the dispatcher's clock saw since the last beat (a
    ``SystemClock`` counts them); the count now."""
    steps = getattr(dispatcher.clock, "steps", 0)
    if steps > seen:
        log.warning(
            "clock_stepped",
            step_seconds=getattr(dispatcher.clock, "last_step_ms", 0) / 1000,
            steps=steps - seen,
            detail="the wall clock stepped: expired leases are taken over again only "
            "once this clock has run one lease period without a step",
        )
    return steps


async def stopped(dispatcher: RunningDispatcher) -> None:
    """Mark the row stopped: a graceful exit shows at once, not after the timeout."""
    try:
        await dispatcher.run_db(
            monitoring.dispatcher_stopped,
            store=dispatcher.store,
            dispatcher_id=dispatcher.dispatcher_id,
            now_ms=dispatcher.clock.now_ms(),
        )
    except Exception as exc:
        logger.warning(
            "heartbeat_failed",
            dispatcher_id=dispatcher.dispatcher_id,
            error=type(exc).__name__,
            detail=str(exc)[:300],
        )
