"""The fleet's limits, as one dispatcher keeps its part of them.

An endpoint is *limited* while it declares ``rate_limit`` or ``max_in_flight``, or while
the fleet's throttle holds it (429/503 answers taught it a rate: ``outbox.store.limits``).
Before a request of a limited endpoint goes out, :meth:`Limits.admit` waits for:

* an in-flight permit: the dispatcher leases a slice of ``max_in_flight`` (renewed
  every ``PERIOD``; given back when idle) and sends at most that many at once;
* a send time: the dispatcher takes a slice of the rate budget, ``k`` send times spaced
  ``1/rate`` apart inside an interval no other dispatcher holds, one database
  transaction per slice (about a quarter second's worth), never one per request.

A send time more than ``LATE_SECONDS`` past is dropped, not used late: a late send may
fall in another dispatcher's interval, and dropping bounds the overshoot. An endpoint
that is not limited costs nothing: one dictionary look-up per attempt.

On a throttling answer (429, 503, a rate limit's 403: :class:`~outbox.config.Throttle`) the
dispatcher throttles the endpoint at once for itself and writes the fleet's throttle (in the
background, at most one write in flight per endpoint); every ``PERIOD`` it re-reads the
throttle and, when an interval passed without a refusal, raises it (or lifts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from sqlalchemy.exc import DBAPIError

from outbox.clock import Clock
from outbox.config import Endpoint, Throttle
from outbox.dispatch.outcomes import throttles
from outbox.errors import StoreError
from outbox.store.base import Store
from outbox.store.endpoints import EndpointState
from outbox.wire.transport import AttemptResult

RunDb = Callable[..., Awaitable[Any]]

#: How often a dispatcher re-reads the throttles and renews its in-flight permits.
PERIOD = 0.5
#: Send times are handed out at most this far ahead (ms).
HORIZON_MS = 1000
#: A slice of the rate budget is about this many seconds of it.
SLICE_SECONDS = 0.25
#: A send time later than this is dropped (bounds the overshoot; see the module).
LATE_SECONDS = 0.025
#: Refusals in the last second below which (or below ``Throttle.tolerance`` of the
#: answers) a refusal that names no rate and no long wait throttles nothing.
MIN_REFUSALS = 3
#: While every permit is in use, the waiters ask the database for more at most this
#: often (s), together: one lease for all of them, not one each back to back.
PACE = PERIOD / 2
#: In-flight permits admit requests for this long after a lease began (renewed every
#: PERIOD); the database keeps them longer (:func:`permit_lease_ms`).
PERMIT_LEASE_MS = 3000


def permit_lease_ms(endpoint: Endpoint) -> int:
    """How long the database keeps a lease of in-flight permits: past the time they
    admit requests, by the longest a request admitted last stays on the wire (its whole
    ``timeout``) and a PERIOD of slack. Renewals then only admit more: a request on the
    wire keeps its permit however late they are (a held write lock, a stalled process),
    and no other dispatcher can lease it meanwhile. The price: a dead dispatcher's
    permits come back after this, not after PERMIT_LEASE_MS."""
    return PERMIT_LEASE_MS + math.ceil((endpoint.timeout + PERIOD) * 1000)


class _Gate:
    """One endpoint's limits in this dispatcher."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        #: The fleet's throttle holds the endpoint (as last read, or as just refused).
        self.throttled = False
        self.rate: float | None = endpoint.rate_limit
        #: Send times granted to this dispatcher (monotonic), oldest first.
        self.times: deque[float] = deque()
        self.granting = asyncio.Lock()
        self.waiting = 0
        #: Answers that were not refusals, by monotonic time (the rate the receiver took).
        self.answers: deque[float] = deque(maxlen=4096)
        #: Throttling refusals, by monotonic time.
        self.refusals: deque[float] = deque(maxlen=4096)
        self.in_flight = 0
        self.permits = 0
        self.permits_until = -math.inf
        #: When the last lease began (monotonic): waiters lease again only after PACE.
        self.leased_at = -math.inf
        self.slot_waiting = 0
        self.freed = asyncio.Event()
        self.leasing = asyncio.Lock()
        self.writing = False
        self.seen_changed_at: int | None = None

    @property
    def limited(self) -> bool:
        e = self.endpoint
        return self.throttled or e.rate_limit is not None or e.max_in_flight is not None


