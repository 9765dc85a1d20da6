"""Configuration value objects: endpoints, retry policies and dispatcher settings.

All are frozen and keyword-only; units are in the names or in the types.
"""

from __future__ import annotations

import enum
import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias
from urllib.parse import quote, urlsplit

from outbox.errors import ConfigurationError
from outbox.model import LookupResult, PolicySnapshot

if TYPE_CHECKING:
    # Annotations only: reading an outbox (the operator's commands) never needs httpx.
    import httpx

    from outbox.classify import Classification

#: A tenacity wait strategy: a callable taking a ``RetryCallState`` and giving seconds.
WaitStrategy: TypeAlias = Callable[[Any], float]
#: Supplies credential headers at send time; never persisted.
HeaderSupplier: TypeAlias = Callable[[], Mapping[str, str]]
#: Supplies one tenant's credential headers at send time; never persisted.
TenantHeaderSupplier: TypeAlias = Callable[[str], Mapping[str, str]]
#: Overrides classification: takes the response or the exception, returns a
#: Classification, or None to fall back to the default rules.
Classifier: TypeAlias = Callable[["httpx.Response | BaseException"], "Classification | None"]

#: Decoded bytes read at most from one response before reading stops (the body is then
#: recorded as "at least this big"). Overridable per endpoint (``Endpoint.read_limit``).
DEFAULT_READ_LIMIT = 4 * 1024 * 1024

_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _default_wait() -> WaitStrategy:
    from tenacity import wait_random_exponential

    # "Full jitter": a uniformly random wait between 0 and an exponentially growing cap.
    return wait_random_exponential(multiplier=0.5, max=60)


def _default_in_progress_wait() -> WaitStrategy:
    from tenacity import wait_exponential, wait_random_exponential

    # 2^(n-1) s plus up to as much again of jitter: 1-2 s, 2-4 s, 4-8 s, ... capped at
    # 60-120 s. Never below one second, always growing: a receiver that holds a key never
    # sees a stream of requests.
    wait: WaitStrategy = wait_exponential(multiplier=1, max=60) + wait_random_exponential(
        multiplier=1, max=60
    )
    return wait


class TenantScope(enum.StrEnum):
    """How the receiver behind an endpoint keeps tenants apart. Two tenants must never
    share one key at one receiver: an endpoint that carries tenants declares one."""

    #: The tenant is sent in ``Endpoint.tenant_header``; the receiver scopes keys by it.
    HEADER = "header"
    #: The tenant is part of the key: ``<tenant>/<operation ID>`` (the bare operation ID
    #: for the empty tenant). ``/`` never occurs in a tenant or an operation ID, so no two
    #: (tenant, operation ID) pairs give one key.
    KEY_PREFIX = "key_prefix"
    #: Each tenant has its own credentials (``Endpoint.tenant_auth``) and the receiver
    #: scopes keys by account.
    CREDENTIALS = "credentials"


#: Separates the tenant from the operation ID in a key-prefix scoped key.
TENANT_KEY_SEPARATOR = "/"


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
    #: Backoff between "still processing" answers (default: 2^(n-1) s plus as much again
    #: of jitter, capped at 60 s plus jitter; never below one second).
    in_progress_wait: WaitStrategy = field(default_factory=_default_in_progress_wait)
    #: The business deadline of an operation no attempt of which was ever sent
    #: (connection refused, DNS, TLS, circuit open): counted from its enqueue, it bounds
    #: how long delivery is tried before it goes to reconciliation as ``never_delivered``.
    #: The ``window`` starts only at the first attempt that may have been applied.
    deliver_within: timedelta = timedelta(hours=24)

    def __post_init__(self) -> None:
        if self.deliver_within <= timedelta(0):
            raise ConfigurationError(f"deliver_within must be positive, got {self.deliver_within}")
        if self.max_attempts < 1:
            raise ConfigurationError(f"max_attempts must be at least 1, got {self.max_attempts}")
        if self.in_progress_budget < 0:
            raise ConfigurationError(
                f"in_progress_budget must be 0 or more, got {self.in_progress_budget}"
            )
        if self.window <= timedelta(0):
            raise ConfigurationError(f"window must be positive, got {self.window}")
        if not callable(self.wait) or not callable(self.in_progress_wait):
            raise ConfigurationError("wait must be a tenacity wait strategy (a callable)")

    @property
    def window_ms(self) -> int:
        return int(self.window.total_seconds() * 1000)

    @property
    def deliver_within_ms(self) -> int:
        return int(self.deliver_within.total_seconds() * 1000)


