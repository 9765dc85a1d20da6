"""The vocabulary shared by every module: states, reasons, outcomes and records."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any


class State(enum.StrEnum):
    """Where an operation is in its life."""

    #: Waiting for its next attempt (or its first).
    PENDING = "pending"
    #: Claimed by a dispatcher under a lease; an attempt may be on the wire.
    IN_FLIGHT = "in_flight"
    #: The receiver answered 2xx. Terminal.
    SUCCEEDED = "succeeded"
    #: The receiver refused it definitively (e.g. 400). Terminal.
    FAILED = "failed"
    #: Cancelled by an operator before any attempt was sent. Terminal.
    CANCELLED = "cancelled"
    #: In the reconciliation queue: the outcome is not proven and nothing is sent again
    #: until an operator decides.
    UNRESOLVED = "unresolved"

    @property
    def is_settled(self) -> bool:
        """Terminal or waiting for an operator: the dispatcher will not touch it."""
        return self in TERMINAL_STATES or self is State.UNRESOLVED


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELLED})
#: States a dispatcher claims from (when due): the due index holds only these.
DUE_STATES = frozenset({State.PENDING, State.IN_FLIGHT})
#: Live operations: not terminal (the backlog, and what the status figures count).
LIVE_STATES = DUE_STATES | {State.UNRESOLVED}
#: States that make a later operation with the same ordering key wait: every live one.
BLOCKING_STATES = LIVE_STATES


def state_values(states: frozenset[State]) -> list[str]:
    """A state set's values in declaration order: its one spelling in SQL (the due
    index's WHERE, the SQLite claim's text and the queries all match it)."""
    return [s.value for s in State if s in states]


class Reason(enum.StrEnum):
    """Why an operation sits in the reconciliation queue."""

    #: Some attempt may have reached the receiver (timeout, connection lost after the
    #: request was written, a dispatcher crash mid-attempt, a 5xx that may follow work).
    OUTCOME_UNKNOWN = "outcome_unknown"
    #: Only retryable refusals (503, 429, ...) were seen until attempts or window ran out.
    RETRIES_EXHAUSTED = "retries_exhausted"
    #: Every attempt failed before the request left the machine.
    NEVER_DELIVERED = "never_delivered"
    #: The receiver says this key is bound to other arguments.
    KEY_CONFLICT = "key_conflict"
    #: The receiver kept answering "still processing" (409) until the in-progress budget
    #: was spent: it holds the key, and what it did with it is not known.
    RECEIVER_BUSY = "receiver_busy"
    #: A definitive refusal (4xx) came after an attempt that may have been applied: the
    #: refusal cannot prove that nothing happened.
    CONFLICTING_EVIDENCE = "conflicting_evidence"


class Delivery(enum.StrEnum):
    """What is known about whether an attempt's request reached the receiver."""

    #: A response came back: the receiver saw it.
    SENT = "sent"
    #: It failed before any byte could have left (connection refused, lease check).
    NOT_SENT = "not_sent"
    #: It may or may not have arrived (timeout, connection lost, crash).
    UNKNOWN = "unknown"


class Verdict(enum.StrEnum):
    """How one attempt's result is classified."""

    SUCCESS = "success"
    #: Retry; this attempt counts towards ``max_attempts``.
    RETRY = "retry"
    #: The receiver is still processing the key (409): retry without spending an attempt.
    IN_PROGRESS = "in_progress"
    #: A definitive refusal: the operation failed.
    FAILED = "failed"
    #: The receiver bound the key to other arguments.
    KEY_CONFLICT = "key_conflict"


class ErrorClass(enum.StrEnum):
    """The error classes the library itself writes into the attempt log.

    Other values of ``Attempt.error_class`` are exception class names from the HTTP
    stack (``ConnectError``, ``ReadTimeout``, ...).
    """

    #: The dispatcher's lease ran out before it recorded an outcome (crash, kill, pause).
    LEASE_EXPIRED = "LeaseExpired"
    #: Not sent: too little of the lease was left for a whole attempt.
    LEASE_CHECK_FAILED = "LeaseCheckFailed"
    #: Not sent: the claim's COMMIT was reported failed but took effect; given back.
    CLAIM_COMMIT_LOST = "ClaimCommitLost"
    #: Not sent: the retry window closed between the claim and the send.
    WINDOW_CLOSED_BEFORE_SEND = "WindowClosedBeforeSend"
    #: No complete response within the attempt's total deadline.
    ATTEMPT_DEADLINE_EXCEEDED = "AttemptDeadlineExceeded"
    #: Not sent: the stored path would leave the endpoint's base URL.
    UNSAFE_PATH = "UnsafePath"
    #: Not sent: no endpoint of that name is registered in the dispatcher.
    ENDPOINT_NOT_REGISTERED = "EndpointNotRegistered"
    #: Not sent: the endpoint refuses the stored operation's tenant (it declares no
    #: tenant scope) or its key (``key_pattern``).
    OPERATION_UNSENDABLE = "OperationUnsendable"
    #: The endpoint's own classifier raised; the attempt's outcome is unknown.
    CLASSIFIER_FAILED = "ClassifierFailed"
    #: A 5xx marked as the replay of the result the receiver stored for the key
    #: (``Idempotent-Replayed: true``): no retry can change it.
    STORED_FAILURE_REPLAYED = "StoredFailureReplayed"


