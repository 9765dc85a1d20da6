"""Plain records passed between the store and the dispatcher or operator code."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Required, TypedDict

from outbox.model import Delivery, PolicySnapshot, Reason, State, Verdict


@dataclass(frozen=True, slots=True)
class Claimed:
    """An operation a dispatcher now holds under a lease."""

    pk: int
    tenant: str
    operation_id: str
    endpoint: str
    method: str
    path: str
    #: The operation's stored request headers (never credentials).
    headers: dict[str, str]
    body: str | None
    attempts_counted: int
    attempts_total: int
    maybe_delivered: bool
    saw_refusal: bool
    first_attempt_at: int | None
    window_started_at: int | None
    lease_until: int
    #: When it was enqueued (metrics: enqueue to first attempt, to settled).
    created_at: int | None = None
    #: The W3C trace context active at enqueue, when tracing was on.
    traceparent: str | None = None
    attempts_in_progress: int = 0
    #: The retry window snapshotted at enqueue, if any (see ``policy_window_ms``).
    policy_window_ms: int | None = None
    #: Why the row cannot be sent as stored (a column changed outside outbox), if so:
    #: the dispatcher treats it as unsendable, like an unregistered endpoint.
    problem: str | None = None
    #: The exact bytes of a form or raw body (``body`` is then None).
    body_raw: bytes | None = None
    #: Its own business deadline after enqueue (ms), or None: the endpoint policy's.
    deliver_within_ms: int | None = None

    def body_bytes(self) -> bytes | None:
        """What the dispatcher sends as the body."""
        return self.body.encode("utf-8") if self.body is not None else self.body_raw


@dataclass(frozen=True, slots=True)
class Recovered:
    """An attempt left open by a dispatcher whose lease expired."""

    pk: int
    request_id: str
    number: int
    dispatcher_id: str


@dataclass(frozen=True, slots=True)
class StartedAttempt:
    pk: int
    request_id: str
    number: int
    first_attempt_at: int
    window_started_at: int


@dataclass(frozen=True, slots=True)
class AttemptLease:
    """What the open attempt rows of one batch share: the dispatcher, the lease token
    the batch was claimed under, when the attempts start and until when they hold."""

    owner: str
    token: str
    now_ms: int
    lease_until: int


@dataclass(frozen=True, slots=True)
class StoredResult:
    status: int
    #: The endpoint's evidence headers of the response (credentials redacted).
    headers: dict[str, str]
    body: str | None
    #: None: the body was not read to the end (over the read limit); ``size`` is then
    #: a lower bound.
    sha256: str | None
    size: int
    truncated: bool


@dataclass(frozen=True, slots=True)
class AttemptOutcome:
    """What one attempt observed, plus the operation's next state: written atomically."""

    pk: int
    lease_token: str
    request_id: str
    delivery: Delivery
    counted: bool
    duration_ms: int
    # The operation's transition.
    state: State
    #: When it is due again (epoch ms); None once settled. Required: a pending outcome
    #: without it would never be claimed again.
    next_attempt_at: int | None
    maybe_delivered: bool
    saw_refusal: bool
    # What was observed (an attempt never sent has only its error), and the rest of the
    # transition.
    verdict: Verdict | None = None
    status_code: int | None = None
    receiver_request_id: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    reason: Reason | None = None
    result: StoredResult | None = None
    #: A "still processing" answer: counts towards the in-progress budget.
    in_progress: bool = False
    #: A throttling refusal that said how to pace (``Retry-After`` or rate-limit fields):
    #: a rate limiter's answer, for the throttle, never a failure for the breaker.
    rate_limited: bool = False


@dataclass(frozen=True, slots=True)
class OpenAttempt:
    """An attempt row begun under a lease and not finished, with its operation's flags."""

    pk: int
    lease_token: str
    request_id: str
    maybe_delivered: bool
    saw_refusal: bool


@dataclass(frozen=True, slots=True)
class Settlement:
    """Move a claimed operation to a state without an attempt (window closed, say)."""

    pk: int
    lease_token: str
    state: State
    reason: Reason | None
    #: Why it could not be sent (kept on the operation as ``last_error``), if so.
    last_error: str | None = None
    #: (error class, message, request ID, dispatcher ID) of a not-sent attempt to record
    #: as the evidence of why it never left, if any.
    not_sent: tuple[str, str, str, str] | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Claimed operations to give back without an attempt, due again after ``delay_ms``
    (see ``Store.release``)."""

    pks: Sequence[int]
    delay_ms: int
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimPlan:
    """What a dispatcher decided about a claimed batch, written in the claim's own
    transaction (``Store.claim_and_begin``): nothing of it is visible before the
    attempt rows of ``send`` are committed with it."""

    #: pk -> request ID: an attempt row for each, committed before any is sent.
    send: dict[int, str] = field(default_factory=dict)
    settlements: Sequence[Settlement] = ()
    releases: Sequence[Release] = ()
    #: Policy snapshots for rows enqueued before snapshots existed.
    policies: dict[int, PolicySnapshot] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    """One claim transaction: what it took, what it recovered, what it started."""

    claimed: list[Claimed]
    recovered: list[Recovered]
    plan: ClaimPlan
    started: list[StartedAttempt]
    #: The pks of ``plan.settlements`` that were written.
    settled: set[int]


class ProbeClaimArgs(TypedDict, total=False):
    """The keyword arguments of a claim that begins its attempts, written once
    (``**kw: Unpack[ProbeClaimArgs]``): those of ``Store.claim_probe`` beside
    ``endpoint``; with ``limit`` (:class:`BatchClaimArgs`), those of
    ``Store.claim_and_begin`` and ``Store.record_and_claim`` beside ``outcomes``.
    ``server_clock`` and ``steady_ms`` (default off) mean what they mean to
    ``Store.claim``."""

    owner: Required[str]
    token: Required[str]
    now_ms: Required[int]
    lease_ms: Required[int]
    #: Decides about the claimed rows inside the claim's transaction (pure, no I/O).
    plan: Required[Callable[[list[Claimed]], ClaimPlan]]
    server_clock: bool
    steady_ms: int | None


class BatchClaimArgs(ProbeClaimArgs, total=False):
    """:class:`ProbeClaimArgs` and how many operations a batch claims at most."""

    limit: Required[int]


@dataclass(frozen=True, slots=True)
class InsertResult:
    pk: int
    created: bool
    args_sha256: str


class TxStatus(enum.Enum):
    """What became of a transaction whose COMMIT got no answer (PostgreSQL can tell)."""

    COMMITTED = "committed"
    ABORTED = "aborted"
    IN_PROGRESS = "in progress"
    UNKNOWN = "unknown"