@dataclass(frozen=True, kw_only=True)
class CircuitBreaker:
    """When an endpoint's circuit opens and how it is probed (``outbox.dispatch.breaker``).

    The state is shared by every dispatcher of the database (``outbox_endpoints``).
    """

    #: Consecutive failures that are not a success (not sent, 5xx, timeouts) seen by one
    #: dispatcher that open the circuit for the whole fleet.
    failure_threshold: int = 5
    #: The wait before the first half-open probe; doubled per failed probe (with jitter:
    #: between half and all of it), at most ``probe_max_wait``.
    probe_wait: timedelta = timedelta(seconds=1)
    probe_max_wait: timedelta = timedelta(seconds=60)
    #: How often a dispatcher re-reads the fleet's endpoint states (one small SELECT).
    refresh_seconds: float = 1.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ConfigurationError("failure_threshold must be at least 1")
        if self.probe_wait <= timedelta(0) or self.probe_max_wait < self.probe_wait:
            raise ConfigurationError("probe_wait must be positive and at most probe_max_wait")
        if not self.refresh_seconds > 0:
            raise ConfigurationError("refresh_seconds must be positive")


@dataclass(frozen=True, kw_only=True)
class Throttle:
    """How 429 and 503 answers (and a 403 that is a rate limit's, see
    :data:`outbox.classify.RATE_LIMIT_FORBIDDEN`) throttle an endpoint for the whole
    fleet (``outbox.dispatch.limits``): additive increase, multiplicative decrease.

    The first refusals set the fleet's rate from what the receiver says (the IETF
    ``RateLimit-Policy``/``RateLimit`` fields, ``X-RateLimit-*``) or, when it says
    nothing, from the answers this dispatcher got in the last second. Later refusals cut
    it by ``decrease`` (at most once per ``interval``); each ``interval`` without one
    adds ``increase`` of it back while the throttle holds work back; after
    ``release_after`` without a refusal the throttle is lifted. A ``Retry-After`` of at
    least ``pause_at_least`` pauses the endpoint's sends fleet-wide until it passes.

    A refusal under throttle is a refusal before work: it does not spend
    ``max_attempts``, and the operation stays bounded by ``deliver_within``, not by the
    retry window.
    """

    #: The answers that throttle when they are read as refusals before work (a 403
    #: only when its rate-limit fields say the budget is spent, or with ``Retry-After``:
    #: any other 403 is a permanent refusal and throttles nothing).
    statuses: frozenset[int] = frozenset({403, 429, 503})
    #: The rate is multiplied by this on a refusal.
    decrease: float = 0.8
    #: The fraction of the rate added back per ``interval`` without a refusal (at
    #: least ``min_rate``).
    increase: float = 0.02
    #: The least rate a throttle goes down to, in requests per second.
    min_rate: float = 1.0
    #: Refusals that name no rate (and no wait of ``pause_at_least``) throttle only when
    #: they are at least this fraction of one dispatcher's answers over the last second
    #: (and at least 3): a receiver's stray 503s are not a limit, and cutting the rate
    #: for them would only slow everything down.
    tolerance: float = 0.1
    interval: timedelta = timedelta(seconds=1)
    release_after: timedelta = timedelta(seconds=30)
    pause_at_least: timedelta = timedelta(seconds=2)

    def __post_init__(self) -> None:
        if not 0 < self.decrease < 1:
            raise ConfigurationError("throttle decrease must be between 0 and 1")
        if not 0 < self.increase <= 1:
            raise ConfigurationError("throttle increase must be in (0, 1]")
        if not 0 <= self.tolerance < 1:
            raise ConfigurationError("throttle tolerance must be in [0, 1)")
        if not (math.isfinite(self.min_rate) and self.min_rate > 0):
            raise ConfigurationError("throttle min_rate must be positive")
        if self.interval <= timedelta(0) or self.release_after < self.interval:
            raise ConfigurationError("throttle interval must be positive, release_after >= it")
        if not self.statuses or not all(400 <= s < 600 for s in self.statuses):
            raise ConfigurationError("throttle statuses must be 4xx or 5xx statuses")
        object.__setattr__(self, "statuses", frozenset(self.statuses))


#: Classifies a status lookup's (fully read) response.
LookupClassifier: TypeAlias = Callable[["httpx.Response"], LookupResult]


