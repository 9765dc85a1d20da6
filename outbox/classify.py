"""How a receiver's answer is read: the one table of classification rules.

The status code gives the default reading, from the IETF ``Idempotency-Key`` draft
(409: a request with this key is still being processed; 422: the key was used with
another payload). Real receivers disagree with it (a payload conflict sent as 409, a
stale version sent as 409, a key conflict sent as 400), so the JSON body breaks the tie:
its ``error`` / ``code`` / ``type`` / ``detail`` / ``message`` / ``title`` fields (and
``error.code`` / ``error.type`` / ``error.message``; RFC 9457 problem details included)
are searched for the markers below.

========================  ==========================================================
answer                    reading
========================  ==========================================================
2xx                       success
409 + in-progress marker  still processing (own budget, growing backoff)
409 + stale marker        failed (a stale-version refusal, like 412)
409 + conflict marker     key_conflict
409 + ``replay_status``   success: a replay whose (non-empty) body is the result
409, anything else        still processing (the draft's reading; also a bodiless 409)
400 / 422 + stale marker  failed
400/417/422 + conflict    key_conflict (a payload marker wins over "in progress";
                          the bare word "conflict" does not)
408, 425, 429, 503        retry, refused before work
403 + spent rate budget   retry, refused before work: a rate limit (GitHub's family
  or + ``Retry-After``    answers 403 with ``X-RateLimit-Remaining: 0``, or 403 with
                          ``Retry-After`` for its secondary limits)
500, 502, 504, other 5xx  retry, may have been applied
5xx + replay marker       a stored failure replayed (``Idempotent-Replayed: true``):
                          it will never change, so no retry (``outcome_unknown``)
other 4xx, 1xx, 3xx       failed (redirects are never followed)
========================  ==========================================================

A definitive refusal that follows an attempt which may have been applied is not proof
that nothing happened: the retry policy turns it into ``conflicting_evidence``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from outbox.model import (
    MAYBE_APPLIED_STATUSES,
    REFUSAL_STATUSES,
    Delivery,
    StatusFamily,
    Verdict,
)

#: The IETF Idempotency-Key draft's "a request with this key is still being processed".
IN_PROGRESS_STATUS = 409
#: Statuses whose body may name a key or payload conflict.
CONFLICT_STATUSES = frozenset({400, 409, 417, 422})

#: Markers, matched on the body's words lower-cased with ``_`` and ``-`` read as spaces.
IN_PROGRESS_MARKERS = ("in progress", "in use", "processing", "being processed", "pending")
STALE_MARKERS = (
    "stale",
    "precondition",
    "version conflict",
    "version mismatch",
    "expected version",
    "outdated",
)
CONFLICT_MARKERS = (
    "conflict",
    "mismatch",
    "reuse",
    "idempotency error",
    "different request",
    "different payload",
    "different body",
    "different parameters",
    "different arguments",
    "already used",
    "previously used",
    "does not match",
    "do not match",
    "misuse",
    "expectation failed",
)
#: Conflict markers that name the payload binding itself: they win over an in-progress
#: marker in the same answer ("key in use with a different request" is a conflict).
#: The bare word "conflict" does not ("conflict: a request is in progress"), nor Stripe's
#: "idempotency_error" type, which it also gives to "key in use".
_PAYLOAD_MARKERS = tuple(m for m in CONFLICT_MARKERS if m not in ("conflict", "idempotency error"))

_FIELDS = ("error", "errors", "code", "type", "detail", "message", "title", "reason")
_NESTED = ("code", "error_code", "type", "message", "detail", "title", "reason", "error")
_SEPARATORS = re.compile(r"[\s_\-]+")
#: Bytes of a non-JSON body searched for markers.
_TEXT_LIMIT = 2048


#: The header a receiver declares its key retention in, as delta-seconds
#: (``Idempotency-Key-Retention: 86400``: a key is kept 24 hours). ``outbox.receiver``
#: sends it on every answer; ``check-receiver`` compares it with the endpoint's
#: ``key_retention``.
RETENTION_HEADER = "Idempotency-Key-Retention"


def declared_retention(headers: httpx.Headers | None) -> timedelta | None:
    """The key retention a response declares (:data:`RETENTION_HEADER`), or None."""
    value = headers.get(RETENTION_HEADER) if headers is not None else None
    if value is None or not value.strip().isdigit():
        return None
    return timedelta(seconds=int(value.strip()))


#: Headers by which a receiver marks an answer as the replay of the stored result of an
#: earlier request with the same key (Stripe's and the test receiver's first; the same
#: names ``Endpoint.evidence_headers`` keeps by default).
REPLAY_HEADERS = ("Idempotent-Replayed", "Idempotency-Replayed", "X-Idempotent-Replayed")
_TRUE = frozenset({"true", "1", "yes"})


def replay_marker(headers: httpx.Headers | None) -> str | None:
    """The replay marker an answer carries (``"Idempotent-Replayed: true"``), or None."""
    if headers is None:
        return None
    for name in REPLAY_HEADERS:
        value = headers.get(name)
        if value is not None and value.strip().lower() in _TRUE:
            return f"{name}: {value.strip()}"
    return None


def parse_retry_after(value: str | None, now_ms: int) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date).

    Garbage is ignored (None): the backoff then decides alone.
    """
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - now_ms / 1000)