#: Statuses of a receiver that refused before doing any work: sending again is safe.
REFUSAL_STATUSES = frozenset({408, 425, 429, 503})
#: Statuses after which the receiver (or a gateway) may have done the work.
MAYBE_APPLIED_STATUSES = frozenset({500, 502, 504})


class StatusFamily(enum.StrEnum):
    """What an HTTP status alone says about whether the receiver did the work.

    The one definition of the families; the body may refine a definitive answer
    (``outbox.classify`` reads it), never a refusal or a maybe-applied one.
    """

    #: Refused before doing any work (408, 425, 429, 503).
    REFUSAL = "refusal"
    #: The receiver, or a gateway in front of it, may have done the work (500, 502, 504
    #: and every other 5xx but 503).
    MAYBE_APPLIED = "maybe_applied"
    #: Any other status: the receiver answered for what it did (or did not do).
    DEFINITIVE = "definitive"

    @classmethod
    def of(cls, status: int) -> StatusFamily:
        if status in REFUSAL_STATUSES:
            return cls.REFUSAL
        if status in MAYBE_APPLIED_STATUSES or status >= 500:
            return cls.MAYBE_APPLIED
        return cls.DEFINITIVE


class Action(enum.StrEnum):
    """Operator actions recorded in the audit trail."""

    RESOLVE = "resolve"
    REQUEUE = "requeue"
    CANCEL = "cancel"
    PURGE = "purge"


