"""The classification table (outbox/classify.py), answer by answer, as real receivers
word them."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from outbox import Verdict
from outbox.classify import body_reading, classify_response, replay_marker

NOW = 1_800_000_000_000


def verdict(status: int, body: Any = None, *, replay_status: int | None = None) -> Verdict:
    raw = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    response = httpx.Response(status, content=raw)
    return classify_response(response, raw, NOW, replay_status=replay_status).verdict


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        # The IETF draft's reading, and the bodiless 409.
        (409, None, Verdict.IN_PROGRESS),
        (409, {"error": "idempotency_key_in_use"}, Verdict.IN_PROGRESS),
        (422, {"error": "idempotency_key_reused"}, Verdict.KEY_CONFLICT),
        # The article's receiver: a changed payload sent as 409.
        (409, {"error": "payload_conflict"}, Verdict.KEY_CONFLICT),
        # Stripe: 400 for a changed payload, 409 while in use (type idempotency_error too).
        (400, {"error": {"type": "idempotency_error", "message": "Keys for idempotent "
               "requests can only be used with the same parameters"}}, Verdict.KEY_CONFLICT),
        (409, {"error": {"type": "idempotency_error", "code": "idempotency_key_in_use"}},
         Verdict.IN_PROGRESS),
        # fastapi-idempotency-key, fastapi-idempotency, asgi-idempotency-header.
        (422, {"detail": "Idempotency key was previously used with a different request "
               "payload."}, Verdict.KEY_CONFLICT),
        (422, {"detail": "Idempotency-Key 'k' was already used for a different request."},
         Verdict.KEY_CONFLICT),
        (409, {"detail": "A request with idempotency key 'k' is still being processed."},
         Verdict.IN_PROGRESS),
        (409, {"detail": "Request already pending for idempotency key 'k'"},
         Verdict.IN_PROGRESS),
        (422, {"detail": "Idempotency-Key must be 1 to 255 characters long."}, Verdict.FAILED),
        # RFC 9457 problem details.
        (409, {"type": "https://example.com/probs/idempotency-mismatch", "title": "Mismatch"},
         Verdict.KEY_CONFLICT),
        # A stale version, as 409 or 412: definitive.
        (409, {"error": "version_conflict", "current_version": 3}, Verdict.FAILED),
        (409, {"code": "STALE_WRITE"}, Verdict.FAILED),
        (412, {"error": "precondition_failed"}, Verdict.FAILED),
        # Validation errors are failures, not conflicts.
        (422, {"detail": [{"loc": ["body", "sku"], "msg": "field required"}]}, Verdict.FAILED),
        (400, {"error": "invalid_body"}, Verdict.FAILED),
        # Plain text bodies are read too.
        (409, b"payload mismatch for this key", Verdict.KEY_CONFLICT),
        (201, {"ok": True}, Verdict.SUCCESS),
        (503, None, Verdict.RETRY),
        (500, {"error": "conflict"}, Verdict.RETRY),  # 5xx: never a conflict
    ],
)
def test_the_table(status: int, body: Any, expected: Verdict) -> None:
    assert verdict(status, body) is expected


def test_a_declared_replay_status_reads_a_409_with_a_result_as_a_replay() -> None:
    assert verdict(409, {"effect_id": 1}, replay_status=409) is Verdict.SUCCESS
    assert verdict(409, {"effect_id": 1}) is Verdict.IN_PROGRESS
    # ...but a 409 that says in progress or names a conflict stays what it says.
    assert verdict(409, {"error": "in_progress"}, replay_status=409) is Verdict.IN_PROGRESS
    assert verdict(409, {"error": "payload_conflict"}, replay_status=409) is Verdict.KEY_CONFLICT
    # A bodiless 409 proves nothing: still processing, as the draft says.
    assert verdict(409, None, replay_status=409) is Verdict.IN_PROGRESS


def test_hostile_bodies_never_raise() -> None:
    assert body_reading(b"\xff\xfe" * 10) is None
    assert body_reading(b"[" * 100_000) is None
    assert body_reading(json.dumps({"error": {"code": None}}).encode()) is None


# Answers recorded from real middlewares (issue 24): bytes as received.
@pytest.mark.parametrize(
    ("status", "body", "verdict"),
    [
        # express-idempotency: a changed payload under a used key.
        (417, b'{"error":"Misuse of the idempotency key. Please check your request."}',
         "key_conflict"),
        (417, b'{"message":"Expectation Failed"}', "key_conflict"),
        # JSON:API style error lists.
        (422, b'{"errors":[{"error_code":"IDEMPOTENCY_KEY_REUSED",'
              b'"reason":"request does not match the original"}]}', "key_conflict"),
        # A conflict marker wins over an in-progress one in the same answer.
        (409, b'{"detail":"Idempotency key in use with a different request"}', "key_conflict"),
        (400, b'{"error":"parameters do not match the original request, still processing"}',
         "key_conflict"),
        # Stripe's in-progress answer stays "still processing" despite its error type.
        (409, b'{"error":{"type":"idempotency_error","code":"idempotency_key_in_use",'
              b'"message":"There is currently another in-progress request using this '
              b'Idempotency-Key."}}', "in_progress"),
    ],
)  # fmt: skip
def test_recorded_middleware_answers(status: int, body: bytes, verdict: str) -> None:
    got = classify_response(httpx.Response(status, content=body), body, 0)
    assert got.verdict.value == verdict


# A stored 5xx the receiver replays (issue 24): it will never change.
@pytest.mark.parametrize(
    ("status", "headers", "replayed"),
    [
        (500, {"Idempotent-Replayed": "true"}, True),
        (502, {"idempotent-replayed": "True"}, True),
        (503, {"Idempotent-Replayed": "true"}, True),
        (500, {"Idempotent-Replayed": "false"}, False),
        (500, {}, False),
        # A replayed success or refusal is read as before.
        (201, {"Idempotent-Replayed": "true"}, False),
        (422, {"Idempotent-Replayed": "true"}, False),
    ],
)
def test_a_replayed_stored_failure_is_marked(
    status: int, headers: dict[str, str], replayed: bool
) -> None:
    body = b'{"error":"internal_error"}'
    got = classify_response(httpx.Response(status, headers=headers, content=body), body, NOW)
    assert got.replayed_failure is replayed
    if replayed:
        assert got.verdict is Verdict.RETRY
        assert got.maybe_applied and not got.refused
        assert replay_marker(httpx.Headers(headers)) == "Idempotent-Replayed: " + next(
            iter(headers.values())
        )


_RESET = str(NOW // 1000 + 600)


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        # GitHub's primary limit: 403 with the budget's fields at 0 (epoch reset).
        (
            {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": _RESET},
            True,
        ),
        # The IETF fields, budget spent; a secondary limit's bare Retry-After.
        ({"RateLimit-Policy": '"default";q=10;w=1', "RateLimit": '"default";r=0;t=3'}, True),
        ({"Retry-After": "60"}, True),
        # A permission refusal stays one, even from an API that stamps its budget on
        # every answer (budget left), and with no fields at all.
        (
            {"X-RateLimit-Limit": "60", "X-RateLimit-Remaining": "41", "X-RateLimit-Reset": _RESET},
            False,
        ),
        ({}, False),
    ],
)
def test_a_403_is_a_refusal_before_work_only_when_it_is_a_rate_limit(
    headers: dict[str, str], refused: bool
) -> None:
    body = b'{"message":"API rate limit exceeded"}' if refused else b'{"message":"Forbidden"}'
    got = classify_response(httpx.Response(403, headers=headers, content=body), body, NOW)
    if refused:
        assert (got.verdict, got.refused, got.maybe_applied) == (Verdict.RETRY, True, False)
    else:
        assert (got.verdict, got.refused, got.rate_hint) == (Verdict.FAILED, False, None)
