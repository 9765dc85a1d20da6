"""The receiver's rate limit: a token bucket shared by every request of the receiver.

A receiver in this mode admits ``rate`` requests per second (with bursts of up to
``burst``, one second's worth by default) and answers the rest ``429`` (or ``503``, as
some load balancers do, or ``403``, as GitHub's REST API does) with ``Retry-After``
before any work, as API gateways do. It may also say how it limits:

==================  ===============================================================
``headers``         what a refusal carries besides ``Retry-After``
==================  ===============================================================
``none``            nothing more (the receiver that only says "come back later")
``ietf``            ``RateLimit-Policy: "default";q=R;w=1`` and
                    ``RateLimit: "default";r=0;t=S`` (the IETF httpapi draft)
``x-ratelimit``     ``X-RateLimit-Limit: R``, ``X-RateLimit-Remaining: 0`` and
                    ``X-RateLimit-Reset: S`` (delta seconds, GitHub's family)
``github``          as ``x-ratelimit``, but ``X-RateLimit-Reset`` is the epoch second
                    the budget comes back, with ``X-RateLimit-Used`` and
                    ``X-RateLimit-Resource: core`` (GitHub's REST API)
==================  ===============================================================

Every request is still logged (outcome ``rate_limited``), so a test reads what the
receiver saw, second by second, from its own request log.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

HEADER_STYLES = ("none", "ietf", "x-ratelimit", "github")
#: The statuses a rate-limited receiver may refuse with.
REFUSAL_STATUSES = (429, 503, 403)


@dataclass(frozen=True, slots=True)
class RateLimitSpec:
    """What a rate-limited receiver admits, and how it says so."""

    rate: float
    burst: float | None = None
    retry_after: str | None = "1"
    headers: str = "none"
    #: The status of a refusal: 429, 503 (a rate limiter that answers "unavailable"), or
    #: 403 (GitHub's "forbidden" with the budget's fields at 0).
    status: int = 429

    def __post_init__(self) -> None:
        if not math.isfinite(self.rate) or self.rate <= 0:
            raise ValueError("rate_limit: rate must be a positive number of requests/s")
        if self.burst is not None and (not math.isfinite(self.burst) or self.burst < 1):
            raise ValueError("rate_limit: burst must be >= 1")
        if self.headers not in HEADER_STYLES:
            raise ValueError(f"rate_limit: headers must be one of {HEADER_STYLES}")
        if self.status not in REFUSAL_STATUSES:
            raise ValueError(f"rate_limit: status must be one of {REFUSAL_STATUSES}")

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RateLimitSpec:
        rate, burst = spec.get("rate"), spec.get("burst")
        retry_after, headers = spec.get("retry_after", "1"), spec.get("headers", "none")
        if not isinstance(rate, int | float) or isinstance(rate, bool):
            raise ValueError("rate_limit needs a numeric rate")
        if burst is not None and (not isinstance(burst, int | float) or isinstance(burst, bool)):
            raise ValueError("rate_limit: burst must be a number")
        if retry_after is not None and not isinstance(retry_after, str):
            raise ValueError("rate_limit: retry_after must be a string")
        if not isinstance(headers, str):
            raise ValueError("rate_limit: headers must be a string")
        status = spec.get("status", 429)
        if not isinstance(status, int) or isinstance(status, bool):
            raise ValueError("rate_limit: status must be an integer")
        burst_f = None if burst is None else float(burst)
        return cls(float(rate), burst_f, retry_after, headers, status)

    def to_spec(self) -> dict[str, Any]:
        return {"kind": "rate_limit", **dataclasses.asdict(self)}


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` banked; one token per request."""

    def __init__(self, spec: RateLimitSpec, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self._capacity = spec.burst if spec.burst is not None else max(1.0, spec.rate)
        self._tokens = self._capacity
        self._clock = clock
        self._at = clock()
        self._lock = threading.Lock()

    def admit(self) -> tuple[tuple[str, str], ...] | None:
        """None when the request is admitted; else the headers of its refusal."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._capacity, self._tokens + (now - self._at) * self.spec.rate)
            self._at = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return None
            reset = (1.0 - self._tokens) / self.spec.rate
        return refusal_headers(self.spec, reset)


def refusal_headers(spec: RateLimitSpec, reset_seconds: float) -> tuple[tuple[str, str], ...]:
    headers: list[tuple[str, str]] = []
    if spec.retry_after:
        headers.append(("Retry-After", spec.retry_after))
    reset = max(1, math.ceil(reset_seconds))
    quota = f"{spec.rate:g}"
    if spec.headers == "ietf":
        headers += [("RateLimit-Policy", f'"default";q={quota};w=1'),
                    ("RateLimit", f'"default";r=0;t={reset}')]  # fmt: skip
    elif spec.headers == "x-ratelimit":
        headers += [("X-RateLimit-Limit", quota), ("X-RateLimit-Remaining", "0"),
                    ("X-RateLimit-Reset", str(reset))]  # fmt: skip
    elif spec.headers == "github":
        back = math.ceil(time.time() + reset)  # the epoch second the budget is back
        headers += [
            ("X-RateLimit-Limit", quota),
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Used", quota),
            ("X-RateLimit-Reset", str(back)),
            ("X-RateLimit-Resource", "core"),
        ]
    return tuple(headers)


__all__ = ["HEADER_STYLES", "REFUSAL_STATUSES", "RateLimitSpec", "TokenBucket", "refusal_headers"]
