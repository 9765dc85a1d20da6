"""Configuration value objects: endpoints, retry policies and dispatcher settings.

All are frozen and keyword-only; units are in the names or in the types.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import urlsplit

import httpx
from tenacity import wait_random_exponential

from outbox.errors import ConfigurationError

if TYPE_CHECKING:
    from outbox.lookup import StatusLookup
    from outbox.transport import Classification

#: A tenacity wait strategy: a callable taking a ``RetryCallState`` and giving seconds.
WaitStrategy: TypeAlias = Callable[[Any], float]
#: Supplies credential headers at send time; never persisted.
HeaderSupplier: TypeAlias = Callable[[], Mapping[str, str]]
#: Overrides classification: takes the response or the exception, returns a
#: Classification, or None to fall back to the default rules.
Classifier: TypeAlias = Callable[["httpx.Response | BaseException"], "Classification | None"]

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _default_wait() -> WaitStrategy:
    # "Full jitter": a uniformly random wait between 0 and an exponentially growing cap.
    return wait_random_exponential(multiplier=0.5, max=60)


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    """How long and how often an operation is retried while its outcome is unknown.

    ``wait`` takes any tenacity wait strategy; it is evaluated against the attempt
    history stored in the database, so a restart neither resets nor repeats backoff.
    """

    #: Attempts that may be made in all (409 "still processing" answers do not count).
    max_attempts: int = 8
    #: How long after the first attempt retries may still be sent.
    window: timedelta = timedelta(hours=1)
    #: Backoff between attempts (default: exponential with full jitter, capped at 60 s).
    wait: WaitStrategy = field(default_factory=_default_wait)
    #: "Still processing" answers (409 in progress) tolerated before the operation goes
    #: to reconciliation. They do not spend ``max_attempts``; this is their own budget.
    in_progress_budget: int = 10

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.in_progress_budget < 0:
            raise ConfigurationError(
                f"in_progress_budget must be 0 or more, got {self.in_progress_budget}"
            )
        if self.window <= timedelta(0):
            raise ConfigurationError(f"window must be positive, got {self.window}")
        if not callable(self.wait):
            raise ConfigurationError("wait must be a tenacity wait strategy (a callable)")

    @property
    def window_ms(self) -> int:
        return int(self.window.total_seconds() * 1000)


@dataclass(frozen=True, kw_only=True)
class Endpoint:
    """A remote API the dispatcher may call. Rows name an endpoint; the URL lives here."""

    name: str
    base_url: str
    #: Total deadline of one attempt in seconds: connect + write + read, enforced even
    #: against a receiver that drips one byte at a time.
    timeout: float = 10.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    #: How long the receiver remembers an idempotency key. The retry window must end
    #: before it, with a margin: a resend after the receiver forgot the key is a new
    #: operation, not a retry.
    key_retention: timedelta = timedelta(hours=24)
    #: Kept between the end of the retry window and the receiver forgetting the key.
    #: Default: a tenth of ``key_retention``, at most five minutes.
    key_retention_margin: timedelta | None = None
    idempotency_header: str = "Idempotency-Key"
    request_id_header: str = "X-Request-ID"
    #: When set, the operation's tenant is sent in this header.
    tenant_header: str | None = None
    #: Credentials, applied at send time: an ``httpx.Auth`` or a callable returning headers.
    auth: httpx.Auth | HeaderSupplier | None = None
    #: Static, non-secret headers sent with every request to this endpoint.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Overrides the default classification of responses and exceptions.
    classify: Classifier | None = None
    #: Response headers kept as evidence (the receiver's own request ID, mostly).
    evidence_headers: tuple[str, ...] = (
        "x-request-id",
        "request-id",
        "x-amzn-requestid",
        "idempotent-replayed",
        "content-type",
    )
    #: Bytes of a response body kept as evidence; beyond it only a hash is kept.
    result_body_limit: int = 64 * 1024
    #: Maximum pooled connections to this endpoint.
    max_connections: int = 100
    #: Marks a staging or test receiver the conformance checker may send probes to.
    probe_safe: bool = False
    #: How to ask the receiver whether an operation was applied (``outbox.lookup``).
    status_lookup: StatusLookup | None = None

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigurationError(
                f"endpoint name {self.name!r} must be 1-64 characters of [A-Za-z0-9._-]"
            )
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(
                f"endpoint {self.name!r}: base_url must be an absolute http(s) URL, "
                f"got {self.base_url!r}"
            )
        if parts.query or parts.fragment:
            raise ConfigurationError(
                f"endpoint {self.name!r}: base_url must not carry a query or fragment"
            )
        if not math.isfinite(self.timeout) or self.timeout <= 0:
            raise ConfigurationError(f"endpoint {self.name!r}: timeout must be positive")
        if self.key_retention <= timedelta(0):
            raise ConfigurationError(f"endpoint {self.name!r}: key_retention must be positive")
        if self.retry.window + self.margin > self.key_retention:
            raise ConfigurationError(
                f"endpoint {self.name!r}: the retry window ({self.retry.window}) plus the "
                f"safety margin ({self.margin}) exceeds key_retention ({self.key_retention}); "
                "retries after the receiver forgets the key would be new operations"
            )
        if self.result_body_limit < 0:
            raise ConfigurationError(f"endpoint {self.name!r}: result_body_limit must be >= 0")

    @property
    def margin(self) -> timedelta:
        if self.key_retention_margin is not None:
            return self.key_retention_margin
        return min(timedelta(minutes=5), self.key_retention / 10)

    @property
    def origin(self) -> str:
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.netloc}"

    def deadline_ms(self, *, window_started_at_ms: int, first_attempt_at_ms: int) -> int:
        """The last moment an attempt may start: the window, capped by key retention."""
        by_window = window_started_at_ms + self.retry.window_ms
        usable = self.key_retention - self.margin
        by_key = first_attempt_at_ms + int(usable.total_seconds() * 1000)
        return min(by_window, by_key)


@dataclass(frozen=True, kw_only=True)
class DispatcherSettings:
    """How a dispatcher claims and sends."""

    #: Requests on the wire at once.
    concurrency: int = 32
    #: Operations claimed per claim transaction.
    batch_size: int = 100
    #: How long a claim is valid; must exceed the longest attempt timeout plus margins.
    #: None: twice the longest endpoint timeout plus 10 seconds, at least 30 seconds.
    lease_seconds: float | None = None
    #: A request is sent only if the lease has at least timeout + this much left.
    lease_margin_seconds: float = 2.0
    #: The safety-net poll: the longest an idle dispatcher waits before claiming again.
    #: It also wakes for the earliest due time it knows of (a scheduled retry, an
    #: expiring lease), and at once when work is enqueued (``wake_on_change``).
    idle_poll_seconds: float = 5.0
    #: Wake when work is enqueued: PostgreSQL LISTEN/NOTIFY; SQLite in-process signals
    #: and a ``PRAGMA data_version`` check. False: poll only (set a short poll then).
    wake_on_change: bool = True
    #: SQLite: how often the ``data_version`` check runs (enqueues by other processes).
    change_check_seconds: float = 0.005
    #: Identifies this dispatcher in attempts and leases (default: host:pid:random).
    dispatcher_id: str | None = None
    #: How often a running dispatcher writes its heartbeat row (``outbox status``).
    heartbeat_seconds: float = 5.0

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigurationError("concurrency must be at least 1")
        if self.batch_size < 1:
            raise ConfigurationError("batch_size must be at least 1")
        if self.lease_seconds is not None and self.lease_seconds <= 0:
            raise ConfigurationError("lease_seconds must be positive")
        if not self.heartbeat_seconds > 0:
            raise ConfigurationError("heartbeat_seconds must be positive")
        if not self.idle_poll_seconds > 0 or not self.change_check_seconds > 0:
            raise ConfigurationError("idle_poll_seconds and change_check_seconds must be positive")

    def lease_for(self, endpoints: Mapping[str, Endpoint]) -> float:
        longest = max((e.timeout for e in endpoints.values()), default=10.0)
        needed = longest + 2 * self.lease_margin_seconds
        if self.lease_seconds is None:
            return max(30.0, 2 * longest + 10.0)
        if self.lease_seconds <= needed:
            raise ConfigurationError(
                f"lease_seconds ({self.lease_seconds}) must exceed the longest endpoint "
                f"timeout ({longest}) plus twice the lease margin"
            )
        return self.lease_seconds
