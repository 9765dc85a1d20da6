"""Retry decisions: pure functions from the stored history to the next state.

A decision is data (a state and a time), never a sleep. tenacity's wait strategies are
the vocabulary; they are evaluated on a ``RetryCallState`` filled from the attempt
counts in the database, so a restart neither resets nor repeats the backoff.
"""

from __future__ import annotations

from dataclasses import dataclass

from tenacity import RetryCallState, Retrying

from outbox.config import Endpoint
from outbox.model import Reason, State, Verdict

_RETRYING = Retrying()


@dataclass(frozen=True, slots=True)
class Decision:
    state: State
    reason: Reason | None = None
    next_attempt_at_ms: int | None = None
    #: Why: for the log and for a reader of tests.
    why: str = ""


#: The last try is scheduled this long before the deadline at most (less for windows
#: under ten seconds: a tenth of the window), so that it starts inside the window.
LAST_TRY_GUARD_MS = 1000
#: "Still processing" answers are never retried sooner than this.
MIN_IN_PROGRESS_WAIT_SECONDS = 1.0


def backoff_seconds(endpoint: Endpoint, attempts_counted: int) -> float:
    """The wait after the ``attempts_counted``-th attempt, by the endpoint's strategy."""
    state = RetryCallState(retry_object=_RETRYING, fn=None, args=(), kwargs={})
    state.attempt_number = max(1, attempts_counted)
    return max(0.0, float(endpoint.retry.wait(state)))


def in_progress_backoff_seconds(endpoint: Endpoint, answers: int) -> float:
    """The wait after the ``answers``-th "still processing" answer: never under 1 s."""
    state = RetryCallState(retry_object=_RETRYING, fn=None, args=(), kwargs={})
    state.attempt_number = max(1, answers)
    return max(MIN_IN_PROGRESS_WAIT_SECONDS, float(endpoint.retry.in_progress_wait(state)))


def last_try_guard_ms(endpoint: Endpoint) -> int:
    return min(LAST_TRY_GUARD_MS, max(1, endpoint.retry.window_ms // 10))


def reason_from_history(*, maybe_delivered: bool, saw_refusal: bool) -> Reason:
    """Why an operation that ran out of retries is unresolved."""
    if maybe_delivered:
        return Reason.OUTCOME_UNKNOWN
    if saw_refusal:
        return Reason.RETRIES_EXHAUSTED
    return Reason.NEVER_DELIVERED


def decide(
    *,
    endpoint: Endpoint,
    verdict: Verdict,
    attempts_counted: int,
    maybe_delivered: bool,
    saw_refusal: bool,
    retry_after_seconds: float | None,
    deadline_ms: int,
    now_ms: int,
    attempts_in_progress: int = 0,
    replayed_failure: bool = False,
) -> Decision:
    """The operation's next state after an attempt.

    ``attempts_counted`` (and ``attempts_in_progress`` for a "still processing" answer)
    include this attempt if it counted; the flags include what this attempt observed,
    so ``maybe_delivered`` on a definitive refusal means an *earlier* attempt may have
    been applied. ``replayed_failure``: the answer is a stored 5xx the receiver replays
    for this key (``Classification.replayed_failure``), which no retry can change.
    """
    if verdict is Verdict.SUCCESS:
        return Decision(State.SUCCEEDED, why="2xx")
    if verdict is Verdict.FAILED:
        if maybe_delivered:
            # "failed" promises that the receiver did not apply it; after an attempt that
            # may have been applied, a refusal cannot prove that (a replay path answering
            # 4xx, a version that moved because of our own first attempt, ...).
            return Decision(
                State.UNRESOLVED,
                Reason.CONFLICTING_EVIDENCE,
                why="definitive refusal after an attempt that may have been applied",
            )
        return Decision(State.FAILED, why="definitive refusal")
    if verdict is Verdict.KEY_CONFLICT:
        return Decision(State.UNRESOLVED, Reason.KEY_CONFLICT, why="key bound to other arguments")
    if verdict is Verdict.RETRY and replayed_failure:
        return Decision(
            State.UNRESOLVED,
            Reason.OUTCOME_UNKNOWN,
            why="the receiver replays a stored failure for this key: a retry would replay it",
        )
    reason = reason_from_history(maybe_delivered=maybe_delivered, saw_refusal=saw_refusal)
    if verdict is Verdict.IN_PROGRESS:
        if attempts_in_progress >= endpoint.retry.in_progress_budget:
            return Decision(State.UNRESOLVED, Reason.RECEIVER_BUSY, why="in-progress budget spent")
        delay = in_progress_backoff_seconds(endpoint, attempts_in_progress)
    else:
        if attempts_counted >= endpoint.retry.max_attempts:
            return Decision(State.UNRESOLVED, reason, why="attempts spent")
        delay = backoff_seconds(endpoint, attempts_counted)
    # The last moment a retry may be scheduled: a little before the deadline, so the
    # last try starts inside the window however late the claim runs.
    last_ms = deadline_ms - last_try_guard_ms(endpoint)
    if retry_after_seconds is not None:
        if now_ms + retry_after_seconds * 1000 > last_ms:
            return Decision(State.UNRESOLVED, reason, why="Retry-After points past the window")
        delay = max(delay, retry_after_seconds)
    next_at = now_ms + int(delay * 1000)
    if next_at > last_ms:
        # Backoff is shortened to fit the window: one last try inside it is better than
        # none. Once inside the last stretch, no further try is scheduled.
        if now_ms >= last_ms:
            return Decision(State.UNRESOLVED, reason, why="window closed")
        next_at = last_ms
    return Decision(State.PENDING, None, next_at, why="retry scheduled")