@dataclass(frozen=True, slots=True)
class RateHint:
    """What a refusal says of the receiver's limit: its rate in requests per second,
    and how long until its budget comes back (either may be unknown)."""

    rate: float | None = None
    reset_seconds: float | None = None
    #: Requests left in the current window (IETF ``r``, ``RateLimit-Remaining``,
    #: ``X-RateLimit-Remaining``), when it says.
    remaining: float | None = None

    @property
    def exhausted(self) -> bool:
        """The fields say the budget is used up: a rate limiter's refusal, not a gateway
        that stamps its fields on every answer (budget left) in front of a dead upstream."""
        return self.remaining is not None and self.remaining <= 0

    @property
    def reset_is_a_wait(self) -> bool:
        """Its reset is how long to hold off: the budget is spent, or what is left is not
        said (a refusal's fields, read as spent). With budget left it is no wait."""
        return self.remaining is None or self.exhausted


_PARAM = re.compile(r";\s*([a-z]+)\s*=\s*([0-9]+(?:\.[0-9]+)?)")


def _params(value: str | None) -> dict[str, float]:
    """``"default";q=50;w=1`` (the IETF structured fields): the first item's numbers."""
    if not value:
        return {}
    first = value.split(",", 1)[0]
    return {k: float(v) for k, v in _PARAM.findall(first.lower())}


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    value = value.strip()
    try:
        number = float(value.split(",", 1)[0].split(";", 1)[0])
    except ValueError:
        return None
    return number if number >= 0 and math.isfinite(number) else None


def rate_hint(headers: httpx.Headers | None, now_ms: int) -> RateHint | None:
    """The limit a refusal declares: the IETF ``RateLimit-Policy``/``RateLimit`` fields
    (``q`` per ``w`` seconds; ``t`` seconds to reset), their older ``RateLimit-Limit``/
    ``-Reset`` form, or ``X-RateLimit-Limit``/``-Reset`` (delta seconds, or an epoch
    time). Without a window an ``X-`` limit is read as per ``max(reset, 1)`` seconds.
    None when it declares nothing."""
    if headers is None:
        return None
    policy = _params(headers.get("ratelimit-policy"))
    current = _params(headers.get("ratelimit"))
    rate = reset = None
    if "q" in policy and policy["q"] > 0:
        rate = policy["q"] / max(policy.get("w", 1.0), 0.001)
    if "t" in current:
        reset = current["t"]
    remaining = current.get("r")
    if remaining is None:
        remaining = _number(
            headers.get("ratelimit-remaining") or headers.get("x-ratelimit-remaining")
        )
    limit = _number(headers.get("ratelimit-limit") or headers.get("x-ratelimit-limit"))
    raw_reset = _number(headers.get("ratelimit-reset") or headers.get("x-ratelimit-reset"))
    if raw_reset is not None and reset is None:
        # An epoch time (X-RateLimit-Reset: 1700000000), or delta seconds.
        reset = max(0.0, raw_reset - now_ms / 1000) if raw_reset > 1e9 else raw_reset
    if rate is None and limit is not None and limit > 0:
        rate = limit / max(reset or 1.0, 1.0)
    if rate is None and reset is None:
        return None
    return RateHint(rate, reset, remaining)


@dataclass(frozen=True, slots=True)
class Classification:
    """The verdict on one attempt, and what it says about delivery.

    Returned by the default rules and by an endpoint's own ``classify`` callable.
    """

    verdict: Verdict
    delivery: Delivery
    #: The receiver may have applied the operation (feeds the reconciliation reason).
    maybe_applied: bool = False
    #: The receiver refused before doing any work (503, 429, ...).
    refused: bool = False
    retry_after_seconds: float | None = None
    #: A 5xx the receiver marks as the replay of the result it stored for this key: every
    #: retry would get it again, so the policy stops at once (``outcome_unknown``).
    replayed_failure: bool = False
    #: What a refusal says of the receiver's rate limit (read from 429, 503 and a
    #: rate-limit 403 only).
    rate_hint: RateHint | None = None


