"""The dispatcher: claim -> commit attempt rows -> check the lease -> send -> record.

One asyncio loop sends; one database thread runs the short store transactions, so no
transaction is ever open while a request is on the wire. Outcomes are written in
batches by a single writer task, each write fenced on the claim's lease token.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from sqlalchemy.exc import DBAPIError

from outbox import failpoints, heartbeat
from outbox.clock import Clock, OffsetClock
from outbox.config import DispatcherSettings, Endpoint, RetryPolicy
from outbox.dbthread import DatabaseUnresponsive, DbThread, error_detail, is_transient
from outbox.errors import StoreError
from outbox.logs import get_logger
from outbox.lookup import lookup_status
from outbox.model import Delivery, ErrorClass, Reason, State, Verdict
from outbox.observe import NOTHING, Instrumentation
from outbox.policy import decide, reason_from_history
from outbox.store.base import Store
from outbox.store.records import AttemptOutcome, Claimed, Settlement, StartedAttempt
from outbox.transport import AttemptResult, build_client, request_headers, send_attempt
from outbox.wakeup import Wakeup

if TYPE_CHECKING:
    from outbox.reconcile.probe import ProbeOutcome

logger = get_logger("outbox.dispatch")

T = TypeVar("T")
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport | None]
#: Settles an operation that just became unresolved from its status lookup's answer,
#: on the dispatcher's database thread: ``(operation_id=, tenant=, result=)``; the
#: client supplies :func:`outbox.reconcile.probe.settle_after_dispatch`.
OnUnresolved = Callable[..., "ProbeOutcome | None"]

#: How often a dispatcher re-reads the database server's clock (PostgreSQL).
_CLOCK_SYNC_SECONDS = 30.0
#: An operation naming an endpoint this dispatcher does not know is put back for this long.
_UNKNOWN_ENDPOINT_DELAY_MS = 60_000
#: The window of an operation this dispatcher cannot send, when nothing says otherwise.
_DEFAULT_WINDOW_MS = RetryPolicy().window_ms
#: The longest wait between claims while the database refuses them.
_MAX_STORE_BACKOFF_SECONDS = 5.0
#: Outcome writes that fail on a transient database error are retried, with backoff
#: from the first to the max delay, at most this many times and only while the lease
#: of one of the batch's operations still holds.
_OUTCOME_TRIES = 30
_OUTCOME_RETRY_FIRST_SECONDS = 0.1
_OUTCOME_RETRY_MAX_SECONDS = 2.0


@dataclass
class DispatchSummary:
    """What a dispatcher did: counts of operations and attempts."""

    claimed: int = 0
    attempts: int = 0
    succeeded: int = 0
    failed: int = 0
    retry_scheduled: int = 0
    unresolved: int = 0
    recovered: int = 0
    fenced: int = 0
    lease_check_failed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "claimed": self.claimed,
            "attempts": self.attempts,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "retry_scheduled": self.retry_scheduled,
            "unresolved": self.unresolved,
            "recovered": self.recovered,
            "fenced": self.fenced,
            "lease_check_failed": self.lease_check_failed,
            "by_reason": dict(self.by_reason),
        }


@dataclass(frozen=True, slots=True)
class _Work:
    claimed: Claimed
    endpoint: Endpoint
    started: StartedAttempt
    token: str
    claimed_mono: float
    lease_seconds: float
    #: The instrumentation's handle on the claim batch (a trace span, say).
    batch: Any = None


def default_dispatcher_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Dispatcher:
    """Sends stored operations. Use through ``Outbox.run_dispatcher`` or ``dispatch_once``."""

    def __init__(
        self,
        *,
        store: Store,
        endpoints: Mapping[str, Endpoint],
        clock: Clock,
        settings: DispatcherSettings,
        transport_factory: TransportFactory | None = None,
        on_unresolved: OnUnresolved | None = None,
        secret_headers: Sequence[str] = (),
        instrumentation: Instrumentation | None = None,
    ) -> None:
        self.store = store
        self._observe = instrumentation or NOTHING
        # Settles an operation from a status lookup made as it became unresolved.
        self._on_unresolved = on_unresolved
        # Header names whose values are credentials: redacted where a receiver echoes them.
        self._secret_headers = tuple(secret_headers)
        self._lookups: set[asyncio.Task[None]] = set()
        self.endpoints = dict(endpoints)
        self.clock = clock
        self.settings = settings
        self.dispatcher_id = settings.dispatcher_id or default_dispatcher_id()
        self.lease_seconds = settings.lease_for(self.endpoints)
        self.summary = DispatchSummary()
        self._transport_factory = transport_factory
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._db = DbThread()
        self._outcomes: asyncio.Queue[AttemptOutcome | None] = asyncio.Queue()
        self._inflight = 0
        self._capacity = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        # pk -> the names the log binds, for the operations this dispatcher holds.
        self._names: dict[int, dict[str, Any]] = {}
        # pk -> when its lease ends, on the monotonic clock (bounds outcome-write retries).
        self._lease_ends: dict[int, float] = {}
        self._last_clock_sync = clock.monotonic()
        self._log = logger.bind(dispatcher_id=self.dispatcher_id)
        #: time.monotonic() of the last database call that answered (for /readyz).
        self.db_answered_at: float | None = None
        #: What wakes this dispatcher when idle (see outbox.wakeup); ``wakeup.stats``
        #: counts claims and wake-ups, ``wakeup.hooks`` observes them.
        self.wakeup = Wakeup(
            store.change_source(
                application_name=f"outbox-listener {self.dispatcher_id}",
                interval=settings.change_check_seconds,
            )
            if settings.wake_on_change
            else None,
            clock=clock,
            poll_seconds=settings.idle_poll_seconds,
        )
        self._claimed_none = False

    # -- plumbing -----------------------------------------------------------------

    async def run_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run ``fn(**kwargs)`` on the dispatcher's database thread."""
        return await self._run_db(fn, **kwargs)

    async def _run_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        result = await self._db.run(fn, **kwargs)
        self.db_answered_at = time.monotonic()
        return result

    @property
    def in_flight(self) -> int:
        """Operations this dispatcher holds right now (claimed, not yet recorded)."""
        return self._inflight

    def _client(self, endpoint: Endpoint) -> httpx.AsyncClient:
        client = self._clients.get(endpoint.name)
        if client is None:
            transport = self._transport_factory(endpoint) if self._transport_factory else None
            client = build_client(endpoint, transport)
            self._clients[endpoint.name] = client
        return client

    async def _maybe_sync_clock(self) -> None:
        if not isinstance(self.clock, OffsetClock):
            return
        if self.clock.monotonic() - self._last_clock_sync < _CLOCK_SYNC_SECONDS:
            return
        server_ms = await self._run_db(self.store.server_time_ms)
        if server_ms is not None:
            self.clock.sync(server_ms)
        self._last_clock_sync = self.clock.monotonic()

    # -- the loop -----------------------------------------------------------------

    async def run(
        self,
        stop: asyncio.Event | None = None,
        *,
        once: bool = False,
        until_empty: bool = False,
        on_progress: Callable[[DispatchSummary], None] | None = None,
    ) -> DispatchSummary:
        """Dispatch until ``stop`` is set (or one batch, with ``once``; or, with
        ``until_empty``, until nothing is due and nothing is in flight: retries scheduled
        for later stay pending). ``on_progress`` gets the summary after each claim."""
        stop = stop or asyncio.Event()
        try:
            await self._run_db(self.store.preflight)
        except BaseException:
            self._db.shutdown()
            raise
        watchdog = asyncio.create_task(
            self._db.watch(stop, self.settings.stop_timeout_seconds)
        )
        writer = asyncio.create_task(self._write_outcomes())
        if failpoints.armed():
            self._log.warning("failpoints_armed", points=failpoints.armed(),
                              detail="fault injection is on: this process may kill itself")
        elif failpoints.ignored_spec():
            self._log.warning("failpoints_ignored",
                              detail=f"{failpoints.ENV} is set but {failpoints.ENABLE_ENV} "
                              "is not; no failpoint is armed")
        self._observe.dispatcher_started(self)
        beats = None if once else asyncio.create_task(heartbeat.beat(self))
        if not once:
            await self.wakeup.start()
        self._log.info(
            "dispatcher_started",
            concurrency=self.settings.concurrency,
            lease_seconds=self.lease_seconds,
            once=once,
        )
        backoff = 0.0
        try:
            while not stop.is_set():
                free = self.settings.concurrency - self._inflight
                low_water = max(1, min(self.settings.batch_size, self.settings.concurrency) // 4)
                if free < low_water:
                    self._capacity.clear()
                    await _wait_any(self._capacity, stop, timeout=1.0)
                    continue
                try:
                    await self._maybe_sync_clock()
                    self.wakeup.before_claim()
                    started = await self._claim_and_start(min(free, self.settings.batch_size))
                    if self._claimed_none and not once:
                        self.wakeup.next_due(
                            await self._run_db(self.store.next_due_ms, now_ms=self.clock.now_ms())
                        )
                except (StoreError, DBAPIError) as exc:
                    # Locked, read-only or unreachable: nothing was claimed (or the claim's
                    # lease will simply expire). Back off and try again; never crash.
                    backoff = min(backoff * 2 if backoff else 0.1, _MAX_STORE_BACKOFF_SECONDS)
                    self._log.warning("store_unavailable", error=type(exc).__name__,
                                      detail=str(exc)[:300], retry_in_seconds=backoff)
                    if once:
                        raise
                    await _wait_any(stop, timeout=backoff)
                    continue
                backoff = 0.0
                for work in started:
                    self._inflight += 1
                    task = asyncio.create_task(self._attempt(work))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                if on_progress is not None:
                    on_progress(self.summary)
                if once:
                    break
                if self._claimed_none:
                    if until_empty:
                        if self._inflight == 0:
                            break  # nothing due, every outcome written
                        # Outcomes still to come may make something due again.
                        self._capacity.clear()
                        await _wait_any(self._capacity, stop, timeout=1.0)
                        continue
                    await self.wakeup.wait(stop)
        finally:
            await self.wakeup.close()
            # Graceful stop: no new claims; requests on the wire finish (each bounded by
            # its deadline) and their outcomes are written before we return.
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._outcomes.put(None)
            await writer
            if self._lookups:
                await asyncio.gather(*self._lookups, return_exceptions=True)
            for client in self._clients.values():
                await client.aclose()
            self._clients.clear()
            if beats is not None:
                beats.cancel()
                await asyncio.gather(beats, return_exceptions=True)
                await heartbeat.stopped(self)
            self._observe.dispatcher_stopped(self)
            watchdog.cancel()
            self._db.shutdown()
            if self._db.gave_up:
                self._log.error(
                    "dispatcher_stop_timed_out",
                    stop_timeout_seconds=self.settings.stop_timeout_seconds,
                    detail="the database did not answer; gave up. Leases held expire on "
                    "their own and another dispatcher takes over; nothing is resent "
                    "before that.",
                    **self.summary.as_dict(),
                )
            else:
                self._log.info("dispatcher_stopped", **self.summary.as_dict())
        if self._db.gave_up:
            raise DatabaseUnresponsive(
                f"the database did not answer within {self.settings.stop_timeout_seconds}s "
                "of the stop request; gave up (the leases held expire on their own)"
            )
        return self.summary

    async def _snapshot_policies(self, claimed: list[Claimed]) -> None:
        """Rows enqueued before policy snapshots get this endpoint's policy now, so
        operator tools can judge them without the application."""
        missing = {
            c.pk: self.endpoints[c.endpoint].policy_snapshot()
            for c in claimed
            if c.policy_window_ms is None and c.endpoint in self.endpoints
        }
        if not missing:
            return
        try:
            await self._run_db(self.store.snapshot_policies, policies=missing)
        except (StoreError, DBAPIError) as exc:
            # Only the operator's view loses: the next claim tries again.
            self._log.warning("policy_snapshot_failed", error=type(exc).__name__)

    async def _claim_and_start(self, limit: int) -> list[_Work]:
        token = str(uuid.uuid4())
        claim_ns = time.time_ns()
        claimed_mono = self.clock.monotonic()
        now = self.clock.now_ms()
        claimed, recovered = await self._run_db(
            self.store.claim,
            owner=self.dispatcher_id,
            token=token,
            now_ms=now,
            lease_ms=int(self.lease_seconds * 1000),
            limit=limit,
        )
        self._claimed_none = not claimed
        self.wakeup.after_claim(len(claimed))
        if not claimed:
            return []
        self.summary.claimed += len(claimed)
        batch = self._observe.claimed(claimed, recovered, claim_ns)
        self._log.debug("operations_claimed", count=len(claimed), lease_token=token)
        for rec in recovered:
            self.summary.recovered += 1
            self._log.warning(
                "lease_expired",
                operation_pk=rec.pk,
                request_id=rec.request_id,
                attempt=rec.number,
                previous_dispatcher=rec.dispatcher_id,
            )
        await failpoints.hit("after_claim")
        await self._snapshot_policies(claimed)

        to_send: dict[int, str] = {}
        settlements: list[Settlement] = []
        unsendable: dict[str, list[int]] = {}
        by_pk: dict[int, tuple[Claimed, Endpoint]] = {}
        for c in claimed:
            endpoint = self.endpoints.get(c.endpoint)
            problem = (
                self._not_registered(c.endpoint)
                if endpoint is None
                else endpoint.tenant_problem(c.tenant, c.operation_id)
            )
            if problem is not None or endpoint is None:
                assert problem is not None
                settlement = self._unsendable(c, token, now, problem)
                if settlement is not None:
                    settlements.append(settlement)
                else:
                    unsendable.setdefault(problem, []).append(c.pk)
                continue
            deadline = endpoint.deadline_ms(
                window_started_at_ms=c.window_started_at or now,
                first_attempt_at_ms=c.first_attempt_at or now,
            )
            if c.attempts_total and (
                now > deadline or c.attempts_counted >= endpoint.retry.max_attempts
            ):
                reason = reason_from_history(
                    maybe_delivered=c.maybe_delivered, saw_refusal=c.saw_refusal
                )
                settlements.append(Settlement(c.pk, token, State.UNRESOLVED, reason))
                continue
            to_send[c.pk] = str(uuid.uuid4())
            by_pk[c.pk] = (c, endpoint)
            self._names[c.pk] = {
                "operation_id": c.operation_id,
                "tenant": c.tenant,
                "endpoint": c.endpoint,
            }
        for problem, pks in unsendable.items():
            window_end = max(
                (self._unsendable_window_end(c, now) for c in claimed if c.pk in pks),
                default=now,
            )
            await self._run_db(
                self.store.release,
                token=token,
                now_ms=now,
                pks=pks,
                delay_ms=max(1, min(_UNKNOWN_ENDPOINT_DELAY_MS, window_end - now + 1)),
                last_error=problem,
            )
        if settlements:
            written = await self._run_db(self.store.settle, now_ms=now, settlements=settlements)
            for s in settlements:
                if s.pk in written:
                    self._observe.settled(
                        s.pk, s.state, s.reason, now, not_sent=s.not_sent is not None
                    )
                    self._count_unresolved(s.reason)
                    self._log.warning(
                        "operation_unresolved",
                        operation_pk=s.pk,
                        reason=s.reason,
                        why=s.last_error or "window closed or attempts spent",
                    )
        started = await self._run_db(
            self.store.begin_attempts,
            token=token,
            owner=self.dispatcher_id,
            now_ms=now,
            lease_until=now + int(self.lease_seconds * 1000),
            request_ids=to_send,
        )
        for pk in set(to_send) - {s.pk for s in started}:
            self._names.pop(pk, None)
        self._observe.attempts_begun(batch, started, now)
        for begun in started:
            self._lease_ends[begun.pk] = claimed_mono + self.lease_seconds
        return [
            _Work(by_pk[s.pk][0], by_pk[s.pk][1], s, token, claimed_mono, self.lease_seconds,
                  batch)
            for s in started
        ]  # fmt: skip

    def _not_registered(self, name: str) -> str:
        return (
            f"endpoint {name!r} is not registered in dispatcher {self.dispatcher_id} "
            f"(registered: {sorted(self.endpoints)}); never sent anywhere"
        )

    @staticmethod
    def _unsendable_window_end(c: Claimed, now: int) -> int:
        """An operation no dispatcher can send lives as long as its window: from its
        window's start (the first claim that could not send it, if no attempt was ever
        made) for the snapshotted window, or the default policy's hour."""
        start = c.window_started_at if c.window_started_at is not None else now
        return start + (c.policy_window_ms or _DEFAULT_WINDOW_MS)

    def _unsendable(self, c: Claimed, token: str, now: int, problem: str) -> Settlement | None:
        """The settlement of an operation this dispatcher must not send, once its window
        has closed; None while it is open (it is put back, with the reason kept)."""
        registered = c.endpoint in self.endpoints
        self._log.error(
            "operation_unsendable" if registered else "endpoint_not_registered",
            operation_id=c.operation_id,
            tenant=c.tenant,
            endpoint=c.endpoint,
            detail=problem,
        )
        if now <= self._unsendable_window_end(c, now):
            return None
        reason = reason_from_history(maybe_delivered=c.maybe_delivered, saw_refusal=c.saw_refusal)
        error_class = ErrorClass.OPERATION_UNSENDABLE
        if not registered:
            error_class = ErrorClass.ENDPOINT_NOT_REGISTERED
        return Settlement(
            c.pk,
            token,
            State.UNRESOLVED,
            reason,
            last_error=f"{problem}; its window closed",
            not_sent=(
                error_class.value,
                f"not sent: {problem}",
                str(uuid.uuid4()),
                self.dispatcher_id,
            ),
        )

    async def _attempt(self, work: _Work) -> None:
        c, endpoint, started = work.claimed, work.endpoint, work.started
        log = self._log.bind(
            operation_id=c.operation_id,
            tenant=c.tenant,
            endpoint=endpoint.name,
            request_id=started.request_id,
            attempt=started.number,
        )
        try:
            await failpoints.hit("after_attempt_commit")
            # Re-check the lease on the monotonic clock: a process that was paused (GC,
            # SIGSTOP, a frozen VM) must not wake up and send on a lease it lost.
            remaining = self._lease_left(work)
            if remaining < endpoint.timeout + self.settings.lease_margin_seconds:
                self.summary.lease_check_failed += 1
                log.warning("lease_check_failed", remaining_seconds=round(remaining, 3))
                await self._outcomes.put(
                    self._not_sent(
                        work,
                        ErrorClass.LEASE_CHECK_FAILED,
                        "not sent: too little of the lease was left for a full attempt",
                    )
                )
                return
            deadline = endpoint.deadline_ms(
                window_started_at_ms=started.window_started_at,
                first_attempt_at_ms=started.first_attempt_at,
            )
            if self.clock.now_ms() > deadline:
                # The window closed between the claim and now: never send after it. The
                # next claim settles the operation as unresolved.
                log.warning("window_closed_before_send")
                await self._outcomes.put(
                    self._not_sent(
                        work,
                        ErrorClass.WINDOW_CLOSED_BEFORE_SEND,
                        "not sent: the retry window closed between the claim and the send",
                    )
                )
                return
            headers = request_headers(
                endpoint,
                stored_headers=_json_headers(c.headers_json),
                operation_id=c.operation_id,
                request_id=started.request_id,
                tenant=c.tenant,
                has_body=c.body is not None,
            )
            traced = self._observe.attempt_started(work.batch, c, endpoint, started, headers)
            log.info("attempt_started")
            self.summary.attempts += 1
            result = await send_attempt(
                self._client(endpoint),
                endpoint,
                method=c.method,
                path=c.path,
                headers=headers,
                body=c.body.encode("utf-8") if c.body is not None else None,
                now_ms=self.clock.now_ms,
                public_headers=_json_headers(c.headers_json),
                secret_headers=self._secret_headers,
            )
            self._observe.attempt_sent(traced, result)
            log.info(
                "attempt_finished",
                status=result.status_code,
                delivery=result.classification.delivery,
                verdict=result.classification.verdict,
                error=result.error_class,
                duration_ms=result.duration_ms,
            )
            await failpoints.hit("after_response")
            await self._outcomes.put(self._outcome(work, result))
        except Exception as exc:
            # A bug or a failpoint: leave the attempt open. The lease expires and the
            # next claim records it as unknown; nothing is lost or resent early.
            log.exception("attempt_crashed", error=type(exc).__name__)
            self._names.pop(c.pk, None)
            self._lease_ends.pop(c.pk, None)
            self._release_slot(1)

    def _lease_left(self, work: _Work) -> float:
        """Seconds of the lease left, measured on the monotonic clock from before the claim."""
        return work.lease_seconds - (self.clock.monotonic() - work.claimed_mono)

    def _not_sent(self, work: _Work, error_class: ErrorClass, message: str) -> AttemptOutcome:
        c = work.claimed
        return AttemptOutcome(
            pk=c.pk,
            lease_token=work.token,
            request_id=work.started.request_id,
            delivery=Delivery.NOT_SENT,
            verdict=None,
            counted=False,
            status_code=None,
            receiver_request_id=None,
            error_class=error_class.value,
            error_message=message,
            duration_ms=0,
            state=State.PENDING,
            reason=None,
            next_attempt_at=self.clock.now_ms(),
            maybe_delivered=c.maybe_delivered,
            saw_refusal=c.saw_refusal,
        )

    def _outcome(self, work: _Work, result: AttemptResult) -> AttemptOutcome:
        c, endpoint, started = work.claimed, work.endpoint, work.started
        cls = result.classification
        in_progress = cls.verdict is Verdict.IN_PROGRESS
        counted = not in_progress
        maybe = c.maybe_delivered or cls.maybe_applied or cls.delivery is Delivery.UNKNOWN
        refused = c.saw_refusal or cls.refused
        now = self.clock.now_ms()
        decision = decide(
            endpoint=endpoint,
            verdict=cls.verdict,
            attempts_counted=c.attempts_counted + (1 if counted else 0),
            maybe_delivered=maybe,
            saw_refusal=refused,
            retry_after_seconds=cls.retry_after_seconds,
            deadline_ms=endpoint.deadline_ms(
                window_started_at_ms=started.window_started_at,
                first_attempt_at_ms=started.first_attempt_at,
            ),
            now_ms=now,
            attempts_in_progress=c.attempts_in_progress + (1 if in_progress else 0),
        )
        return AttemptOutcome(
            pk=c.pk,
            lease_token=work.token,
            request_id=started.request_id,
            delivery=cls.delivery,
            verdict=cls.verdict,
            counted=counted,
            status_code=result.status_code,
            receiver_request_id=result.receiver_request_id,
            error_class=result.error_class,
            error_message=result.error_message,
            duration_ms=result.duration_ms,
            state=decision.state,
            reason=decision.reason,
            next_attempt_at=decision.next_attempt_at_ms,
            maybe_delivered=maybe,
            saw_refusal=refused,
            result=result.result,
            in_progress=in_progress,
        )

    def _release_slot(self, n: int) -> None:
        self._inflight -= n
        self._capacity.set()

    def _count_unresolved(self, reason: Any) -> None:
        self.summary.unresolved += 1
        key = str(reason)
        self.summary.by_reason[key] = self.summary.by_reason.get(key, 0) + 1

    async def _write_outcomes(self) -> None:
        done = False
        while not done:
            first = await self._outcomes.get()
            if first is None:
                break
            batch = [first]
            while not self._outcomes.empty() and len(batch) < 256:
                item = self._outcomes.get_nowait()
                if item is None:
                    done = True
                    break
                batch.append(item)
            written = await self._record_outcomes(batch)
            now = self.clock.now_ms()
            for out in batch:
                self._observe.outcome(out, applied=out.pk in written, now_ms=now)
                if out.state is State.PENDING and out.pk in written:
                    self.wakeup.due_at(out.next_attempt_at)
                names = self._log_transition(out, applied=out.pk in written)
                if out.pk in written and out.state is State.UNRESOLVED:
                    self._maybe_look_up(out, names)
            await failpoints.hit("after_outcome")
            self._release_slot(len(batch))

    async def _record_outcomes(self, batch: list[AttemptOutcome]) -> set[int]:
        """Write a batch of outcomes; retry a transient database failure while a lease
        of the batch still holds (each write is fenced, so a late retry changes nothing).

        Given up, the leases expire and the next claim closes these attempts as unknown;
        nothing is resent before that, but the outcome is lost, so we try hard first.
        """
        delay = _OUTCOME_RETRY_FIRST_SECONDS
        tries = 0
        while True:
            tries += 1
            try:
                return await self._run_db(
                    self.store.record_outcomes, now_ms=self.clock.now_ms(), outcomes=batch
                )
            except Exception as exc:
                lease_left = max(
                    (self._lease_ends.get(out.pk, 0.0) for out in batch), default=0.0
                ) - self.clock.monotonic()
                transient = is_transient(exc)
                if not transient or lease_left < delay + 1.0 or tries >= _OUTCOME_TRIES:
                    # The leases will expire and another claim records these attempts
                    # as unknown. Nothing is resent before that.
                    self._log.error("outcome_write_failed", count=len(batch), tries=tries,
                                    error=type(exc).__name__, detail=error_detail(exc),
                                    transient=transient, exc_info=exc)  # fmt: skip
                    return set()
                self._log.warning("outcome_write_retry", count=len(batch), tries=tries,
                                  error=type(exc).__name__, detail=error_detail(exc),
                                  retry_in_seconds=delay,
                                  lease_left_seconds=round(lease_left, 3))  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(delay * 2, _OUTCOME_RETRY_MAX_SECONDS)

    def _maybe_look_up(self, out: AttemptOutcome, names: dict[str, Any]) -> None:
        """Ask the receiver about an operation that just became unresolved, if it can be asked."""
        endpoint = self.endpoints.get(names.get("endpoint", ""))
        if (
            self._on_unresolved is None
            or endpoint is None
            or endpoint.status_lookup is None
            or not endpoint.status_lookup.on_unresolved
            or out.reason is Reason.KEY_CONFLICT
        ):
            return
        task = asyncio.create_task(
            self._look_up(endpoint, names["operation_id"], names["tenant"])
        )
        self._lookups.add(task)
        task.add_done_callback(self._lookups.discard)

    async def _look_up(self, endpoint: Endpoint, operation_id: str, tenant: str) -> None:
        log = self._log.bind(operation_id=operation_id, tenant=tenant, endpoint=endpoint.name)
        try:
            result = await lookup_status(self._client(endpoint), endpoint, operation_id, tenant)
            assert self._on_unresolved is not None
            outcome = await self._run_db(
                self._on_unresolved, operation_id=operation_id, tenant=tenant, result=result
            )
        except Exception:
            log.exception("status_lookup_failed")
            return
        self._observe.status_lookup(endpoint.name, result.status.value)
        log.info("status_lookup", answer=result.status.value,
                 action=outcome.action.value if outcome else "none")
        if outcome is not None and outcome.state is State.SUCCEEDED:
            self.summary.succeeded += 1

    def _log_transition(self, out: AttemptOutcome, *, applied: bool) -> dict[str, Any]:
        self._lease_ends.pop(out.pk, None)
        names = self._names.pop(out.pk, {"operation_pk": out.pk})
        log = self._log.bind(request_id=out.request_id, **names)
        if not applied:
            self.summary.fenced += 1
            log.warning("write_fenced", detail="another dispatcher holds the lease; dropped")
            return names
        if out.state is State.SUCCEEDED:
            self.summary.succeeded += 1
            log.info("operation_succeeded", status=out.status_code)
        elif out.state is State.FAILED:
            self.summary.failed += 1
            log.info("operation_failed", status=out.status_code)
        elif out.state is State.UNRESOLVED:
            self._count_unresolved(out.reason)
            log.warning("operation_unresolved", reason=out.reason)
        elif out.delivery is not Delivery.NOT_SENT or out.error_class not in _NOT_TRIED:
            self.summary.retry_scheduled += 1
            log.info("retry_scheduled", next_attempt_at=out.next_attempt_at)
        return names


#: Attempts given back before sending: not a retry of the operation.
_NOT_TRIED = frozenset(
    {ErrorClass.LEASE_CHECK_FAILED.value, ErrorClass.WINDOW_CLOSED_BEFORE_SEND.value}
)


def _json_headers(text: str) -> dict[str, str]:
    import json

    value = json.loads(text)
    return {str(k): str(v) for k, v in value.items()}


async def _wait_any(*events: asyncio.Event, timeout: float) -> None:
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
