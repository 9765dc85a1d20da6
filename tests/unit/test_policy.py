"""Retry decisions are pure: state and time from the stored history."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from tenacity import wait_fixed

from outbox import Endpoint, Reason, RetryPolicy, State, Verdict
from outbox.classify import parse_retry_after
from outbox.dispatch.policy import (
    backoff_seconds,
    decide,
    in_progress_backoff_seconds,
    reason_from_history,
)

NOW = 1_800_000_000_000
EP = Endpoint(
    name="e",
    base_url="http://127.0.0.1:1",
    retry=RetryPolicy(max_attempts=3, window=timedelta(seconds=60), wait=wait_fixed(5)),
    key_retention=timedelta(hours=1),
)


def _decide(verdict: Verdict, *, counted: int = 1, maybe: bool = False, refused: bool = False,
            retry_after: float | None = None, deadline: int = NOW + 60_000,
            in_progress: int = 0, now: int = NOW, endpoint: Endpoint = EP) -> tuple:
    d = decide(endpoint=endpoint, verdict=verdict, attempts_counted=counted,
               maybe_delivered=maybe, saw_refusal=refused, retry_after_seconds=retry_after,
               deadline_ms=deadline, now_ms=now, attempts_in_progress=in_progress)
    return d.state, d.reason, d.next_attempt_at_ms


def test_terminal_verdicts() -> None:
    assert _decide(Verdict.SUCCESS)[0] is State.SUCCEEDED
    assert _decide(Verdict.FAILED)[0] is State.FAILED
    assert _decide(Verdict.KEY_CONFLICT)[:2] == (State.UNRESOLVED, Reason.KEY_CONFLICT)


def test_retry_uses_the_wait_strategy() -> None:
    assert _decide(Verdict.RETRY) == (State.PENDING, None, NOW + 5000)


def test_retry_after_longer_than_backoff_wins() -> None:
    assert _decide(Verdict.RETRY, retry_after=20)[2] == NOW + 20_000


def test_retry_after_past_the_window_is_unresolved_now() -> None:
    state, reason, _ = _decide(Verdict.RETRY, retry_after=120, refused=True)
    assert (state, reason) == (State.UNRESOLVED, Reason.RETRIES_EXHAUSTED)


def test_a_replayed_stored_failure_goes_to_reconciliation_at_once() -> None:
    d = decide(
        endpoint=EP,
        verdict=Verdict.RETRY,
        attempts_counted=1,
        maybe_delivered=True,
        saw_refusal=False,
        retry_after_seconds=None,
        deadline_ms=NOW + 60_000,
        now_ms=NOW,
        replayed_failure=True,
    )
    assert (d.state, d.reason, d.next_attempt_at_ms) == (
        State.UNRESOLVED,
        Reason.OUTCOME_UNKNOWN,
        None,
    )
    assert "replays a stored failure" in d.why


def test_attempts_spent() -> None:
    assert _decide(Verdict.RETRY, counted=3, maybe=True)[:2] == (
        State.UNRESOLVED, Reason.OUTCOME_UNKNOWN)


def test_in_progress_does_not_spend_attempts_but_the_window_bounds_it() -> None:
    assert _decide(Verdict.IN_PROGRESS, counted=3, maybe=True, in_progress=1)[0] is State.PENDING
    assert _decide(
        Verdict.IN_PROGRESS, counted=3, maybe=True, in_progress=1, deadline=NOW
    )[0] is State.UNRESOLVED


def test_in_progress_answers_have_their_own_budget() -> None:
    budget = EP.retry.in_progress_budget
    assert _decide(Verdict.IN_PROGRESS, maybe=True, in_progress=budget - 1)[0] is State.PENDING
    assert _decide(Verdict.IN_PROGRESS, maybe=True, in_progress=budget)[:2] == (
        State.UNRESOLVED, Reason.RECEIVER_BUSY)
    zero = Endpoint(name="z", base_url="http://127.0.0.1:1",
                    retry=RetryPolicy(in_progress_budget=0))
    assert _decide(Verdict.IN_PROGRESS, maybe=True, in_progress=1, endpoint=zero)[:2] == (
        State.UNRESOLVED, Reason.RECEIVER_BUSY)


def test_in_progress_backoff_never_under_a_second_and_growing() -> None:
    for n in range(1, 12):
        samples = [in_progress_backoff_seconds(EP, n) for _ in range(50)]
        floor = min(2 ** (n - 1), 60)
        assert all(floor <= s <= 2 * floor for s in samples), (n, min(samples), max(samples))
    assert len({in_progress_backoff_seconds(EP, 3) for _ in range(20)}) > 1  # jittered
    # The schedule follows the backoff, not a fixed poll.
    state, _, next_at = _decide(Verdict.IN_PROGRESS, maybe=True, in_progress=4)
    assert state is State.PENDING and NOW + 8000 <= next_at <= NOW + 16_000


def test_a_refusal_after_a_maybe_applied_attempt_is_conflicting_evidence() -> None:
    assert _decide(Verdict.FAILED, maybe=False, refused=True)[:2] == (State.FAILED, None)
    assert _decide(Verdict.FAILED, maybe=True)[:2] == (
        State.UNRESOLVED, Reason.CONFLICTING_EVIDENCE)


def test_backoff_is_shortened_to_land_inside_the_window() -> None:
    # One last try, a little before the deadline (a tenth of the window, at most 1 s)...
    assert _decide(Verdict.RETRY, deadline=NOW + 2000) == (State.PENDING, None, NOW + 1000)
    # ...and once inside that last stretch, no further one.
    assert _decide(Verdict.RETRY, deadline=NOW + 1000)[0] is State.UNRESOLVED
    assert _decide(Verdict.RETRY, deadline=NOW + 900)[0] is State.UNRESOLVED


def test_retry_after_inside_the_last_stretch_is_not_shortened() -> None:
    state, _, _ = _decide(Verdict.RETRY, retry_after=59.5, refused=True)
    assert state is State.UNRESOLVED


@pytest.mark.parametrize(
    ("maybe", "refused", "reason"),
    [(True, True, Reason.OUTCOME_UNKNOWN), (False, True, Reason.RETRIES_EXHAUSTED),
     (False, False, Reason.NEVER_DELIVERED)],
)
def test_reason_from_history(maybe: bool, refused: bool, reason: Reason) -> None:
    assert reason_from_history(maybe_delivered=maybe, saw_refusal=refused) is reason


def test_retry_after_forms() -> None:
    assert parse_retry_after("7", NOW) == 7.0
    when = datetime.fromtimestamp(NOW / 1000 + 30, tz=UTC)
    assert parse_retry_after(format_datetime(when, usegmt=True), NOW) == pytest.approx(30, abs=1)
    assert parse_retry_after("soon, maybe", NOW) is None
    assert parse_retry_after("-5", NOW) is None
    assert parse_retry_after(None, NOW) is None


def test_default_backoff_is_full_jitter_and_capped() -> None:
    ep = Endpoint(name="d", base_url="http://127.0.0.1:1")
    samples = [backoff_seconds(ep, 20) for _ in range(200)]
    assert all(0 <= s <= 60 for s in samples)
    assert len(set(samples)) > 1
