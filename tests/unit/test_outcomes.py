"""The dispatcher's decisions without I/O: a never-sent operation's business deadline is
its own ``enqueue(deliver_within=...)`` when it has one, else the endpoint policy's."""

from __future__ import annotations

from datetime import timedelta

import pytest

from outbox import Endpoint, Reason, RetryPolicy, State
from outbox.dispatch.outcomes import business_deadline_ms, plan_claimed, send_deadline_ms
from outbox.store.records import Claimed, ClaimPlan, StartedAttempt

CREATED = 1_800_000_000_000
HOUR_MS = 3_600_000
EP = Endpoint(
    name="rx",
    base_url="http://127.0.0.1:9",
    retry=RetryPolicy(window=timedelta(seconds=60), deliver_within=timedelta(hours=1)),
)


def _claimed(pk: int, *, deliver_within_ms: int | None = None, maybe: bool = False) -> Claimed:
    """An operation tried once before, never sent (unless ``maybe``), now claimed."""
    return Claimed(
        pk=pk,
        tenant="",
        operation_id=f"op-{pk}",
        endpoint="rx",
        method="POST",
        path="/o",
        headers={},
        body=None,
        attempts_counted=0,
        attempts_total=1,
        maybe_delivered=maybe,
        saw_refusal=False,
        first_attempt_at=CREATED if maybe else None,
        window_started_at=CREATED if maybe else None,
        lease_until=CREATED + 60_000,
        created_at=CREATED,
        policy_window_ms=60_000,
        deliver_within_ms=deliver_within_ms,
    )


@pytest.mark.parametrize(
    ("own", "deadline"),
    [(None, CREATED + HOUR_MS), (2000, CREATED + 2000), (3 * HOUR_MS, CREATED + 3 * HOUR_MS)],
    ids=["the-policy-s", "shorter-of-its-own", "longer-of-its-own"],
)
def test_the_business_deadline_is_the_operation_s_own_else_the_policy_s(
    own: int | None, deadline: int
) -> None:
    c = _claimed(1, deliver_within_ms=own)
    assert business_deadline_ms(c, EP, CREATED + 5) == deadline
    started = StartedAttempt(1, "req", 2, CREATED + 5, CREATED + 5)
    assert send_deadline_ms(c, EP, started, CREATED + 5) == deadline


def test_an_own_deliver_within_does_not_bound_an_operation_that_may_have_been_sent() -> None:
    # Once an attempt may have been applied, the window decides (a duplicate risk).
    c = _claimed(1, deliver_within_ms=2000, maybe=True)
    started = StartedAttempt(1, "req", 2, CREATED, CREATED)
    assert send_deadline_ms(c, EP, started, CREATED + 5) == EP.deadline_ms(
        window_started_at_ms=CREATED, first_attempt_at_ms=CREATED
    )


def _plan(claimed: list[Claimed], now: int) -> ClaimPlan:
    return plan_claimed(
        claimed, endpoints={"rx": EP}, dispatcher_id="d", token="t", now=now, refused=[]
    )


def test_the_claim_plan_ends_only_the_operation_past_its_own_deadline() -> None:
    urgent, patient = _claimed(1, deliver_within_ms=2000), _claimed(2)
    before = _plan([urgent, patient], CREATED + 2000)
    assert set(before.send) == {1, 2} and not before.settlements
    after = _plan([urgent, patient], CREATED + 2001)
    assert set(after.send) == {2}
    [settled] = after.settlements
    assert (settled.pk, settled.state) == (1, State.UNRESOLVED)
    assert settled.reason is Reason.NEVER_DELIVERED
