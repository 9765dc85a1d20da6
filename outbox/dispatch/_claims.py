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
from outbox.dispatch.dbthread import write_while_leased
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


async def give_back_after_failure(
    args: ClaimArgs, lease_seconds: float, *, clock: Clock, run_db: Any, store: Store, log: Any
) -> None:
    """After the transaction of claim ``args`` failed: give back what it claimed if its
    COMMIT took effect (:func:`give_back_lost_claim`), retrying a transient failure
    while its lease would hold. Given up, the leases expire as before."""
    ends = args.claimed_mono + lease_seconds
    given: set[int] = await write_while_leased(
        lambda: run_db(give_back_lost_claim, store=store, token=args.token,
                       now_ms=clock.now_ms()),
        lease_left=lambda: ends - clock.monotonic(),
        log=log.bind(lease_token=args.token),
    )  # fmt: skip
    if given:
        log.warning("claim_given_back", count=len(given), lease_token=args.token,
                    detail="a failed COMMIT had claimed these; never sent, due again now")
