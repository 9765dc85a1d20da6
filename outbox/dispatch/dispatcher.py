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
from typing import Any, TypeVar

import httpx
from sqlalchemy.exc import DBAPIError

from outbox.base.logs import get_logger
from outbox.clock import Clock, OffsetClock, steady_ms
from outbox.config import DispatcherSettings, Endpoint
from outbox.dispatch import failpoints, heartbeat
from outbox.dispatch._attempt import AttemptSender
from outbox.dispatch._claims import (
    ClaimArgs,
    LostClaims,
    claim_and_begin,
    claim_probe,
    record_and_claim,
)
from outbox.dispatch.breaker import Breaker
from outbox.dispatch.dbthread import (
    DatabaseUnresponsive,
    DbThread,
    applied_after_all,
    error_detail,
    write_while_leased,
)
from outbox.dispatch.limits import Limits
from outbox.dispatch.outcomes import DispatchSummary, Work, default_dispatcher_id, transition_event
from outbox.dispatch.unresolved import OnUnresolved, UnresolvedLookups
from outbox.dispatch.wakeup import Wakeup, wait_any
from outbox.errors import StoreError
from outbox.model import State
from outbox.observe.hooks import NOTHING, Instrumentation
from outbox.store.base import Store
from outbox.store.records import AttemptOutcome, ClaimResult
from outbox.wire.transport import build_client

logger = get_logger("outbox.dispatch")

T = TypeVar("T")
TransportFactory = Callable[[Endpoint], httpx.AsyncBaseTransport | None]

__all__ = ["DispatchSummary", "Dispatcher", "OnUnresolved", "TransportFactory"]

