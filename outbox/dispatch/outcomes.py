"""What a dispatcher decides and records, without I/O: which claimed operations to send,
settle or give back (``plan_claimed``), one attempt's outcome (the policy reads the
answer and the history on the row), the settlement of an operation no dispatcher can
send, and the summary of a run."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from outbox.config import Endpoint, RetryPolicy
from outbox.dispatch.policy import decide, reason_from_history
from outbox.model import Delivery, ErrorClass, State, Verdict
from outbox.store.records import (
    AttemptOutcome,
    Claimed,
    ClaimPlan,
    OpenAttempt,
    Release,
    Settlement,
    StartedAttempt,
)
from outbox.wire.transport import AttemptResult

#: The window of an operation whose policy was never snapshotted: the default policy's.
DEFAULT_WINDOW_MS = RetryPolicy().window_ms


@dataclass
class DispatchSummary:
    """What a dispatcher did: counts of operations and attempts."""

    claimed: int = 0
    attempts: int = 0
    succeeded: int = 0
    failed: int = 0
    retry_scheduled: int = 0
    unresolved: int = 0
    recovered: int = 0
    fenced: int = 0
    lease_check_failed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def count(self, event: str, reason: Any = None) -> None:
        """Count one written outcome by its log event (see :func:`transition_event`)."""
        name = _COUNTED[event]
        setattr(self, name, getattr(self, name) + 1)
        if event == "operation_unresolved":
            key = str(reason)
            self.by_reason[key] = self.by_reason.get(key, 0) + 1


#: The summary field each transition event counts in.
_COUNTED = {
    "write_fenced": "fenced",
    "operation_succeeded": "succeeded",
    "operation_failed": "failed",
    "operation_unresolved": "unresolved",
    "retry_scheduled": "retry_scheduled",
}


@dataclass(frozen=True, slots=True)
class Work:
    """One claimed operation on its way: the claim, its endpoint, its attempt row."""

    claimed: Claimed
    endpoint: Endpoint
    started: StartedAttempt
    token: str
    claimed_mono: float
    lease_seconds: float
    #: The instrumentation's handle on the claim batch (a trace span, say).
    batch: Any = None


def default_dispatcher_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


#: Attempts given back before sending: not a retry of the operation.
NOT_TRIED = frozenset({
    ErrorClass.LEASE_CHECK_FAILED.value,
    ErrorClass.WINDOW_CLOSED_BEFORE_SEND.value,
    ErrorClass.CLAIM_COMMIT_LOST.value,
})


def unsendable_window_end(c: Claimed, now: int) -> int:
    """An operation no dispatcher can send lives as long as its window: from its
    window's start (the first claim that could not send it, if no attempt was ever
    made) for the snapshotted window, or the default policy's hour."""
    start = c.window_started_at if c.window_started_at is not None else now
    return start + (c.policy_window_ms or DEFAULT_WINDOW_MS)


def unsendable_settlement(
    c: Claimed, token: str, now: int, problem: str, *, registered: bool, dispatcher_id: str
) -> Settlement | None:
    """The settlement of an operation a dispatcher must not send, once its window has
    closed; None while it is open (it is put back, with the reason kept)."""
    if now <= unsendable_window_end(c, now):
        return None
    reason = reason_from_history(maybe_delivered=c.maybe_delivered, saw_refusal=c.saw_refusal)
    error_class = ErrorClass.OPERATION_UNSENDABLE
    if not registered:
        error_class = ErrorClass.ENDPOINT_NOT_REGISTERED
    return Settlement(
        c.pk,
        token,
        State.UNRESOLVED,
        reason,
        last_error=f"{problem}; its window closed",
        not_sent=(
            error_class.value,
            f"not sent: {problem}",
            str(uuid.uuid4()),
            dispatcher_id,
        ),
    )


def never_sent(c: Claimed) -> bool:
    """No attempt of the operation was ever sent: it carries no duplicate risk."""
    return not c.maybe_delivered and not c.saw_refusal


def business_deadline_ms(c: Claimed, endpoint: Endpoint, now_ms: int) -> int:
    """The last moment a never-sent operation may still be tried: its enqueue plus its
    own ``enqueue(deliver_within=...)``, or else the endpoint policy's ``deliver_within``."""
    within = c.deliver_within_ms
    if within is None:
        within = endpoint.retry.deliver_within_ms
    return (c.created_at if c.created_at is not None else now_ms) + within


