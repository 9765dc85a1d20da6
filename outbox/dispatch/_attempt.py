"""The send path of one attempt: lease check, window check, build, send, outcome.

Each claimed operation becomes one :meth:`AttemptSender.send` task on the dispatcher's
loop. Whatever happens, exactly one of two things follows: an outcome is queued for the
outcome writer, or (a bug, a failpoint) the ``crashed`` callback frees the slot and the
attempt row stays open until its lease expires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
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


class AttemptSender:
    """Sends the attempts of one dispatcher; given what it needs by that dispatcher."""

    def __init__(
        self,
        *,
        clock: Clock,
        lease_margin_seconds: float,
        summary: DispatchSummary,
        observe: Instrumentation,
        log: OutboxLogger,
        client: Callable[[Endpoint], httpx.AsyncClient],
        secret_headers: Sequence[str],
        outcomes: asyncio.Queue[AttemptOutcome | None],
        lease_left: Callable[[Work], float],
        known_down: Callable[[str, int], bool],
        crashed: Callable[[int], None],
        limits: Limits | None = None,
    ) -> None:
        self._clock = clock
        self._lease_margin = lease_margin_seconds
        self._summary = summary
        self._observe = observe
        self._log = log
        self._client = client
        self._secret_headers = tuple(secret_headers)
        self._outcomes = outcomes
        #: Seconds of a work's lease left, on the monotonic clock.
        self._lease_left = lease_left
        #: Whether an endpoint is known down (its circuit open, or this is its probe).
        self._known_down = known_down
        #: Frees the slot of an attempt that raised before its outcome was queued.
        self._crashed = crashed
        #: The fleet's rate and in-flight limits (``outbox.dispatch.limits``).
        self._limits = limits

    async def send(self, work: Work) -> None:
        """Check the lease and the window, build the request, send it, queue the outcome."""
        c, endpoint, started = work.claimed, work.endpoint, work.started
        log = self._log.bind(
            operation_id=c.operation_id,
            tenant=c.tenant,
            endpoint=endpoint.name,
            request_id=started.request_id,
            attempt=started.number,
        )
        limits, held = self._limits, False
        try:
            if limits is not None and limits.limited(endpoint.name):
                held = await limits.admit(endpoint)  # wait for the fleet's limits
            await failpoints.hit("after_attempt_commit")
            # Re-check the lease on the monotonic clock: a process that was paused (GC,
            # SIGSTOP, a frozen VM) must not wake up and send on a lease it lost.
            remaining = self._lease_left(work)
            if remaining < endpoint.timeout + self._lease_margin:
                self._summary.lease_check_failed += 1
                log.warning("lease_check_failed", remaining_seconds=round(remaining, 3))
                await self._outcomes.put(
                    not_sent_outcome(
                        work,
                        ErrorClass.LEASE_CHECK_FAILED,
                        "not sent: too little of the lease was left for a full attempt",
                        self._clock.now_ms(),
                    )
                )
                return
            deadline = send_deadline_ms(c, endpoint, started, self._clock.now_ms())
            if self._clock.now_ms() > deadline:
                # The window closed between the claim and now: never send after it. The
                # next claim settles the operation as unresolved.
                log.warning("window_closed_before_send")
                await self._outcomes.put(
                    not_sent_outcome(
                        work,
                        ErrorClass.WINDOW_CLOSED_BEFORE_SEND,
                        "not sent: the retry window closed between the claim and the send",
                        self._clock.now_ms(),
                    )
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
                await self._outcomes.put(
                    attempt_outcome(work, unbuilt_attempt(exc), self._clock.now_ms())
                )
                return
            sending = Sending(c, endpoint, started, headers)
            traced = self._observe.attempt_started(work.batch, sending)
            log.info("attempt_started")
            self._summary.attempts += 1
            result = await send_attempt(
                self._client(endpoint),
                endpoint,
                method=c.method,
                path=c.path,
                headers=headers,
                body=body,
                now_ms=self._clock.now_ms,
                public_headers=c.headers,
                secret_headers=self._secret_headers,
            )
            self._observe.attempt_sent(traced, result)
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
            down = self._known_down(endpoint.name, c.pk)
            await self._outcomes.put(
                attempt_outcome(work, result, self._clock.now_ms(), known_down=down)
            )
        except Exception as exc:
            # A bug or a failpoint: leave the attempt open. The lease expires and the
            # next claim records it as unknown; nothing is lost or resent early.
            log.exception("attempt_crashed", error=type(exc).__name__)
            self._crashed(c.pk)
        finally:
            if held:
                limits.release(endpoint)  # type: ignore[union-attr]
