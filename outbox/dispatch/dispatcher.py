"""The dispatcher: claim -> commit attempt rows -> check the lease -> send -> record.

One asyncio loop sends; one database thread runs the short store transactions, so no
transaction is ever open while a request is on the wire. Outcomes are written in
batches by a single writer task, each write fenced on the claim's lease token. While
the claim loop waits for free slots, the writer takes its next claim in the transaction
that writes the outcomes freeing them (one COMMIT instead of two).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from sqlalchemy.exc import DBAPIError

from outbox.base.logs import get_logger
from outbox.clock import Clock, OffsetClock
from outbox.config import DispatcherSettings, Endpoint
from outbox.dispatch import failpoints, heartbeat
from outbox.dispatch.dbthread import (
    DatabaseUnresponsive,
    DbThread,
    error_detail,
    write_while_leased,
)
from outbox.dispatch.outcomes import (
    DispatchSummary,
    Work,
    attempt_outcome,
    default_dispatcher_id,
    not_sent_outcome,
    plan_claimed,
    transition_event,
)
from outbox.dispatch.unresolved import OnUnresolved, UnresolvedLookups
from outbox.dispatch.wakeup import Wakeup, wait_any
from outbox.errors import StoreError
from outbox.model import ErrorClass, State
from outbox.observe.hooks import NOTHING, Instrumentation
from outbox.store.base import Store
from outbox.store.evidence import outcomes_applied
from outbox.store.records import (
    AttemptOutcome,
    Claimed,
    ClaimResult,
)
from outbox.wire.transport import (
    build_client,
    request_headers,
    send_attempt,
    unbuilt_attempt,
)

logger = get_logger("outbox.dispatch")

T = TypeVar("T")
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport | None]

__all__ = ["DispatchSummary", "Dispatcher", "OnUnresolved", "TransportFactory"]

#: How often a dispatcher re-reads the database server's clock (PostgreSQL).
_CLOCK_SYNC_SECONDS = 30.0
#: The longest wait between claims while the database refuses them.
_MAX_STORE_BACKOFF_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class _ClaimArgs:
    """One claim's arguments for the store and what its accounting needs after it."""

    kwargs: dict[str, Any]
    token: str
    now: int
    claim_ns: int
    claimed_mono: float
    refused: list[tuple[Claimed, str]]


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
        # Header names whose values are credentials: redacted where a receiver echoes them.
        self._secret_headers = tuple(secret_headers)
        self._lookups = UnresolvedLookups(self, on_unresolved)
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
        #: Slots held by a claim the outcome writer is making (see _write_outcomes).
        self._claiming = 0
        self._no_claim = asyncio.Event()  # set while the writer makes no claim
        self._no_claim.set()
        #: The claim loop waits for free slots: the outcome writer may claim for it.
        self._parked = False
        self._pipelined: asyncio.Event | None = None
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
        #: What wakes this dispatcher when idle (see outbox.dispatch.wakeup); ``wakeup.stats``
        #: counts claims and wake-ups, ``wakeup.hooks`` observes them.
        self.wakeup = Wakeup(
            store.change_source(
                application_name=f"outbox-listener {self.dispatcher_id}",
                interval=settings.change_check_seconds,
                listen_url=settings.listen_url,
            )
            if settings.wake_on_change
            else None,
            clock=clock,
            poll_seconds=settings.idle_poll_seconds,
        )

    @property
    def wake_mode(self) -> str:
        """"listen", "poll" or "starting": see :attr:`Wakeup.mode`."""
        return self.wakeup.mode

    # -- plumbing -----------------------------------------------------------------

    async def run_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        """Run ``fn(**kwargs)`` on the dispatcher's database thread."""
        return await self._run_db(fn, **kwargs)

    async def _run_db(self, fn: Callable[..., T], /, **kwargs: Any) -> T:
        result = await self._db.run(fn, **kwargs)
        self.db_answered_at = time.monotonic()
        return result

    @property
    def _low_water(self) -> int:
        """Claim only when at least this many slots are free."""
        return max(1, min(self.settings.batch_size, self.settings.concurrency) // 4)

    def _start(self, works: list[Work]) -> None:
        for work in works:
            self._inflight += 1
            task = asyncio.create_task(self._attempt(work))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
        # The writer claims with its outcome writes only while the loop runs on.
        self._pipelined = None if once else stop
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
                free = self.settings.concurrency - self._inflight - self._claiming
                if free < self._low_water:
                    self._capacity.clear()
                    self._parked = True
                    try:
                        await wait_any(self._capacity, stop, timeout=1.0)
                    finally:
                        self._parked = False
                    continue
                try:
                    await self._maybe_sync_clock()
                    self.wakeup.before_claim()
                    got, nothing = await self._claim_and_start(min(free, self.settings.batch_size))
                    if nothing and not once:
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
                    await wait_any(stop, timeout=backoff)
                    continue
                backoff = 0.0
                self._start(got)
                if on_progress is not None:
                    on_progress(self.summary)
                if once:
                    break
                if nothing:
                    if until_empty:
                        if self._inflight == 0:
                            break  # nothing due, every outcome written
                        # Outcomes still to come may make something due again.
                        self._capacity.clear()
                        await wait_any(self._capacity, stop, timeout=1.0)
                        continue
                    await self.wakeup.wait(stop)
        finally:
            await self.wakeup.close()
            # Graceful stop: no new claims; requests on the wire finish (each bounded by
            # its deadline) and their outcomes are written before we return. A claim the
            # outcome writer has under way is committed: its work starts first.
            await self._no_claim.wait()
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._outcomes.put(None)
            try:  # a writer that died re-raises here, after the cleanup below
                await writer
            finally:
                await self._lookups.drain()
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

    def _claim_args(self, limit: int) -> _ClaimArgs:
        token = str(uuid.uuid4())
        now = self.clock.now_ms()
        refused: list[tuple[Claimed, str]] = []
        return _ClaimArgs(
            kwargs={
                "owner": self.dispatcher_id,
                "token": token,
                "now_ms": now,
                "lease_ms": int(self.lease_seconds * 1000),
                "limit": limit,
                "plan": lambda claimed: plan_claimed(
                    claimed, endpoints=self.endpoints, dispatcher_id=self.dispatcher_id,
                    token=token, now=now, refused=refused,
                ),
            },
            token=token,
            now=now,
            claim_ns=time.time_ns(),
            claimed_mono=self.clock.monotonic(),
            refused=refused,
        )

    async def _claim_and_start(self, limit: int) -> tuple[list[Work], bool]:
        # The work to start, and whether nothing was claimed. One transaction: the claim,
        # its decisions, the attempt rows; it commits before any request goes out.
        args = self._claim_args(limit)
        result = await self._run_db(self.store.claim_and_begin, **args.kwargs)
        return await self._claimed(result, args), not result.claimed

    async def _claimed(self, result: ClaimResult, args: _ClaimArgs) -> list[Work]:
        """Account for a committed claim; the work to start (nothing is sent yet)."""
        token, now, claimed_mono, refused = args.token, args.now, args.claimed_mono, args.refused
        claimed = result.claimed
        self.wakeup.after_claim(len(claimed))
        if not claimed:
            return []
        self.summary.claimed += len(claimed)
        batch = self._observe.claimed(claimed, result.recovered, args.claim_ns)
        self._log.debug("operations_claimed", count=len(claimed), lease_token=token)
        for rec in result.recovered:
            self.summary.recovered += 1
            self._log.warning(
                "lease_expired",
                operation_pk=rec.pk,
                request_id=rec.request_id,
                attempt=rec.number,
                previous_dispatcher=rec.dispatcher_id,
            )
        for c, problem in refused:
            self._log.error(
                "operation_unsendable" if c.endpoint in self.endpoints
                else "endpoint_not_registered",
                operation_id=c.operation_id, tenant=c.tenant, endpoint=c.endpoint,
                detail=problem,
            )  # fmt: skip
        by_pk = {c.pk: c for c in claimed}
        for s in result.plan.settlements:
            if s.pk in result.settled:
                self._observe.settled(
                    s.pk, s.state, s.reason, now, not_sent=s.not_sent is not None
                )
                self.summary.count("operation_unresolved", s.reason)
                self._log.warning(
                    "operation_unresolved",
                    operation_pk=s.pk,
                    reason=s.reason,
                    why=s.last_error or "window closed or attempts spent",
                )
        self._observe.attempts_begun(batch, result.started, now)
        for begun in result.started:
            c = by_pk[begun.pk]
            self._names[c.pk] = {
                "operation_id": c.operation_id,
                "tenant": c.tenant,
                "endpoint": c.endpoint,
            }
            self._lease_ends[begun.pk] = claimed_mono + self.lease_seconds
        # The claim and its attempt rows are committed; nothing of the batch is sent yet.
        await failpoints.hit("after_claim")
        return [
            Work(by_pk[s.pk], self.endpoints[by_pk[s.pk].endpoint], s, token, claimed_mono,
                 self.lease_seconds, batch)
            for s in result.started
        ]  # fmt: skip

    async def _attempt(self, work: Work) -> None:
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
                    not_sent_outcome(
                        work,
                        ErrorClass.LEASE_CHECK_FAILED,
                        "not sent: too little of the lease was left for a full attempt",
                        self.clock.now_ms(),
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
                    not_sent_outcome(
                        work,
                        ErrorClass.WINDOW_CLOSED_BEFORE_SEND,
                        "not sent: the retry window closed between the claim and the send",
                        self.clock.now_ms(),
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
                    has_body=c.body is not None,
                )
                body = c.body.encode("utf-8") if c.body is not None else None
            except Exception as exc:
                log.warning("attempt_not_built", error=type(exc).__name__)
                await self._outcomes.put(
                    attempt_outcome(work, unbuilt_attempt(exc), self.clock.now_ms())
                )
                return
            traced = self._observe.attempt_started(work.batch, c, endpoint, started, headers)
            log.info("attempt_started")
            self.summary.attempts += 1
            result = await send_attempt(
                self._client(endpoint),
                endpoint,
                method=c.method,
                path=c.path,
                headers=headers,
                body=body,
                now_ms=self.clock.now_ms,
                public_headers=c.headers,
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
            await self._outcomes.put(attempt_outcome(work, result, self.clock.now_ms()))
        except Exception as exc:
            # A bug or a failpoint: leave the attempt open. The lease expires and the
            # next claim records it as unknown; nothing is lost or resent early.
            log.exception("attempt_crashed", error=type(exc).__name__)
            self._names.pop(c.pk, None)
            self._lease_ends.pop(c.pk, None)
            self._release_slot(1)

    def _lease_left(self, work: Work) -> float:
        """Seconds of the lease left, measured on the monotonic clock from before the claim."""
        return work.lease_seconds - (self.clock.monotonic() - work.claimed_mono)

    def _release_slot(self, n: int) -> None:
        self._inflight -= n
        self._capacity.set()

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
            written, claim = await self._record_outcomes(batch)
            try:  # whatever the bookkeeping does, the slots and a carried claim are settled
                now = self.clock.now_ms()
                for out in batch:
                    self._observe.outcome(out, applied=out.pk in written, now_ms=now)
                    if out.state is State.PENDING and out.pk in written:
                        self.wakeup.due_at(out.next_attempt_at)
                    names = self._log_transition(out, applied=out.pk in written)
                    if out.pk in written and out.state is State.UNRESOLVED:
                        endpoint = self.endpoints.get(names.get("endpoint", ""))
                        self._lookups.maybe(out, endpoint, names)
                await failpoints.hit("after_outcome")
            finally:
                self._release_slot(len(batch))
                if claim is not None:
                    await self._start_carried(*claim)

    async def _start_carried(self, reserved: int, result: ClaimResult, args: _ClaimArgs) -> None:
        """Start the work of a claim the writer made; give its reserved slots back. If
        that fails (a bug, a failpoint), its attempt rows stay open until its leases
        expire, and the next claim records them as unknown."""
        works: list[Work] = []
        try:
            works = await self._claimed(result, args)
        except Exception as exc:
            self._log.exception("claim_crashed", error=type(exc).__name__)
            for begun in result.started:  # none of it starts: no outcome will come
                self._names.pop(begun.pk, None)
                self._lease_ends.pop(begun.pk, None)
        finally:
            self._start(works)
            self._reserve(-reserved)

    def _reserve(self, n: int) -> None:
        """Hold (n > 0) or give back (n < 0) slots for a claim the writer makes."""
        self._claiming += n
        if self._claiming:
            self._no_claim.clear()
        else:
            self._no_claim.set()

    def _claim_with_outcomes(self, n: int) -> int:
        """How many operations to claim in the transaction that writes ``n`` outcomes:
        only while the claim loop is waiting for the slots these outcomes free (then the
        claim it would make next joins their COMMIT), never after a stop, never once."""
        if not self._parked or self._pipelined is None or self._pipelined.is_set():
            return 0
        free = self.settings.concurrency - self._inflight - self._claiming + n
        return min(free, self.settings.batch_size) if free >= self._low_water else 0

    async def _record_outcomes(
        self, batch: list[AttemptOutcome]
    ) -> tuple[set[int], tuple[int, ClaimResult, _ClaimArgs] | None]:
        """Write a batch of outcomes, with the next claim when the loop waits for their
        slots (one transaction). Alone, or if that transaction fails: retry a transient
        database failure while a lease of the batch still holds (see
        :func:`outbox.dispatch.dbthread.write_while_leased`)."""
        limit = self._claim_with_outcomes(len(batch))
        if limit:
            self._reserve(limit)
            args = self._claim_args(limit)
            self.wakeup.before_claim()
            try:
                written, result = await self._run_db(
                    self.store.record_and_claim, outcomes=batch, **args.kwargs
                )
                return written, (limit, result, args)
            except Exception as exc:
                # Nothing of it was written (or, after a lost COMMIT, the claim's leases
                # expire unused): write the outcomes alone. Not the database's: a bug.
                log = self._log.warning if isinstance(exc, StoreError | DBAPIError) \
                    else self._log.exception
                log("outcome_claim_failed", error=type(exc).__name__, detail=error_detail(exc))
            self._reserve(-limit)
            return await self._write_outcomes_after_failure(batch), None
        return await self._write_outcomes_alone(batch), None

    async def _write_outcomes_after_failure(self, batch: list[AttemptOutcome]) -> set[int]:
        """Write the outcomes alone after their transaction with a claim failed; those
        the write finds fenced may be the failed COMMIT's, applied after all: the
        attempt rows say (``outbox.store.evidence``), so the log matches the database."""
        written = await self._write_outcomes_alone(batch)
        missing = [out for out in batch if out.pk not in written]
        if not missing:
            return written
        try:
            applied = await self._run_db(outcomes_applied, store=self.store, outcomes=missing)
        except Exception as exc:
            self._log.warning("outcome_evidence_unreadable", error=type(exc).__name__,
                              detail=error_detail(exc), count=len(missing))  # fmt: skip
            return written
        if applied:
            self._log.info("outcome_commit_applied", count=len(applied),
                           detail="the failed COMMIT had written these outcomes")  # fmt: skip
        return written | applied

    async def _write_outcomes_alone(self, batch: list[AttemptOutcome]) -> set[int]:
        def lease_left() -> float:
            ends = (self._lease_ends.get(out.pk, 0.0) for out in batch)
            return max(ends, default=0.0) - self.clock.monotonic()

        return await write_while_leased(
            lambda: self._run_db(
                self.store.record_outcomes, now_ms=self.clock.now_ms(), outcomes=batch
            ),
            lease_left=lease_left,
            log=self._log.bind(count=len(batch)),
        )

    def _log_transition(self, out: AttemptOutcome, *, applied: bool) -> dict[str, Any]:
        self._lease_ends.pop(out.pk, None)
        names = self._names.pop(out.pk, {"operation_pk": out.pk})
        event = transition_event(out, applied=applied)
        if event is not None:
            level, name, fields = event
            self.summary.count(name, out.reason)
            getattr(self._log.bind(request_id=out.request_id, **names), level)(name, **fields)
        return names