def default_classify(response: httpx.Response) -> LookupResult:
    """The route of :class:`outbox.testing.Receiver` (and receivers shaped like it).

    ``200 {"state": "applied", "response": {"status": S, "body": B}}`` is APPLIED with
    that response when S is 2xx (or absent); a stored non-2xx response is UNKNOWN (the
    receiver did something but answered an error: a person decides). ``404`` is
    NOT_APPLIED. Everything else (``409 {"state": "processing"}``, 5xx, auth errors, a
    body not understood) is UNKNOWN.
    """
    status = response.status_code
    if status == 404:
        return LookupResult.not_applied("the receiver has no record of the key")
    if status != 200:
        return LookupResult.unknown(f"the receiver answered {status}")
    try:
        data = json.loads(response.content)
    except ValueError:
        return LookupResult.unknown("200 with a body that is not JSON")
    if not isinstance(data, dict) or data.get("state") != "applied":
        state = data.get("state") if isinstance(data, dict) else None
        return LookupResult.unknown(f"200 but the state is {state!r}, not 'applied'")
    stored = data.get("response")
    stored_status = stored.get("status") if isinstance(stored, dict) else None
    if isinstance(stored_status, int) and not 200 <= stored_status < 300:
        return LookupResult.unknown(
            f"the receiver holds the key with a stored {stored_status} response; "
            "whether that counts as done is for a person to decide"
        )
    return LookupResult.applied(stored, "the receiver reports the operation applied")