class Limits:
    """One dispatcher's part in the fleet's rate and in-flight limits."""

    def __init__(
        self,
        *,
        store: Store,
        endpoints: Mapping[str, Endpoint],
        owner: str,
        clock: Clock,
        run_db: RunDb,
        log: Any,
        lease_seconds: float = 30.0,
    ) -> None:
        self._store = store
        self._lease_seconds = lease_seconds
        self._owner = owner
        self._run_db = run_db
        self._log = log
        # The budget is the receiver's, in real time: this machine's wall clock (also
        # under a FakeClock: the receiver does not run on it). Not the database server's
        # as the leases follow it: that estimate is off by a round trip, which under load
        # exceeds the skew of NTP-synced hosts (see DESIGN-NOTES on the overshoot).
        self._wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000
        self._gates = {name: _Gate(e) for name, e in endpoints.items()}
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._background: set[asyncio.Task[Any]] = set()

    # -- the send path ------------------------------------------------------------

    def room(self, limit: int, states: Mapping[str, EndpointState]) -> int:
        """How many operations to claim, of ``limit``, once the fleet's ``states`` (as the
        breaker last read them) are seen: while every endpoint is held to a rate, no more
        than half a lease of it can send, minus what already waits (the rest would wait
        past its lease and be given back unsent). At least one."""
        self.seen(states)
        rates = [g.rate or g.endpoint.rate_limit for g in self._gates.values()]
        if (
            not rates
            or any(r is None for r in rates)
            or not all(
                g.throttled or g.endpoint.rate_limit is not None for g in self._gates.values()
            )
        ):
            return limit
        sendable = sum(r for r in rates if r is not None) * self._lease_seconds / 2
        waiting = sum(g.waiting for g in self._gates.values())
        return max(1, min(limit, math.ceil(sendable) - waiting))

    def limited(self, name: str) -> bool:
        gate = self._gates.get(name)
        return gate is not None and gate.limited

    async def admit(self, endpoint: Endpoint) -> bool:
        """Wait until a request of ``endpoint`` may go out. True when it holds an
        in-flight permit, to give back with :meth:`release` after the attempt."""
        gate = self._gates.get(endpoint.name)
        if gate is None or not gate.limited:
            return False
        self._start()
        held = False
        if endpoint.max_in_flight is not None:
            await self._permit(gate)
            held = True
        try:
            if gate.throttled or endpoint.rate_limit is not None:
                await self._send_time(gate)
        except BaseException:
            if held:
                self.release(endpoint)
            raise
        return held

    def release(self, endpoint: Endpoint) -> None:
        gate = self._gates[endpoint.name]
        gate.in_flight -= 1
        gate.freed.set()

    async def _send_time(self, gate: _Gate) -> None:
        gate.waiting += 1
        try:
            while True:
                now = time.monotonic()
                while gate.times and gate.times[0] < now - LATE_SECONDS:
                    gate.times.popleft()  # too late: it may be another dispatcher's turn
                if gate.times:
                    at = gate.times.popleft()
                    if at > now:
                        await asyncio.sleep(at - now)
                        if time.monotonic() > at + LATE_SECONDS:
                            continue  # woken too late (a busy loop): not this one
                    return
                async with gate.granting:
                    if gate.times:
                        continue
                    if not await self._grant(gate):
                        return  # nothing limits the endpoint's rate any more
        finally:
            gate.waiting -= 1

    async def _grant(self, gate: _Gate) -> bool:
        """Take a slice of the rate budget; False when there is no rate to keep."""
        rate = gate.rate or gate.endpoint.rate_limit or 1.0
        want = max(1, min(gate.waiting, math.ceil(rate * SLICE_SECONDS)))
        now_ms, asked = self._wall_ms(), time.monotonic()
        try:
            grant = await self._run_db(
                self._store.grant_rate, name=gate.endpoint.name, now_ms=now_ms, want=want,
                declared=gate.endpoint.rate_limit, horizon_ms=HORIZON_MS,
            )  # fmt: skip
        except (StoreError, DBAPIError) as exc:
            self._warn(exc)
            await asyncio.sleep(PERIOD)  # no budget without the database: wait, retry
            return True
        if grant.rate is None:
            gate.throttled, gate.rate = False, None
            return False
        gate.rate = grant.rate
        # On the monotonic clock read with now_ms: the round trip does not shift the
        # interval (a shifted one would overlap the next dispatcher's).
        base = asked + (grant.start_us / 1000 - now_ms) / 1000
        if grant.count == 0:
            await asyncio.sleep(max(0.005, base - time.monotonic() - HORIZON_MS / 1000))
            return True
        step = 1 / grant.rate
        gate.times.extend(base + i * step for i in range(grant.count))
        return True

    async def _permit(self, gate: _Gate) -> None:
        limit = gate.endpoint.max_in_flight
        assert limit is not None
        gate.slot_waiting += 1
        try:
            while True:
                if gate.in_flight < gate.permits and time.monotonic() < gate.permits_until:
                    gate.in_flight += 1
                    return
                async with gate.leasing:
                    now = time.monotonic()
                    if now >= gate.leased_at + PACE and (
                        gate.in_flight >= gate.permits or now >= gate.permits_until
                    ):
                        await self._lease(gate, limit)
                if gate.in_flight < gate.permits and time.monotonic() < gate.permits_until:
                    continue
                gate.freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gate.freed.wait(), timeout=PACE)
        finally:
            gate.slot_waiting -= 1

    async def _lease(self, gate: _Gate, limit: int) -> None:
        want = min(limit, gate.in_flight + gate.slot_waiting)
        started = gate.leased_at = time.monotonic()
        try:
            permits = await self._run_db(
                self._store.lease_slots, name=gate.endpoint.name, owner=self._owner,
                now_ms=self._wall_ms(), want=want, limit=limit,
                lease_ms=permit_lease_ms(gate.endpoint), in_use=gate.in_flight,
            )  # fmt: skip
        except (StoreError, DBAPIError) as exc:
            self._warn(exc)
            return
        if permits > gate.permits:
            gate.freed.set()  # waiters pacing themselves take the new permits now
        gate.permits = permits
        # Trusted for a little less than the lease (the time the transaction took).
        gate.permits_until = started + PERMIT_LEASE_MS / 1000 - PERIOD

    # -- what the receiver says ---------------------------------------------------

    def answered(self, endpoint: Endpoint, result: AttemptResult) -> None:
        """Read one answer: a throttling refusal throttles the endpoint at once here, and
        for the fleet in the background."""
        gate = self._gates.get(endpoint.name)
        if gate is None:
            return
        if not throttles(endpoint, result):
            if result.status_code is not None:
                gate.answers.append(time.monotonic())
            return
        throttle = endpoint.throttle
        assert throttle is not None
        now = time.monotonic()
        gate.refusals.append(now)
        took = sum(1 for t in gate.answers if t > now - 1.0)
        refused = sum(1 for t in gate.refusals if t > now - 1.0)
        hint = result.classification.rate_hint
        said = hint.rate if hint is not None else None
        pause = _pause_ms(throttle, result, self._wall_ms())
        if (
            said is None
            and pause is None
            and (refused < MIN_REFUSALS or refused < throttle.tolerance * (refused + took))
        ):
            return  # a stray refusal, not a limit: the retry policy paces that operation
        first = not gate.throttled
        gate.throttled = True
        gate.times.clear()  # the receiver refused: what was granted may be too fast
        if first:
            gate.rate = said or max(throttle.min_rate, float(took))
        self._start()
        if gate.writing:
            return
        gate.writing = True
        sent_at = self._wall_ms() - result.duration_ms
        task = asyncio.create_task(
            self._write_throttle(
                gate, throttle, took=float(took), said=said, pause=pause, sent_at=sent_at
            )
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _write_throttle(self, gate: _Gate, throttle: Throttle, *, took: float,
                              said: float | None, pause: int | None,
                              sent_at: int) -> None:  # fmt: skip
        try:
            result = await self._run_db(
                self._store.throttle, name=gate.endpoint.name, now_ms=self._wall_ms(),
                initial=max(throttle.min_rate, took), said=said, decrease=throttle.decrease,
                min_rate=throttle.min_rate, interval_ms=_ms(throttle.interval),
                pause_until_ms=pause, sent_at_ms=sent_at,
            )  # fmt: skip
            if result.changed:
                self._log.warning("endpoint_throttled", endpoint=gate.endpoint.name,
                                  rate=round(result.rate, 2))  # fmt: skip
            gate.rate = effective(gate.endpoint, result.rate)
        except (StoreError, DBAPIError) as exc:
            self._warn(exc)
        finally:
            gate.writing = False

    def seen(self, states: Mapping[str, EndpointState]) -> None:
        """The fleet's states as the breaker last read them: a throttle another
        dispatcher set holds here too."""
        for name, state in states.items():
            gate = self._gates.get(name)
            if gate is not None and state.rate is not None and not gate.throttled:
                gate.throttled, gate.rate = True, effective(gate.endpoint, state.rate)
                gate.seen_changed_at = state.rate_changed_at
                self._start()

    # -- the background -----------------------------------------------------------

    def _start(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.create_task(self._maintain())

    async def _maintain(self) -> None:
        """Every PERIOD: re-read the throttles, raise or lift them when due, renew or give
        back in-flight permits."""
        while not self._closed:
            await asyncio.sleep(PERIOD)
            if any(g.throttled for g in self._gates.values()):
                await self._recover()
            for gate in self._gates.values():
                limit = gate.endpoint.max_in_flight
                if limit is None or gate.leasing.locked():
                    continue
                if gate.permits or gate.slot_waiting:
                    async with gate.leasing:
                        await self._lease(gate, limit)

    async def _recover(self) -> None:
        try:
            states = await self._run_db(self._store.endpoint_states)
        except (StoreError, DBAPIError) as exc:
            self._warn(exc)
            return
        now = self._wall_ms()
        for state in states:
            gate = self._gates.get(state.name)
            if gate is None or (not gate.throttled and state.rate is None):
                continue
            throttle = gate.endpoint.throttle or Throttle()
            if state.rate is None:
                gate.throttled, gate.rate = False, gate.endpoint.rate_limit
                self._log.info("endpoint_throttle_lifted", endpoint=state.name)
                continue
            gate.throttled = True
            gate.seen_changed_at = state.rate_changed_at
            interval = _ms(throttle.interval)
            if now - (state.rate_changed_at or 0) < interval or gate.writing:
                gate.rate = effective(gate.endpoint, state.rate)
                continue
            try:
                rate = await self._run_db(
                    self._store.recover_rate, name=state.name, now_ms=now,
                    seen_changed_at=state.rate_changed_at, step_fraction=throttle.increase,
                    min_step=throttle.min_rate, interval_ms=interval,
                    release_after_ms=_ms(throttle.release_after),
                )  # fmt: skip
            except (StoreError, DBAPIError) as exc:
                self._warn(exc)
                continue
            if rate is None:
                gate.throttled, gate.rate = False, gate.endpoint.rate_limit
                self._log.info("endpoint_throttle_lifted", endpoint=state.name)
            else:
                gate.rate = effective(gate.endpoint, rate)

    async def close(self) -> None:
        """Stop the background work and give the in-flight permits back."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for gate in self._gates.values():
            if gate.endpoint.max_in_flight is not None and gate.permits:
                try:
                    await self._run_db(
                        self._store.lease_slots, name=gate.endpoint.name, owner=self._owner,
                        now_ms=self._wall_ms(), want=0, limit=gate.endpoint.max_in_flight,
                        lease_ms=0,
                    )  # fmt: skip
                except (StoreError, DBAPIError) as exc:
                    self._warn(exc)

    def _warn(self, exc: Exception) -> None:
        self._log.warning("endpoint_limits_unavailable", error=type(exc).__name__,
                          detail=str(exc)[:300])  # fmt: skip


def effective(endpoint: Endpoint, throttle: float | None) -> float | None:
    rates = [r for r in (endpoint.rate_limit, throttle) if r is not None]
    return min(rates) if rates else None


def _ms(delta: Any) -> int:
    return int(delta.total_seconds() * 1000)


def _pause_ms(throttle: Throttle, result: AttemptResult, now_ms: int) -> int | None:
    """Until when the whole fleet holds the endpoint's sends: a Retry-After (or a reset
    of a spent budget) of at least ``pause_at_least``; shorter ones pace only the
    refused operation."""
    cls = result.classification
    waits = [cls.retry_after_seconds]
    if cls.rate_hint is not None and cls.rate_hint.reset_is_a_wait:
        waits.append(cls.rate_hint.reset_seconds)
    longest = max((w for w in waits if w is not None), default=None)
    if longest is None or longest < throttle.pause_at_least.total_seconds():
        return None
    return now_ms + int(longest * 1000)


__all__ = ["Limits"]