#: How often a dispatcher re-reads the database server's clock (PostgreSQL).
_CLOCK_SYNC_SECONDS = 30.0
#: The longest wait between claims while the database refuses them.
_MAX_STORE_BACKOFF_SECONDS = 5.0


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
        self._lookups = UnresolvedLookups(
            on_unresolved, client=self._client, run_db=self._run_db, log=self._log,
            observe=self._observe, summary=self.summary,
        )  # fmt: skip
        #: This dispatcher's part in the fleet's circuit breakers (outbox.dispatch.breaker).
        self.breaker = Breaker(
            store=store, endpoints=self.endpoints, owner=self.dispatcher_id,
            now_ms=clock.now_ms, monotonic=clock.monotonic, run_db=self._run_db,
            lease_ms=int(self.lease_seconds * 1000), log=self._log,
        )  # fmt: skip
        self._lost = LostClaims(store=store, run_db=self._run_db, clock=clock, log=self._log,
                                lease_seconds=self.lease_seconds)  # fmt: skip
        self.limits = Limits(store=store, endpoints=self.endpoints, owner=self.dispatcher_id,
                             clock=clock, run_db=self._run_db, log=self._log,
                             lease_seconds=self.lease_seconds)  # fmt: skip
        self._sender = AttemptSender(
            clock=clock, lease_margin_seconds=settings.lease_margin_seconds,
            summary=self.summary, observe=self._observe, log=self._log, client=self._client,
            secret_headers=self._secret_headers, outcomes=self._outcomes,
            # Late-bound: looked up at each attempt (tests/soak/planted.py patches it).
            lease_left=lambda work: self._lease_left(work),  # noqa: PLW0108
            known_down=self.breaker.known_down, crashed=self._attempt_crashed, limits=self.limits,
        )  # fmt: skip
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
            task = asyncio.create_task(self._sender.send(work))
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
        await self._preflight()
        watchdog = asyncio.create_task(self._db.watch(stop, self.settings.stop_timeout_seconds))
        writer = asyncio.create_task(self._write_outcomes())
        failpoints.warn_if_set(self._log)
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
        try:
            await self._claim_loop(
                stop, once=once, until_empty=until_empty, on_progress=on_progress
            )
        finally:
            await self._shut_down(writer, beats, watchdog)
        if self._db.gave_up:
            raise DatabaseUnresponsive(
                f"the database did not answer within {self.settings.stop_timeout_seconds}s "
                "of the stop request; gave up (the leases held expire on their own)"
            )
        return self.summary

    async def _preflight(self) -> None:
        """Check the schema before anything starts; on failure, stop the database thread."""
        try:
            await self._run_db(self.store.preflight)
        except BaseException:
            self._db.shutdown()
            raise

    async def _claim_loop(
        self,
        stop: asyncio.Event,
        *,
        once: bool,
        until_empty: bool,
        on_progress: Callable[[DispatchSummary], None] | None,
    ) -> None:
        """Claim and start work while slots are free, until ``stop`` (or as ``once`` and
        ``until_empty`` say); a database that refuses claims is waited out, never fatal."""
        backoff = 0.0
        while not stop.is_set():
            free = self.settings.concurrency - self._inflight - self._claiming
            if free < self._low_water:
                await self._wait_for_slots(stop)
                continue
            try:
                got, nothing = await self._claim_step(free, once=once)
            except (StoreError, DBAPIError) as exc:
                backoff = self._store_backoff(backoff, exc)
                if once:
                    raise
                await wait_any(stop, timeout=backoff)
                continue
            backoff = 0.0
            self._start(got)
            if on_progress is not None:
                on_progress(self.summary)
            if once or (nothing and not await self._idle(stop, until_empty=until_empty)):
                break

    async def _wait_for_slots(self, stop: asyncio.Event) -> None:
        """Park until outcomes free slots (the outcome writer may claim for us meanwhile)."""
        self._capacity.clear()
        self._parked = True
        try:
            await wait_any(self._capacity, stop, timeout=1.0)
        finally:
            self._parked = False

    async def _claim_step(self, free: int, *, once: bool) -> tuple[list[Work], bool]:
        """One claim (after the clock sync and the breakers' probes); when nothing was
        due, tell the wake-up when the next operation or probe is."""
        await self._maybe_sync_clock()
        await self._lost.give_back()  # failed claims that may have committed (``_claims``)
        await self.breaker.tick(self._claim_probe)
        self.wakeup.before_claim()
        limit = self.limits.room(min(free, self.settings.batch_size), self.breaker.states)
        got, nothing = await self._claim_and_start(limit)
        if nothing and not once:
            self.wakeup.next_due(
                await self._run_db(self.store.next_due_ms, now_ms=self.clock.now_ms())
            )
            self.wakeup.due_at(self.breaker.next_probe_ms())
        return got, nothing

    def _store_backoff(self, backoff: float, exc: Exception) -> float:
        """Locked, read-only or unreachable: the next, longer wait; never crash."""
        backoff = min(backoff * 2 if backoff else 0.1, _MAX_STORE_BACKOFF_SECONDS)
        self._log.warning("store_unavailable", error=type(exc).__name__,
                          detail=str(exc)[:300], retry_in_seconds=backoff)
        return backoff

    async def _idle(self, stop: asyncio.Event, *, until_empty: bool) -> bool:
        """Nothing was due: wait for a reason to claim again. False when the loop ends
        (``until_empty``, and every outcome written)."""
        if not until_empty:
            await self.wakeup.wait(stop)
            return True
        if self._inflight == 0:
            return False  # nothing due, every outcome written
        # Outcomes still to come may make something due again.
        self._capacity.clear()
        await wait_any(self._capacity, stop, timeout=1.0)
        return True

    async def _shut_down(
        self,
        writer: asyncio.Task[None],
        beats: asyncio.Task[None] | None,
        watchdog: asyncio.Task[None],
    ) -> None:
        await self.wakeup.close()
        # Graceful stop: no new claims; requests on the wire finish (each bounded by
        # its deadline) and their outcomes are written before we return. A claim the
        # outcome writer has under way is committed: its work starts first.
        await self._no_claim.wait()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.limits.close()
        await self._outcomes.put(None)
        try:  # a writer that died re-raises here, after the cleanup below
            await writer
            await self._lost.give_back()
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
            self._log_stopped()

    def _log_stopped(self) -> None:
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

    def _claim_args(self, limit: int) -> ClaimArgs:
        return ClaimArgs(
            owner=self.dispatcher_id,
            token=str(uuid.uuid4()),
            now_ms=self.clock.now_ms(),
            lease_ms=int(self.lease_seconds * 1000),
            limit=limit,
            endpoints=self.endpoints,
            claim_ns=time.time_ns(),
            claimed_mono=self.clock.monotonic(),
            server_clock=isinstance(self.clock, OffsetClock),
            steady_ms=steady_ms(self.clock),
        )

    async def _claim_and_start(self, limit: int) -> tuple[list[Work], bool]:
        # One transaction (claim, decisions, attempt rows) commits before any request.
        args = self._claim_args(limit)
        result = await self._claim_db(claim_and_begin, args)
        return await self._claimed(result, args), not result.claimed

    async def _claim_db(self, claim: Callable[..., T], args: ClaimArgs, **more: Any) -> T:
        """Run a claim's transaction; failed, it may have committed: give its claim back."""
        try:
            return await self._run_db(claim, store=self.store, args=args, **more)
        except Exception:
            await self._lost.failed(args)
            raise

    async def _claimed(self, result: ClaimResult, args: ClaimArgs) -> list[Work]:
        """Account for a committed claim; the work to start (nothing is sent yet)."""
        token, now, claimed_mono, refused = args.token, args.now_ms, args.claimed_mono, args.refused
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

    async def _claim_probe(self, endpoint: str) -> int:
        """Claim and start the half-open probe of ``endpoint`` (one due operation)."""
        args = self._claim_args(1)
        result = await self._claim_db(claim_probe, args, endpoint=endpoint)
        works = await self._claimed(result, args)
        self.breaker.probes.update((w.claimed.pk, endpoint) for w in works)
        self._start(works)
        return len(works)

    def _attempt_crashed(self, pk: int) -> None:
        """An attempt raised before its outcome was queued: forget it, free its slot."""
        self._names.pop(pk, None)
        self._lease_ends.pop(pk, None)
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
                seen: list[tuple[AttemptOutcome, str | None]] = []
                for out in batch:
                    self._observe.outcome(out, applied=out.pk in written, now_ms=now)
                    if out.state is State.PENDING and out.pk in written:
                        self.wakeup.due_at(out.next_attempt_at)
                    names = self._log_transition(out, applied=out.pk in written)
                    seen.append((out, names.get("endpoint")))
                    if out.pk in written and out.state is State.UNRESOLVED:
                        endpoint = self.endpoints.get(names.get("endpoint", ""))
                        self._lookups.maybe(out, endpoint, names)
                await self.breaker.observe(seen)
                await failpoints.hit("after_outcome")
            finally:
                self._release_slot(len(batch))
                if claim is not None:
                    await self._start_carried(*claim)

    async def _start_carried(self, reserved: int, result: ClaimResult, args: ClaimArgs) -> None:
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
        """How many to claim with ``n`` outcomes: only while the claim loop waits for the
        slots they free (its next claim joins their COMMIT), never after a stop or once."""
        if not self._parked or self._pipelined is None or self._pipelined.is_set():
            return 0
        free = self.settings.concurrency - self._inflight - self._claiming + n
        return min(free, self.settings.batch_size) if free >= self._low_water else 0

    async def _record_outcomes(
        self, batch: list[AttemptOutcome]
    ) -> tuple[set[int], tuple[int, ClaimResult, ClaimArgs] | None]:
        """Write a batch of outcomes, with the next claim when the loop waits for their
        slots (one transaction); alone, retried while a lease holds (``dbthread``)."""
        limit = self._claim_with_outcomes(len(batch))
        if limit:
            self._reserve(limit)
            args = self._claim_args(limit)
            self.wakeup.before_claim()
            try:
                written, result = await self._run_db(
                    record_and_claim, store=self.store, args=args, outcomes=batch)
                return written, (limit, result, args)
            except Exception as exc:
                # Nothing of it was written, or a lost COMMIT wrote it all: the outcomes
                # alone first (known answers), then the claim given back. Else: a bug.
                log = self._log.warning if isinstance(exc, StoreError | DBAPIError) \
                    else self._log.exception
                log("outcome_claim_failed", error=type(exc).__name__, detail=error_detail(exc))
            self._reserve(-limit)
            written = await self._write_outcomes_after_failure(batch)
            await self._lost.failed(args)
            return written, None
        return await self._write_outcomes_alone(batch), None

    async def _write_outcomes_after_failure(self, batch: list[AttemptOutcome]) -> set[int]:
        """The outcomes alone; those found fenced may be the failed COMMIT's (``dbthread``)."""
        written = await self._write_outcomes_alone(batch)
        return written | await applied_after_all(
            [out for out in batch if out.pk not in written],
            run_db=self._run_db, store=self.store, log=self._log,
        )  # fmt: skip

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