@dataclass(frozen=True, kw_only=True)
class StatusLookup:
    """How to ask an endpoint's receiver about one operation key.

    ``path`` is relative to the endpoint's ``base_url`` and names the operation with
    ``{operation_id}`` (and optionally the tenant with ``{tenant}``); both are
    percent-encoded. ``{operation_id}`` is the key as sent: with
    ``tenant_scope="key_prefix"``, ``<tenant>/<operation ID>``. The endpoint's auth,
    static headers, request ID header and tenant header are sent; the idempotency
    header is not (a lookup is not an operation).
    """

    path: str = "/operations/{operation_id}"
    classify: LookupClassifier = default_classify
    method: str = "GET"
    #: The dispatcher asks as soon as an operation becomes unresolved: an "applied"
    #: answer settles it as succeeded at once; any other answer is left as evidence.
    on_unresolved: bool = True

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or "{operation_id}" not in self.path:
            raise ConfigurationError(
                f"status_lookup path must start with '/' and contain {{operation_id}}, "
                f"got {self.path!r}"
            )
        try:
            self.path.format(operation_id="x", tenant="t")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigurationError(
                f"status_lookup path {self.path!r} may only use {{operation_id}} and "
                f"{{tenant}}: {exc!r}"
            ) from exc
        if not callable(self.classify):
            raise ConfigurationError("status_lookup classify must be a callable")
        if not self.method.isalpha():
            raise ConfigurationError(f"status_lookup method {self.method!r} is not a method")
        object.__setattr__(self, "method", self.method.upper())

    def target(self, operation_id: str, tenant: str = "") -> str:
        return self.path.format(
            operation_id=quote(operation_id, safe=""), tenant=quote(tenant, safe="")
        )


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
    #: When set, the operation's tenant is sent in this header (``TenantScope.HEADER``).
    tenant_header: str | None = None
    #: How the receiver keeps tenants apart; operations with a non-empty tenant are
    #: refused at enqueue on an endpoint that declares none. Setting ``tenant_header``
    #: alone declares ``TenantScope.HEADER``.
    tenant_scope: TenantScope | None = None
    #: Per-tenant credentials, applied at send time after ``auth``: required by
    #: ``TenantScope.CREDENTIALS``; takes the tenant, returns headers; never persisted.
    tenant_auth: TenantHeaderSupplier | None = None
    #: Credentials, applied at send time: an ``httpx.Auth`` or a callable returning headers.
    auth: httpx.Auth | HeaderSupplier | None = None
    #: Static, non-secret headers sent with every request to this endpoint.
    headers: Mapping[str, str] = field(default_factory=dict)
    #: Overrides the default classification of responses and exceptions.
    classify: Classifier | None = None
    #: A status the receiver answers replays with, besides 2xx (some middlewares replay
    #: with 409 and the original body). Such an answer whose body does not say "in
    #: progress" or name a conflict is a replay: success, with that body as the result.
    replay_status: int | None = None
    #: A regular expression the receiver's keys must match whole (say
    #: ``[A-Za-z0-9_-]{1,64}``); enqueue refuses an operation whose key would not.
    key_pattern: str | None = None
    #: Response headers kept as evidence (the receiver's own request ID, replay markers).
    evidence_headers: tuple[str, ...] = (
        "x-request-id",
        "request-id",
        "x-amzn-requestid",
        "idempotent-replayed",
        "idempotency-replayed",
        "x-idempotent-replayed",
        "idempotency-key-retention",
        "content-type",
    )
    #: Bytes of a response body kept as evidence; beyond it only a hash is kept.
    result_body_limit: int = 64 * 1024
    #: Decoded bytes of a response read at most (hashed as they stream; only
    #: ``result_body_limit`` of them kept). Past it reading stops and the body is
    #: recorded as at least this big, without a hash: a hostile receiver's endless or
    #: compressed-bomb body costs neither memory nor more than this much work.
    read_limit: int = DEFAULT_READ_LIMIT
    #: Maximum pooled connections to this endpoint.
    max_connections: int = 100
    #: Marks a staging or test receiver the conformance checker may send probes to.
    probe_safe: bool = False
    #: How to ask the receiver whether an operation was applied (``outbox.wire.lookup``).
    status_lookup: StatusLookup | None = None
    #: At most this many operations of one tenant in flight to this endpoint at once,
    #: counted by every dispatcher of the database together; None: no such limit.
    tenant_max_in_flight: int | None = None
    #: The fleet-wide circuit breaker of this endpoint; None: never opens (pause still works).
    circuit_breaker: CircuitBreaker | None = field(default_factory=CircuitBreaker)
    #: At most this many requests per second to this endpoint, sent by every dispatcher
    #: of the database together (``outbox.dispatch.limits``); None: no declared limit.
    rate_limit: float | None = None
    #: At most this many requests to this endpoint on the wire at once, counted by every
    #: dispatcher of the database together; None: no declared limit.
    max_in_flight: int | None = None
    #: How 429/503 answers slow the whole fleet down when the receiver refuses; None:
    #: they do not (each refusal is retried by the policy alone, and counted).
    throttle: Throttle | None = field(default_factory=Throttle)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigurationError(
                f"endpoint name {self.name!r} must be 1-64 characters of [A-Za-z0-9._-]"
            )
        parts = urlsplit(self.base_url)
        if "@" in parts.netloc:
            # Userinfo would be exported in span attributes and logs, and aiohttp never
            # sends it: every attempt would fail as "may have reached the receiver".
            raise ConfigurationError(
                f"endpoint {self.name!r}: base_url must not carry credentials "
                "(user:password@); pass them with auth= (for example "
                "auth=httpx.BasicAuth(user, password))"
            )
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
        if self.read_limit < 1:
            raise ConfigurationError(f"endpoint {self.name!r}: read_limit must be >= 1")
        rate = self.rate_limit
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                                 or not math.isfinite(rate) or rate <= 0):  # fmt: skip
            raise ConfigurationError(
                f"endpoint {self.name!r}: rate_limit must be a positive number of "
                "requests per second, or None"
            )
        cap = self.max_in_flight
        if cap is not None and (type(cap) is not int or cap < 1):
            raise ConfigurationError(
                f"endpoint {self.name!r}: max_in_flight must be an int >= 1 or None"
            )
        cap = self.tenant_max_in_flight
        if cap is not None and (type(cap) is not int or cap < 1):
            raise ConfigurationError(
                f"endpoint {self.name!r}: tenant_max_in_flight must be an int >= 1 or None"
            )
        scope = self.tenant_scope
        if scope is not None:
            try:
                scope = TenantScope(scope)
            except ValueError:
                raise ConfigurationError(
                    f"endpoint {self.name!r}: tenant_scope must be one of "
                    f"{[s.value for s in TenantScope]}, got {scope!r}"
                ) from None
            object.__setattr__(self, "tenant_scope", scope)
        if scope is None and self.tenant_header is not None:
            object.__setattr__(self, "tenant_scope", TenantScope.HEADER)
        elif scope is TenantScope.HEADER and self.tenant_header is None:
            raise ConfigurationError(
                f"endpoint {self.name!r}: tenant_scope='header' needs tenant_header"
            )
        if scope is TenantScope.CREDENTIALS and self.tenant_auth is None:
            raise ConfigurationError(
                f"endpoint {self.name!r}: tenant_scope='credentials' needs tenant_auth, a "
                "callable giving each tenant's own credential headers"
            )
        if self.tenant_auth is not None and scope is not TenantScope.CREDENTIALS:
            raise ConfigurationError(
                f"endpoint {self.name!r}: tenant_auth is only used with tenant_scope='credentials'"
            )
        if self.replay_status is not None and not 400 <= self.replay_status < 500:
            raise ConfigurationError(
                f"endpoint {self.name!r}: replay_status must be a 4xx status (2xx replays "
                f"need no declaration), got {self.replay_status}"
            )
        if self.key_pattern is not None:
            try:
                re.compile(self.key_pattern)
            except re.error as exc:
                raise ConfigurationError(
                    f"endpoint {self.name!r}: key_pattern is not a regular expression: {exc}"
                ) from exc

    def wire_key(self, tenant: str, operation_id: str) -> str:
        """The idempotency key sent for (tenant, operation ID)."""
        if tenant and self.tenant_scope is TenantScope.KEY_PREFIX:
            return f"{tenant}{TENANT_KEY_SEPARATOR}{operation_id}"
        return operation_id

    def tenant_problem(self, tenant: str, operation_id: str) -> str | None:
        """Why an operation of ``tenant`` may not go to this endpoint, or None."""
        if tenant and self.tenant_scope is None:
            return (
                f"endpoint {self.name!r} declares no tenant scope, so tenant {tenant!r} would "
                "share idempotency keys with every other tenant at the receiver (one effect "
                "for two intents). Declare how the receiver keeps tenants apart: "
                "Endpoint(tenant_header='X-Tenant') if it scopes keys by a header, "
                "Endpoint(tenant_scope='key_prefix') to send '<tenant>/<operation ID>' as "
                "the key, or Endpoint(tenant_scope='credentials', tenant_auth=...) if each "
                "tenant has its own credentials"
            )
        if self.key_pattern is not None:
            key = self.wire_key(tenant, operation_id)
            if not re.fullmatch(self.key_pattern, key):
                return (
                    f"endpoint {self.name!r} accepts keys matching {self.key_pattern!r}; "
                    f"this operation's key {key!r} does not"
                )
        return None

    @functools.cached_property
    def margin(self) -> timedelta:
        # Cached, as policy_snapshot() and _sendable_ms below: a function of fields that
        # never change (frozen, of immutable values); dataclasses.replace makes a new one.
        if self.key_retention_margin is not None:
            return self.key_retention_margin
        return min(timedelta(minutes=5), self.key_retention / 10)

    @functools.cached_property
    def _policy(self) -> PolicySnapshot:
        return PolicySnapshot(
            window_ms=self.retry.window_ms,
            key_retention_ms=int(self.key_retention.total_seconds() * 1000),
            margin_ms=int(self.margin.total_seconds() * 1000),
            max_attempts=self.retry.max_attempts,
            in_progress_budget=self.retry.in_progress_budget,
        )

    @functools.cached_property
    def _window_ms(self) -> int:
        return self.retry.window_ms

    @functools.cached_property
    def _sendable_ms(self) -> int:
        return self._policy.sendable_ms

    def policy_snapshot(self) -> PolicySnapshot:
        """What an operation row keeps of this endpoint's policy (see PolicySnapshot)."""
        return self._policy

    @property
    def origin(self) -> str:
        parts = urlsplit(self.base_url)
        return f"{parts.scheme}://{parts.netloc}"

    def deadline_ms(self, *, window_started_at_ms: int, first_attempt_at_ms: int) -> int:
        """The last moment an attempt may start: the window, capped by key retention."""
        # = min(window start + retry.window_ms,
        #       policy_snapshot().key_usable_until_ms(first attempt))
        by_window = window_started_at_ms + self._window_ms
        by_key = first_attempt_at_ms + self._sendable_ms
        return by_window if by_window < by_key else by_key


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
    #: PostgreSQL: a direct connection URL used only for ``LISTEN`` (the dispatcher's other
    #: connections may go through pgbouncer in transaction pooling, where LISTEN cannot
    #: work). None: listen on the store's own URL. If LISTEN cannot work there (a NOTIFY
    #: to itself does not arrive within a second at start-up) the dispatcher logs one
    #: ``listen_unavailable`` warning naming this setting and polls.
    listen_url: str | None = None
    #: Identifies this dispatcher in attempts and leases (default: host:pid:random).
    dispatcher_id: str | None = None
    #: How often a running dispatcher writes its heartbeat row (``outbox status``).
    heartbeat_seconds: float = 5.0
    #: After a stop is requested (SIGTERM), a database call that does not return within
    #: this many seconds is given up on: the dispatcher logs ``dispatcher_stop_timed_out``
    #: and stops with an error, leaving its leases to expire (safe). Requests on the wire
    #: still finish within their own deadlines.
    stop_timeout_seconds: float = 30.0

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
        if not self.stop_timeout_seconds > 0:
            raise ConfigurationError("stop_timeout_seconds must be positive")

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