def send_deadline_ms(c: Claimed, endpoint: Endpoint, started: StartedAttempt, now_ms: int) -> int:
    """The last moment this attempt may start: the business deadline while the operation
    was never sent, else its window (started at its first maybe-applied attempt)."""
    if never_sent(c):
        return business_deadline_ms(c, endpoint, now_ms)
    return endpoint.deadline_ms(
        window_started_at_ms=started.window_started_at,
        first_attempt_at_ms=started.first_attempt_at,
    )


def not_sent_outcome(
    work: Work, error_class: ErrorClass, message: str, now_ms: int
) -> AttemptOutcome:
    """A request given back before it left: not sent, not counted, due now."""
    c = work.claimed
    begun = OpenAttempt(c.pk, work.token, work.started.request_id, c.maybe_delivered,
                        c.saw_refusal)  # fmt: skip
    return given_back(begun, error_class, message, now_ms)


def given_back(
    begun: OpenAttempt, error_class: ErrorClass, message: str, now_ms: int
) -> AttemptOutcome:
    """The outcome of an attempt begun and never sent: not counted, due again now."""
    return AttemptOutcome(
        pk=begun.pk, lease_token=begun.lease_token, request_id=begun.request_id,
        delivery=Delivery.NOT_SENT, counted=False, duration_ms=0, state=State.PENDING,
        maybe_delivered=begun.maybe_delivered, saw_refusal=begun.saw_refusal,
        error_class=error_class.value, error_message=message, next_attempt_at=now_ms,
    )  # fmt: skip


def throttles(endpoint: Endpoint, result: AttemptResult) -> bool:
    """Is this answer a throttling refusal: a status of the endpoint's throttle (429,
    503), read as a retryable refusal before work?"""
    throttle = endpoint.throttle
    cls = result.classification
    return (
        throttle is not None
        and result.status_code in throttle.statuses
        and cls.verdict is Verdict.RETRY
        and not cls.maybe_applied
    )


def paces(endpoint: Endpoint, result: AttemptResult) -> bool:
    """Is this a throttling refusal that says how to pace (a ``Retry-After``, or
    rate-limit fields whose budget is used up): a rate limiter at work, not a receiver
    that is down? A bare 503 is not: during an outage it is what a load balancer
    answers. Nor is a 503 whose rate-limit fields still show budget left: an API
    gateway stamps those on every answer, its dead upstream's too."""
    cls = result.classification
    hint = cls.rate_hint
    told = cls.retry_after_seconds is not None or (hint is not None and hint.exhausted)
    return told and throttles(endpoint, result)


def attempt_outcome(
    work: Work, result: AttemptResult, now_ms: int, *, known_down: bool = False
) -> AttemptOutcome:
    """The outcome of a request that was sent (or may have been): the policy decides
    the operation's next state from the answer and the history on its row. A request
    proven not sent while its endpoint is ``known_down`` (circuit not closed, a probe)
    does not spend ``max_attempts``; an operation never sent is bounded by its business
    deadline, not by the window. A throttling refusal (``Endpoint.throttle``: 429, 503, 403)
    is a refusal before work under the fleet's throttle: like a request not sent, it
    spends no attempt and leaves the operation bounded by its business deadline."""
    c, endpoint, started = work.claimed, work.endpoint, work.started
    cls = result.classification
    in_progress = cls.verdict is Verdict.IN_PROGRESS
    not_sent = cls.delivery is Delivery.NOT_SENT
    throttled = throttles(endpoint, result)
    counted = not in_progress and not (not_sent and known_down) and not throttled
    maybe = c.maybe_delivered or cls.maybe_applied or cls.delivery is Delivery.UNKNOWN
    refused = c.saw_refusal or (cls.refused and not throttled)
    now = now_ms
    if not maybe and not refused:
        deadline = business_deadline_ms(c, endpoint, now)
    else:
        deadline = endpoint.deadline_ms(
            window_started_at_ms=started.window_started_at,
            first_attempt_at_ms=started.first_attempt_at,
        )
        declared = result.declared_retention_ms
        if declared is not None:
            # The receiver says how long it keeps keys (classify.RETENTION_HEADER): a
            # retry must start before it forgets this one, whatever key_retention says.
            by_declared = started.first_attempt_at + declared - endpoint.policy_snapshot().margin_ms
            deadline = min(deadline, by_declared)
    decision = decide(
        endpoint=endpoint,
        verdict=cls.verdict,
        attempts_counted=c.attempts_counted + (1 if counted else 0),
        maybe_delivered=maybe,
        saw_refusal=refused,
        retry_after_seconds=cls.retry_after_seconds,
        deadline_ms=deadline,
        now_ms=now,
        attempts_in_progress=c.attempts_in_progress + (1 if in_progress else 0),
        replayed_failure=cls.replayed_failure,
    )
    return AttemptOutcome(
        pk=c.pk,
        lease_token=work.token,
        request_id=started.request_id,
        delivery=cls.delivery,
        verdict=cls.verdict,
        counted=counted,
        status_code=result.status_code,
        receiver_request_id=result.receiver_request_id,
        error_class=result.error_class,
        error_message=result.error_message,
        duration_ms=result.duration_ms,
        state=decision.state,
        reason=decision.reason,
        next_attempt_at=decision.next_attempt_at_ms,
        maybe_delivered=maybe,
        saw_refusal=refused,
        result=result.result,
        in_progress=in_progress,
        rate_limited=paces(endpoint, result),
    )