def _strings(value: Any) -> Iterator[str]:
    """The marker-bearing strings of a field: itself, its nested fields, and those of
    the objects of a list (``{"errors": [{"error_code": ..., "reason": ...}]}``)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for name in _NESTED:
            nested = value.get(name)
            if isinstance(nested, str):
                yield nested
    elif isinstance(value, list):
        for item in value[:16]:
            if isinstance(item, str | dict):
                yield from _strings(item)  # one level: a dict's fields do not nest further


def body_words(body: bytes) -> str:
    """The words of a body that may name a conflict, normalised for marker matching."""
    texts: list[str] = []
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        data = body[:_TEXT_LIMIT].decode("utf-8", errors="replace")
    if isinstance(data, str):
        texts.append(data)
    elif isinstance(data, dict):
        for name in _FIELDS:
            texts.extend(_strings(data.get(name)))
    return " | ".join(_SEPARATORS.sub(" ", t.lower()) for t in texts)


def _has(words: str, markers: tuple[str, ...]) -> bool:
    return any(marker in words for marker in markers)


def body_reading(body: bytes) -> str | None:
    """What the body says: ``in_progress``, ``stale``, ``conflict`` or None."""
    words = body_words(body)
    if not words:
        return None
    if _has(words, STALE_MARKERS):
        return "stale"
    if _has(words, _PAYLOAD_MARKERS):
        return "conflict"
    if _has(words, IN_PROGRESS_MARKERS):
        return "in_progress"
    if _has(words, CONFLICT_MARKERS):
        return "conflict"
    return None


def is_key_mismatch(response: httpx.Response, body: bytes) -> bool:
    """Does a 400, 409 or 422 say the key is bound to a different payload?"""
    return response.status_code in CONFLICT_STATUSES and body_reading(body) == "conflict"


#: A 403 is a permanent refusal, except from a rate limiter that says so: its fields
#: show the budget spent, or it carries a ``Retry-After``. GitHub's REST API answers its
#: primary limit "403 or 429, and ``x-ratelimit-remaining`` is 0", its secondary limits
#: 403 or 429 with ``retry-after``; several APIs modelled on it do the same.
RATE_LIMIT_FORBIDDEN = 403


def classify_response(
    response: httpx.Response, body: bytes, now_ms: int, *, replay_status: int | None = None
) -> Classification:
    """The default rules (the table in this module's docstring)."""
    status = response.status_code
    if 200 <= status < 300:
        return Classification(Verdict.SUCCESS, Delivery.SENT, maybe_applied=True)
    retry_after = parse_retry_after(response.headers.get("retry-after"), now_ms)
    reading = body_reading(body) if status in CONFLICT_STATUSES else None
    if status == IN_PROGRESS_STATUS or (replay_status is not None and status == replay_status):
        if reading == "stale":
            return Classification(Verdict.FAILED, Delivery.SENT)
        if reading == "conflict":
            return Classification(Verdict.KEY_CONFLICT, Delivery.SENT)
        if reading != "in_progress" and status == replay_status and body.strip():
            # The endpoint declared that its receiver replays with this status: the body
            # is the stored result of the first request. (A bodiless one proves nothing.)
            return Classification(Verdict.SUCCESS, Delivery.SENT, maybe_applied=True)
        if status == IN_PROGRESS_STATUS:
            # The receiver holds the key: an earlier attempt reached it.
            return Classification(
                Verdict.IN_PROGRESS,
                Delivery.SENT,
                maybe_applied=True,
                retry_after_seconds=retry_after,
            )
    if status >= 500 and replay_marker(response.headers) is not None:
        # A stored failure, replayed: the key is bound to it for the receiver's retention.
        return Classification(
            Verdict.RETRY, Delivery.SENT, maybe_applied=True, replayed_failure=True
        )
    family = StatusFamily.of(status)
    hint = rate_hint(response.headers, now_ms) if status in (429, 503, 403) else None
    # A 403 that is a rate limit's, not a permission's: refused before work, as a 429 is.
    limited = status == RATE_LIMIT_FORBIDDEN and (
        retry_after is not None or (hint is not None and hint.exhausted)
    )
    if family is StatusFamily.REFUSAL or limited:
        return Classification(
            Verdict.RETRY, Delivery.SENT, refused=True, retry_after_seconds=retry_after,
            rate_hint=hint,
        )  # fmt: skip
    if family is StatusFamily.MAYBE_APPLIED:
        return Classification(
            Verdict.RETRY, Delivery.SENT, maybe_applied=True, retry_after_seconds=retry_after
        )
    if reading == "conflict":
        return Classification(Verdict.KEY_CONFLICT, Delivery.SENT)
    # Other 4xx (a stale version included), and 1xx/3xx (redirects are never followed).
    return Classification(Verdict.FAILED, Delivery.SENT)


__all__ = [
    "CONFLICT_MARKERS",
    "IN_PROGRESS_MARKERS",
    "IN_PROGRESS_STATUS",
    "MAYBE_APPLIED_STATUSES",
    "RATE_LIMIT_FORBIDDEN",
    "REFUSAL_STATUSES",
    "REPLAY_HEADERS",
    "STALE_MARKERS",
    "Classification",
    "RateHint",
    "body_reading",
    "classify_response",
    "is_key_mismatch",
    "rate_hint",
    "replay_marker",
]