def ms_to_datetime(ms: int | None) -> datetime | None:
    """Epoch milliseconds (how the store keeps time) to an aware UTC datetime."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def ms_to_iso(ms: int | None, *, timespec: str = "milliseconds") -> str | None:
    """Epoch milliseconds as ISO 8601 in UTC with a ``Z`` (``timespec`` as for
    :meth:`datetime.isoformat`); None stays None."""
    value = ms_to_datetime(ms)
    return value.isoformat(timespec=timespec).replace("+00:00", "Z") if value else None


@dataclass(frozen=True, slots=True)
class Attempt:
    """One HTTP attempt: the evidence an operator reads."""

    number: int
    request_id: str
    dispatcher_id: str
    started_at_ms: int
    lease_until_ms: int
    finished_at_ms: int | None = None
    delivery: Delivery | None = None  #: None while the attempt is open
    verdict: Verdict | None = None
    status_code: int | None = None
    receiver_request_id: str | None = None
    error_class: str | None = None
    error_message: str | None = None
    duration_ms: int | None = None
    counted: bool = True  #: False for 409 "still processing", which spends no attempt


@dataclass(frozen=True, slots=True)
class Result:
    """What a successful (or definitively failed) attempt got back.

    ``body`` has one shape whatever the size: the parsed JSON (or the text) when the
    whole body fits ``result_body_limit``, else None with ``truncated`` set; ``size`` and
    ``body_sha256`` describe the whole body, except past the endpoint's ``read_limit``
    (reading stopped): then ``body_sha256`` is None and ``size`` is a lower bound.
    """

    status_code: int
    headers: dict[str, str]
    body: Any  #: parsed JSON, or text, or None (empty, binary, or over the limit)
    #: None when the body was not read to the end (it passed the endpoint's
    #: ``read_limit``): ``body_size`` is then a lower bound ("at least"), not the size.
    body_sha256: str | None
    body_size: int
    truncated: bool


@dataclass(frozen=True, slots=True)
class PolicySnapshot:
    """The retry policy an operation lives under, stored on its row.

    Taken from the endpoint at enqueue (or, for rows older than the snapshot, when a
    dispatcher first claims them), so operator tools can judge a requeue from the
    database alone, without the application's code or secrets.
    """

    window_ms: int
    key_retention_ms: int
    margin_ms: int
    max_attempts: int
    in_progress_budget: int

    @property
    def sendable_ms(self) -> int:
        """How long after the first attempt a request may still be sent: the key
        retention less the margin kept before the receiver forgets the key."""
        return self.key_retention_ms - self.margin_ms

    def key_usable_until_ms(self, first_attempt_at_ms: int) -> int:
        """The last moment a request may be sent under the key: the one rule (first
        attempt + key retention - margin) the dispatcher, requeues and probes share."""
        return first_attempt_at_ms + self.sendable_ms

    def key_expires_at_ms(self, first_attempt_at_ms: int) -> int:
        """When the receiver may forget the key (no margin)."""
        return first_attempt_at_ms + self.key_retention_ms


@dataclass(frozen=True, slots=True)
class Operation:
    """A stored intent to call a remote API, as the store sees it now."""

    tenant: str
    operation_id: str
    endpoint: str
    method: str
    path: str
    headers: dict[str, str]
    body: Any  #: the parsed canonical JSON body, or None
    state: State
    reason: Reason | None
    ordering_key: str | None
    attempts_counted: int
    attempts_total: int
    created_at_ms: int
    updated_at_ms: int
    next_attempt_at_ms: int | None
    first_attempt_at_ms: int | None
    window_started_at_ms: int | None
    version: int
    result: Result | None = None
    attempts: tuple[Attempt, ...] = field(default=())
    pk: int = 0
    #: "Still processing" (409) answers received; they have their own budget.
    attempts_in_progress: int = 0
    #: Why no dispatcher can send it now (an endpoint none registered), or None.
    last_error: str | None = None
    #: The policy snapshot; None when unknown (enqueued before snapshots, never claimed).
    policy: PolicySnapshot | None = None
    #: Claim order within its tenant, higher first (``enqueue(priority=...)``).
    priority: int = 0
    #: The scheduled send (epoch ms) it was enqueued with, or None.
    not_before_ms: int | None = None
    #: Its own business deadline after enqueue (``enqueue(deliver_within=...)``, ms),
    #: or None: the endpoint policy's ``deliver_within``.
    deliver_within_ms: int | None = None
    #: The exact bytes of a form or raw body (its content type is the stored
    #: ``content-type`` header); None for a JSON body (``body``) or none.
    body_raw: bytes | None = None

    @property
    def is_settled(self) -> bool:
        return self.state.is_settled

    @property
    def content_type(self) -> str | None:
        """The content type the body is sent with (JSON's default included)."""
        if "content-type" in self.headers:
            return self.headers["content-type"]
        return "application/json" if self.body is not None else None

    @property
    def body_bytes(self) -> bytes | None:
        """The body bytes the dispatcher sends."""
        if self.body_raw is not None:
            return self.body_raw
        if self.body is None:
            return None
        return json.dumps(
            self.body, sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode("utf-8")


class LookupStatus(enum.StrEnum):
    """What the receiver says about an operation key."""

    #: The receiver applied it; the lookup carries its stored result.
    APPLIED = "applied"
    #: The receiver has no record of the key.
    NOT_APPLIED = "not_applied"
    #: Anything else: processing, an error, an answer not understood, no answer.
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class LookupResult:
    """A classified status lookup, with the evidence it rests on."""

    status: LookupStatus
    #: The receiver's stored result of the operation (APPLIED only).
    result: Any = None
    #: Why, in plain words.
    detail: str = ""
    #: Filled in by :func:`lookup_status`: what was asked and what came back.
    method: str | None = None
    path: str | None = None
    http_status: int | None = None
    request_id: str | None = None
    body: str | None = None
    error: str | None = None

    @classmethod
    def applied(cls, result: Any = None, detail: str = "") -> LookupResult:
        return cls(LookupStatus.APPLIED, result, detail or "the receiver applied it")

    @classmethod
    def not_applied(cls, detail: str = "") -> LookupResult:
        return cls(LookupStatus.NOT_APPLIED, None, detail or "the receiver has no record of it")

    @classmethod
    def unknown(cls, detail: str = "") -> LookupResult:
        return cls(LookupStatus.UNKNOWN, None, detail or "the answer does not tell")

    def describe(self) -> str:
        """``GET /operations/x -> 404: the receiver has no record of it``."""
        asked = f"{self.method} {self.path}" if self.method and self.path else "lookup"
        got = str(self.http_status) if self.http_status is not None else (self.error or "-")
        return f"{asked} -> {got}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "result": self.result,
            "detail": self.detail,
            "method": self.method,
            "path": self.path,
            "http_status": self.http_status,
            "request_id": self.request_id,
            "body": self.body,
            "error": self.error,
        }
