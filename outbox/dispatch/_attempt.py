"""The send path of one attempt: lease check, window check, build, send, outcome.

Each claimed operation becomes one :meth:`AttemptSender.send` task on the dispatcher's
loop. Whatever happens, exactly one of two things follows: an outcome is queued for the
outcome writer, or (a bug, a failpoint) the ``crashed`` callback frees the slot and the
attempt row stays open until its lease expires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from outbox.base.logs import OutboxLogger
from outbox.clock import Clock
from outbox.config import Endpoint
from outbox.dispatch import failpoints
from outbox.dispatch.outcomes import (
    DispatchSummary,
    Work,
    attempt_outcome,
    not_sent_outcome,
    send_deadline_ms,
)
from outbox.model import ErrorClass
from outbox.observe.hooks import Sending
from outbox.store.records import AttemptOutcome
from outbox.wire.transport import request_headers, send_attempt, unbuilt_attempt

if TYPE_CHECKING:
    from outbox.dispatch.limits import Limits
    from outbox.observe.hooks import Instrumentation


@dataclass(kw_only=True, eq=False, slots=True)
class AttemptSender:
    """Sends the attempts of one dispatcher; given what it needs by that dispatcher."""

    clock: Clock
    lease_margin_seconds: float
    summary: DispatchSummary
    observe: Instrumentation
    log: OutboxLogger
    client: Callable[[Endpoint], httpx.AsyncClient]
    secret_headers: Sequence[str]
    outcomes: asyncio.Queue[AttemptOutcome | None]
    #: Seconds of a work's lease left, on the monotonic clock.
    lease_left: Callable[[Work], float]
    #: Whether an endpoint is known down (its circuit open, or this is its probe).
    known_down: Callable[[str, int], bool]
    #: Frees the slot of an attempt that raised before its outcome was queued.
    crashed: Callable[[int], None]
    #: The fleet's rate and in-flight limits (``outbox.dispatch.limits``).
    limits: Limits | None = None

    def __post_init__(self) -> None:
        self.secret_headers = tuple(self.secret_headers)

    async def _give_back(self, work: Work, error_class: ErrorClass, message: str) -> None:
        """Queue the outcome of a request given back before it left (not sent, due now)."""
        await self.outcomes.put(not_sent_outcome(work, error_class, message, self.clock.now_ms()))

    async def send(self, work: Work) -> None:
        """Check the lease and the window, build the request, send it, queue the outcome."""
        c, endpoint, started = work.claimed, work.endpoint, work.started
        log = self.log.bind(
            operation_id=c.operation_id,
            tenant=c.tenant,
            endpoint=endpoint.name,
            request_id=started.request_id,
            attempt=started.number,
        )
        limits, held = self.limits, False
        try:
            if limits is not None and limits.limited(endpoint.name):
                held = await limits.admit(endpoint)  # wait for the fleet's limits
            await failpoints.hit("after_attempt_commit")
            # Re-check the lease on the monotonic clock: a process that was paused (GC,
            # SIGSTOP, a frozen VM) must not wake up and send on a lease it lost.
            remaining = self.lease_left(work)
            if remaining < endpoint.timeout + self.lease_margin_seconds:
                self.summary.lease_check_failed += 1
                log.warning("lease_check_failed", remaining_seconds=round(remaining, 3))
                await self._give_back(
                    work,
                    ErrorClass.LEASE_CHECK_FAILED,
                    "not sent: too little of the lease was left for a full attempt",
                )
                return
            deadline = send_deadline_ms(c, endpoint, started, self.clock.now_ms())
            if self.clock.now_ms() > deadline:
                # The window closed between the claim and now: never send after it. The
                # next claim settles the operation as unresolved.
                log.warning("window_closed_before_send")
                await self._give_back(
                    work,
                    ErrorClass.WINDOW_CLOSED_BEFORE_SEND,
                    "not sent: the retry window closed between the claim and the send",
                )
                return
            try:  # anything raising before the first byte is written: not sent
                headers = request_headers(
                    endpoint,
                    stored_headers=c.headers,
                    operation_id=c.operation_id,
                    request_id=started.request_id,
                    tenant=c.tenant,
                    has_body=c.body is not None or c.body_raw is not None,
                )
                body = c.body_bytes()
            except Exception as exc:
                log.warning("attempt_not_built", error=type(exc).__name__)
                await self.outcomes.put(
                    attempt_outcome(work, unbuilt_attempt(exc), self.clock.now_ms())
                )
                return
            sending = Sending(c, endpoint, started, headers)
            traced = self.observe.attempt_started(work.batch, sending)
            log.info("attempt_started")
            self.summary.attempts += 1
            result = await send_attempt(
                self.client(endpoint),
                endpoint,
                method=c.method,
                path=c.path,
                headers=headers,
                body=body,
                now_ms=self.clock.now_ms,
                public_headers=c.headers,
                secret_headers=self.secret_headers,
            )
            self.observe.attempt_sent(traced, result)
            if limits is not None:
                limits.answered(endpoint, result)
            log.info(
                "attempt_finished",
                status=result.status_code,
                delivery=result.classification.delivery,
                verdict=result.classification.verdict,
                error=result.error_class,
                duration_ms=result.duration_ms,
            )
            await failpoints.hit("after_response")
            down = self.known_down(endpoint.name, c.pk)
            await self.outcomes.put(
                attempt_outcome(work, result, self.clock.now_ms(), known_down=down)
            )
        except Exception as exc:
            # A bug or a failpoint: leave the attempt open. The lease expires and the
            # next claim records it as unknown; nothing is lost or resent early.
            log.exception("attempt_crashed", error=type(exc).__name__)
            self.crashed(c.pk)
        finally:
            if held:
                limits.release(endpoint)  # type: ignore[union-attr]
