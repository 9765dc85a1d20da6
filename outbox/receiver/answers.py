"""What the kit answers on its own: replays, 409, 422, 400, 503, and the fingerprint.

Every refusal is an RFC 9457 problem document (``application/problem+json``) whose
``type`` ends in a stable code the outbox's classifier reads (:mod:`outbox.classify`):
``payload_conflict`` (422: this key is bound to another request), ``in_progress`` (409:
the first request with this key is still running), ``idempotency_key_missing`` (400)
and ``idempotency_key_invalid`` (400).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from outbox.canonical import canonical_json_text
from outbox.classify import RETENTION_HEADER

#: The replay marker of the IETF Idempotency-Key draft.
REPLAYED_HEADER = "Idempotent-Replayed"
PROBLEM_TYPE = "https://outbox.dev/problems/"
#: Keys the kit accepts: what the outbox sends (operation IDs, ``tenant/operation``).
_KEY = re.compile(r"[A-Za-z0-9._:/\-]{1,255}")


@dataclass(frozen=True, slots=True)
class Reply:
    """An HTTP answer: the handler's (stored or fresh) or the kit's own."""

    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    #: A stored response sent again.
    replayed: bool = False

    def json(self) -> object:
        return json.loads(self.body) if self.body else None


def problem(status: int, code: str, title: str, detail: str, **extra: object) -> Reply:
    """An RFC 9457 problem document; ``code`` is the stable last part of ``type``."""
    doc: dict[str, object] = {
        "type": PROBLEM_TYPE + code,
        "title": title,
        "status": status,
        "detail": detail,
        "code": code,
        **extra,
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    return Reply(status, {"content-type": "application/problem+json"}, body)


def key_missing(header: str) -> Reply:
    return problem(
        400,
        "idempotency_key_missing",
        "Idempotency key required",
        f"this route requires an {header} header",
    )


def key_invalid(header: str) -> Reply:
    return problem(
        400,
        "idempotency_key_invalid",
        "Idempotency key invalid",
        f"{header} must be 1-255 characters of letters, digits and ._:/-",
    )


def payload_conflict(key: str) -> Reply:
    return problem(
        422,
        "payload_conflict",
        "Idempotency key reused with a different payload",
        f"the key {key!r} is bound to another request; nothing was done",
    )


def in_progress(retry_after: int) -> Reply:
    reply = problem(
        409,
        "in_progress",
        "A request with this key is in progress",
        "the first request with this key is still being processed; retry later",
    )
    reply.headers["retry-after"] = str(retry_after)
    return reply


def busy() -> Reply:
    reply = problem(503, "busy", "Receipts store busy", "the database is busy; retry later")
    reply.headers["retry-after"] = "1"
    return reply


def valid_key(key: str) -> bool:
    return _KEY.fullmatch(key) is not None


def fingerprint(
    method: str, route: str, content_type: str | None, body: bytes, query: str = ""
) -> str:
    """SHA-256 of the validated request: method, route, query and the canonical body.

    JSON is compared canonically (sorted keys, compact), a form by its sorted pairs,
    anything else byte for byte, so a resend whose JSON keys come in another order is
    the same request, and a changed value is not.
    """
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    canon: bytes = body
    if kind == "application/json" or kind.endswith("+json"):
        text = canonical_json_text(body) if body else ""
        canon = (text if text is not None else body.decode("utf-8", "replace")).encode()
    elif kind == "application/x-www-form-urlencoded":
        pairs = sorted(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        canon = json.dumps(pairs, separators=(",", ":")).encode()
    query_pairs = sorted(parse_qsl(query, keep_blank_values=True))
    head = json.dumps([method.upper(), route, kind, query_pairs], separators=(",", ":"))
    return hashlib.sha256(head.encode() + b"\n" + canon).hexdigest()


def stored_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The response headers worth replaying (never cookies, dates or hop-by-hop)."""
    keep = ("content-type", "location", "etag", "content-language")
    return {k.lower(): v for k, v in headers.items() if k.lower() in keep}


__all__ = [
    "PROBLEM_TYPE",
    "REPLAYED_HEADER",
    "RETENTION_HEADER",
    "Reply",
    "busy",
    "fingerprint",
    "in_progress",
    "key_invalid",
    "key_missing",
    "payload_conflict",
    "problem",
    "stored_headers",
    "valid_key",
]
