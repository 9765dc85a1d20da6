"""The fleet-wide circuit breaker, as one dispatcher takes part in it.

The state lives in ``outbox_endpoints`` (``outbox.store.endpoints``); the claim itself
leaves out operations of a blocked endpoint, so while a circuit is open nothing of it
is claimed: no attempt rows, no backoff spent. A dispatcher:

* counts consecutive failures per endpoint (not sent, 5xx, timeouts; a 4xx, 429 or
  2xx is an answer and resets the count; a throttling 503 that says how to pace, with
  ``Retry-After`` or rate-limit fields, is the throttle's and neither); at the
  endpoint's ``failure_threshold`` it opens the circuit for every dispatcher (one
  conditional UPDATE);
* re-reads the states every ``refresh_seconds`` (one small SELECT, not one per
  request), and when a probe is due takes the half-open probe lease (one winner), then
  claims one real due operation of the endpoint past the block and sends it;
* closes the circuit on an answer of the receiver, or opens it again with the next
  probe spaced by backoff with jitter. A dispatcher killed while it holds the probe
  lease is replaced when the lease ends (another takes it).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DBAPIError

from outbox.config import CircuitBreaker, Endpoint
from outbox.dispatch.outcomes import NOT_TRIED
from outbox.errors import StoreError
from outbox.model import Delivery
from outbox.store.base import Store
from outbox.store.endpoints import Circuit, EndpointState
from outbox.store.records import AttemptOutcome

#: What a dispatcher calls to claim and start the probe of an endpoint: the number of
#: operations it started (0 or 1).
ProbeClaim = Callable[[str], Awaitable[int]]
RunDb = Callable[..., Awaitable[Any]]


def probe_wait_ms(policy: CircuitBreaker, probes: int, rng: random.Random) -> int:
    """The wait before the next probe after ``probes`` failed ones: the policy's
    ``probe_wait`` doubled per failed probe, capped, with jitter (half to all of it)."""
    base = policy.probe_wait.total_seconds() * (2 ** min(max(probes, 0), 30))
    capped = min(base, policy.probe_max_wait.total_seconds())
    return int(capped * 1000 * rng.uniform(0.5, 1.0))


def is_failure(out: AttemptOutcome) -> bool | None:
    """True for a failure that is not a success (not sent, 5xx, timeout), False for an
    answer of the receiver (2xx, 4xx, 429), None when the attempt says nothing about
    the receiver being down (given back before it was tried; a rate limiter's refusal,
    which the throttle follows)."""
    if out.delivery is Delivery.NOT_SENT:
        return None if out.error_class in NOT_TRIED else True
    if out.status_code is None:
        return True  # timeout, connection lost after sending
    if out.status_code >= 500 and out.rate_limited:
        return None  # a 503 with Retry-After or rate-limit fields: the throttle's
    return out.status_code >= 500


@dataclass(kw_only=True, eq=False, slots=True)
class Breaker:
    """One dispatcher's part in the fleet's circuit breakers."""

    store: Store
    endpoints: Mapping[str, Endpoint]
    owner: str
    now_ms: Callable[[], int]
    monotonic: Callable[[], float]
    run_db: RunDb
    lease_ms: int
    log: Any
    rng: random.Random = field(default_factory=random.Random)
    states: dict[str, EndpointState] = field(init=False, default_factory=dict)
    #: Operations this dispatcher sends as half-open probes: pk -> endpoint.
    probes: dict[int, str] = field(init=False, default_factory=dict)
    _refreshed: float = field(init=False, default=-math.inf)
    _failures: dict[str, int] = field(init=False, default_factory=dict)
    _refresh_seconds: float = field(init=False)

    def __post_init__(self) -> None:
        breakers = [e.circuit_breaker for e in self.endpoints.values()]
        self._refresh_seconds = min(
            (b.refresh_seconds for b in breakers if b is not None), default=1.0
        )

    def known_down(self, name: str, pk: int) -> bool:
        """The endpoint is known down: its circuit is not closed, or this is a probe."""
        state = self.states.get(name)
        return pk in self.probes or (state is not None and state.circuit is not Circuit.CLOSED)

    def next_probe_ms(self) -> int | None:
        """The earliest probe this dispatcher may try to take (to wake for it)."""
        times = [
            max(s.next_probe_at or 0, s.probe_until or 0)
            for s in self.states.values()
            if s.circuit is not Circuit.CLOSED and not s.paused and s.name in self.endpoints
        ]
        return min(times, default=None)

    async def _db(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            return await self.run_db(fn, **kwargs)
        except (StoreError, DBAPIError) as exc:
            self.log.warning(
                "endpoint_state_unavailable", error=type(exc).__name__, detail=str(exc)[:300]
            )
            return None

    async def tick(self, probe: ProbeClaim) -> int:
        """Re-read the states when due; take and start the probes due. Operations started."""
        if self.monotonic() - self._refreshed < self._refresh_seconds:
            return 0
        self._refreshed = self.monotonic()
        states = await self._db(self.store.endpoint_states)
        if states is None:
            return 0
        self.states = {s.name: s for s in states}
        started = 0
        now = self.now_ms()
        for s in states:
            endpoint = self.endpoints.get(s.name)
            if (
                endpoint is None
                or endpoint.circuit_breaker is None
                or s.paused
                or s.circuit is Circuit.CLOSED
                or (s.next_probe_at or 0) > now
                or (s.probe_until is not None and s.probe_until >= now)
            ):
                continue
            won = await self._db(
                self.store.take_probe,
                name=s.name,
                owner=self.owner,
                now_ms=now,
                lease_ms=self.lease_ms,
            )
            if not won:
                continue
            taken_over = s.circuit is Circuit.HALF_OPEN
            self.log.info(
                "circuit_half_open",
                endpoint=s.name,
                probes=s.probes,
                taken_over_from=s.probe_owner if taken_over else None,
            )
            try:
                n = await probe(s.name)
            except Exception:
                # Its claim failed (it may be given back): the probe lease must not
                # hold the circuit until it ends. Best effort; the error goes on.
                with contextlib.suppress(Exception):
                    await self._probe_again_soon(s, endpoint.circuit_breaker, now)
                raise
            started += n
            if n == 0:  # nothing due to probe with: stay open, look again soon
                await self._probe_again_soon(s, endpoint.circuit_breaker, now)
        return started

    async def _probe_again_soon(
        self, s: EndpointState, policy: CircuitBreaker, now: int
    ) -> None:
        """Give the probe lease back: the circuit stays open, the next probe soon."""
        await self._db(self.store.probe_failed, name=s.name, owner=self.owner, now_ms=now,
                       next_probe_at=now + probe_wait_ms(policy, 0, self.rng),
                       reason=s.reason or "open")  # fmt: skip

    async def observe(self, outcomes: list[tuple[AttemptOutcome, str | None]]) -> None:
        """Count written outcomes per endpoint (the fleet's count, in the database, is
        written only on failures and on the first success after them); open, close or
        re-open circuits."""
        failed_now: dict[str, tuple[int, str]] = {}
        answered: set[str] = set()
        for out, name in outcomes:
            endpoint = self.endpoints.get(name or "")
            probe_of = self.probes.pop(out.pk, None)
            if endpoint is None or endpoint.circuit_breaker is None:
                continue
            failed = is_failure(out)
            if probe_of is not None:
                if failed is False:
                    await self._close(endpoint, out)
                else:
                    sent = failed is not None or out.rate_limited
                    why = _why(out) if sent else "probe not sent"
                    await self._reopen(endpoint, endpoint.circuit_breaker, why)
            elif failed:
                count = failed_now.get(endpoint.name, (0, ""))[0]
                failed_now[endpoint.name] = (count + 1, _why(out))
            elif failed is False:
                failed_now.pop(endpoint.name, None)
                answered.add(endpoint.name)
        now = self.now_ms()
        for name in answered:
            state = self.states.get(name)
            if self._failures.pop(name, 0) or (state is not None and state.failures):
                await self._db(self.store.reset_failures, name=name, now_ms=now)
            if state is not None and state.circuit is not Circuit.CLOSED:
                await self._close(self.endpoints[name], None)
        for name, (count, why) in failed_now.items():
            policy = self.endpoints[name].circuit_breaker
            assert policy is not None
            self._failures[name] = self._failures.get(name, 0) + count
            state = self.states.get(name)
            if state is not None and state.circuit is not Circuit.CLOSED:
                continue  # already open: attempts in flight when it opened
            opened = await self._db(
                self.store.count_failures,
                name=name,
                failures=count,
                threshold=policy.failure_threshold,
                reason=f"consecutive failures, the last: {why}",
                now_ms=now,
                next_probe_at=now + probe_wait_ms(policy, 0, self.rng),
            )
            if opened:
                self.log.warning("circuit_opened", endpoint=name, reason=why)
                self._refreshed = -float("inf")  # see it at the next tick

    async def _reopen(self, endpoint: Endpoint, policy: CircuitBreaker, reason: str) -> None:
        now = self.now_ms()
        state = self.states.get(endpoint.name)
        probes = (state.probes if state is not None else 0) + 1
        wait = probe_wait_ms(policy, probes, self.rng)
        if await self._db(
            self.store.probe_failed,
            name=endpoint.name,
            owner=self.owner,
            now_ms=now,
            next_probe_at=now + wait,
            reason=f"probe failed: {reason}",
        ):
            self.log.warning(
                "circuit_reopened",
                endpoint=endpoint.name,
                reason=reason,
                probes=probes,
                next_probe_in_ms=wait,
            )
        self._refreshed = -float("inf")

    async def _close(self, endpoint: Endpoint, out: AttemptOutcome | None) -> None:
        now = self.now_ms()
        reason = "the receiver answered" + (f" {out.status_code}" if out is not None else "")
        if await self._db(self.store.close_circuit, name=endpoint.name, now_ms=now, reason=reason):
            self.log.info("circuit_closed", endpoint=endpoint.name, reason=reason)
        self._refreshed = -float("inf")


def _why(out: AttemptOutcome) -> str:
    if out.status_code is not None:
        return f"status {out.status_code}" + (" (rate limited)" if out.rate_limited else "")
    return f"{out.error_class or out.delivery.value}"
