"""One claim's arguments, as a typed record, and the store calls that take them.

A claim is made in three places (the claim loop, the outcome writer's pipelined claim,
the half-open probe of a circuit); all three build a :class:`ClaimArgs` and hand it to
one of the functions below, run on the dispatcher's database thread.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from outbox.config import Endpoint
from outbox.dispatch.outcomes import plan_claimed
from outbox.store.base import Store
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