def transition_event(
    out: AttemptOutcome, *, applied: bool
) -> tuple[str, str, dict[str, Any]] | None:
    """How a written outcome is logged and counted: (level, event, fields); None for a
    request given back before it was tried (not a retry of the operation)."""
    if not applied:
        return "warning", "write_fenced", {"detail": "another dispatcher holds the lease; dropped"}
    if out.state is State.SUCCEEDED:
        return "info", "operation_succeeded", {"status": out.status_code}
    if out.state is State.FAILED:
        return "info", "operation_failed", {"status": out.status_code}
    if out.state is State.UNRESOLVED:
        return "warning", "operation_unresolved", {"reason": out.reason}
    if out.delivery is not Delivery.NOT_SENT or out.error_class not in NOT_TRIED:
        return "info", "retry_scheduled", {"next_attempt_at": out.next_attempt_at}
    return None


#: An operation naming an endpoint this dispatcher does not know is put back for this long.
UNKNOWN_ENDPOINT_DELAY_MS = 60_000


def plan_claimed(
    claimed: list[Claimed],
    *,
    endpoints: Mapping[str, Endpoint],
    dispatcher_id: str,
    token: str,
    now: int,
    refused: list[tuple[Claimed, str]],
) -> ClaimPlan:
    """Decide about a claimed batch, inside the claim's transaction (on the database
    thread: no I/O, no logging; the operations this dispatcher must not send are added
    to ``refused`` for the log). Every check that decides whether a request may go out
    happens here, before its attempt row is written."""
    send: dict[int, str] = {}
    settlements: list[Settlement] = []
    unsendable: dict[str, list[Claimed]] = {}
    for c in claimed:
        endpoint = endpoints.get(c.endpoint)
        problem = (
            f"endpoint {c.endpoint!r} is not registered in dispatcher {dispatcher_id} "
            f"(registered: {sorted(endpoints)}); never sent anywhere"
            if endpoint is None
            else c.problem or endpoint.tenant_problem(c.tenant, c.operation_id)
        )
        if problem is not None:
            refused.append((c, problem))
            settlement = unsendable_settlement(
                c, token, now, problem, registered=endpoint is not None,
                dispatcher_id=dispatcher_id,
            )  # fmt: skip
            if settlement is not None:
                settlements.append(settlement)
            else:
                unsendable.setdefault(problem, []).append(c)
            continue
        assert endpoint is not None
        deadline = (
            business_deadline_ms(c, endpoint, now)
            if never_sent(c)
            else endpoint.deadline_ms(
                window_started_at_ms=c.window_started_at or now,
                first_attempt_at_ms=c.first_attempt_at or now,
            )
        )
        if c.attempts_total and (
            now > deadline or c.attempts_counted >= endpoint.retry.max_attempts
        ):
            reason = reason_from_history(
                maybe_delivered=c.maybe_delivered, saw_refusal=c.saw_refusal
            )
            settlements.append(Settlement(c.pk, token, State.UNRESOLVED, reason))
            continue
        send[c.pk] = str(uuid.uuid4())
    releases = [
        Release(
            pks=[c.pk for c in held],
            delay_ms=max(1, min(UNKNOWN_ENDPOINT_DELAY_MS,
                                max(unsendable_window_end(c, now) for c in held) - now + 1)),
            last_error=problem,
        )
        for problem, held in unsendable.items()
    ]  # fmt: skip
    # Rows enqueued before policy snapshots get this endpoint's policy now, so operator
    # tools can judge them without the application.
    policies = {
        c.pk: endpoints[c.endpoint].policy_snapshot()
        for c in claimed
        if c.policy_window_ms is None and c.endpoint in endpoints
    }
    return ClaimPlan(send=send, settlements=settlements, releases=releases, policies=policies)
