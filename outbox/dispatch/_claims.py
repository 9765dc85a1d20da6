"""One claim's arguments, as a typed record, and the store calls that take them.

A claim is made in three places (the claim loop, the outcome writer's pipelined claim,
the half-open probe of a circuit); all three build a :class:`ClaimArgs` and hand it to
one of the functions below, run on the dispatcher's database thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from outbox.clock import Clock
from outbox.config import Endpoint
from outbox.dispatch.dbthread import DatabaseUnresponsive, error_detail, is_transient
from outbox.dispatch.outcomes import given_back, plan_claimed
from outbox.model import ErrorClass
from outbox.store.base import Store
from outbox.store.evidence import claim_left_open
from outbox.store.records import AttemptOutcome, Claimed, ClaimPlan, ClaimResult


@dataclass(frozen=True, slots=True)
class ClaimArgs:
    """One claim's arguments for the store and what its accounting needs after it."""

    owner: str
    token: str
    now_ms: int
    lease_ms: int
    limit: int
    endpoints: Mapping[str, Endpoint]
    #: time.time_ns() before the claim (the claim span's start).
    claim_ns: int
    #: The monotonic clock before the claim: leases are measured from here.
    claimed_mono: float
    #: Leases judged by the database server's clock (PostgreSQL, the dispatcher's
    #: clock an OffsetClock): the store reads the server's time in the claim itself.
    server_clock: bool = False
    #: How long the dispatcher's clock has run without a step (None: not watched); an
    #: expired lease longer than that is not taken over (DESIGN-NOTES "Leases that
    #: survive a clock step").
    steady_ms: int | None = None
    #: Filled by :meth:`plan` inside the transaction: operations not to send, and why.
    refused: list[tuple[Claimed, str]] = field(default_factory=list)

    def plan(self, claimed: list[Claimed]) -> ClaimPlan:
        """Decide about the claimed rows, inside the claim's transaction (pure)."""
        return plan_claimed(
            claimed, endpoints=self.endpoints, dispatcher_id=self.owner,
            token=self.token, now=self.now_ms, refused=self.refused,
        )  # fmt: skip


def claim_and_begin(store: Store, args: ClaimArgs) -> ClaimResult:
    """Claim a batch and commit its attempt rows (one transaction)."""
    return store.claim_and_begin(
        owner=args.owner, token=args.token, now_ms=args.now_ms, lease_ms=args.lease_ms,
        limit=args.limit, plan=args.plan, server_clock=args.server_clock,
        steady_ms=args.steady_ms,
    )  # fmt: skip


def claim_probe(store: Store, args: ClaimArgs, endpoint: str) -> ClaimResult:
    """Claim and begin the half-open probe of ``endpoint`` (one operation)."""
    return store.claim_probe(
        endpoint=endpoint, owner=args.owner, token=args.token, now_ms=args.now_ms,
        lease_ms=args.lease_ms, plan=args.plan, server_clock=args.server_clock,
        steady_ms=args.steady_ms,
    )  # fmt: skip


def record_and_claim(
    store: Store, args: ClaimArgs, outcomes: Sequence[AttemptOutcome]
) -> tuple[set[int], ClaimResult]:
    """Write ``outcomes`` and make the next claim, in one transaction."""
    return store.record_and_claim(
        outcomes=outcomes, owner=args.owner, token=args.token, now_ms=args.now_ms,
        lease_ms=args.lease_ms, limit=args.limit, plan=args.plan,
        server_clock=args.server_clock, steady_ms=args.steady_ms,
    )  # fmt: skip


def give_back_lost_claim(store: Store, token: str, now_ms: int) -> set[int]:
    """A claim whose COMMIT was reported failed may have taken effect: then operations
    are leased under ``token`` with attempt rows, and nothing was sent. Close those
    attempts as not sent (not counted) and make the operations due now, fenced on the
    token; the pks given back (none when the claim never took effect)."""
    left = claim_left_open(store, token)
    if not left:
        return set()
    message = "the claim's COMMIT was reported failed but took effect; never sent"
    outcomes = [given_back(a, ErrorClass.CLAIM_COMMIT_LOST, message, now_ms) for a in left]
    return store.record_outcomes(now_ms=now_ms, outcomes=outcomes)


class LostClaims:
    """The claims whose transaction failed and may have committed after all, until each
    is given back (:func:`give_back_lost_claim`) or its lease ends.

    Each is tried once when its transaction fails and again before each later claim, so
    the claim loop's backoff spaces the tries while the database is away, and neither a
    claim nor a stop waits on them. Given up at the end of its lease, a claim that had
    committed is what it was before: its attempts are closed as unknown by the next claim.
    """

    def __init__(
        self, *, store: Store, run_db: Any, clock: Clock, log: Any, lease_seconds: float
    ) -> None:
        self._store, self._run_db, self._clock, self._log = store, run_db, clock, log
        self._lease_seconds = lease_seconds
        #: token -> when its lease ends, on the monotonic clock.
        self._pending: dict[str, float] = {}

    async def failed(self, args: ClaimArgs) -> None:
        """The transaction of claim ``args`` failed: give back what it claimed, if any."""
        self._pending[args.token] = args.claimed_mono + self._lease_seconds
        await self.give_back()

    async def give_back(self) -> None:
        """Try each pending claim once; one the database could not read stays pending
        (and so do the others: it is away) while its lease holds."""
        for token, ends in list(self._pending.items()):
            log = self._log.bind(lease_token=token)
            if ends - self._clock.monotonic() < 1.0:
                self._pending.pop(token, None)
                log.warning("claim_give_back_abandoned",
                            detail="a failed claim's lease ends; had it committed, the next "
                                   "claim closes its attempts as unknown")  # fmt: skip
                continue
            try:
                given: set[int] = await self._run_db(
                    give_back_lost_claim, store=self._store, token=token,
                    now_ms=self._clock.now_ms())  # fmt: skip
            except Exception as exc:
                if is_transient(exc) or isinstance(exc, DatabaseUnresponsive):
                    log.info("claim_give_back_deferred", error=type(exc).__name__)
                    return
                self._pending.pop(token, None)
                log.error("claim_give_back_failed", error=type(exc).__name__,
                          detail=error_detail(exc), exc_info=exc)  # fmt: skip
                continue
            self._pending.pop(token, None)
            if given:
                log.warning("claim_given_back", count=len(given),
                            detail="a failed COMMIT had claimed these; never sent, due again now")
