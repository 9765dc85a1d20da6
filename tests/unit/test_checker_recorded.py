"""check-receiver's verdicts on answers recorded from real middlewares (issue 24).

The bytes below are what the checker's probes got from django-idempotency-key 1.3.0 (a
Django app, ``tests/middlewares``) and fastapi-idempotency-key 0.1.1 (Starlette, its
in-memory and its Redis backend on redis-server 7), served by uvicorn over 127.0.0.1,
and from aws-lambda-powertools 3.37.0 idempotency on redis-server 7 (``POWERTOOLS``
below). None of them echoes ``X-Request-ID``; the verdicts below read statuses and bodies
only, which are recorded byte for byte, so the recorded answers pin them without the
servers.
"""

from __future__ import annotations

from datetime import timedelta

import httpx

from outbox import Endpoint
from outbox.checker.probes import Observed, Probe
from outbox.checker.report import CheckReport
from outbox.checker.verdicts import (
    changed_payload_refused,
    concurrent_duplicates,
    key_retained,
    replay_fresh_request_id,
    same_key_same_result,
)

EP = Endpoint(name="mw", base_url="http://127.0.0.1:1", key_retention=timedelta(days=1))
JSON = {"content-type": "application/json"}


def _django(effect_id: int, quantity: int = 2) -> bytes:
    # django.http.JsonResponse: json.dumps with its default separators.
    return (b'{"effect_id": %d, "received": {"quantity": %d, "sku": "TEST-BOLT"}}'
            % (effect_id, quantity))  # fmt: skip


def _starlette(effect_id: int) -> bytes:
    return b'{"effect_id":%d,"received":{"quantity":2,"sku":"TEST-BOLT"}}' % effect_id


FASTAPI_MISMATCH = (
    b'{"detail": "Idempotency key was previously used with a different request payload."}'
)


def _probe(key: str, n: int, answer: tuple[int, bytes]) -> Probe:
    status, body = answer
    return Probe(key, f"{key}-request-{n}", status, body, httpx.Headers(JSON), None,
                 "X-Request-ID")  # fmt: skip


def _observed(answers: dict[str, object], replay_status: int | None = None) -> Observed:
    def p(key: str, n: int, name: str) -> Probe:
        answer = answers[name]
        assert isinstance(answer, tuple)
        return _probe(key, n, answer)

    burst = answers["burst"]
    assert isinstance(burst, list)
    return Observed(
        first=p("same", 1, "first"),
        again=p("same", 2, "again"),
        changed=p("same", 3, "changed"),
        changed_how="quantity: 2 -> 3",
        other_key=p("new", 1, "other_key"),
        burst=[_probe("burst", i, a) for i, a in enumerate(burst)],
        burst_after=p("burst", 99, "burst_after"),
        retained_first=p("retained", 1, "retained_first"),
        retained_again=p("retained", 2, "retained_again"),
        delay=1.0,
        lookups={},
        replay_status=replay_status,
    )


#: django-idempotency-key: replays with 409 and the original body; hashes the body into
#: its key, so a changed payload is a new operation to it.
DJANGO: dict[str, object] = {
    "retained_first": (201, _django(1)),
    "first": (201, _django(2)),
    "again": (409, _django(2)),
    "changed": (201, _django(3, quantity=3)),
    "other_key": (201, _django(4)),
    "burst": [(201, _django(i)) for i in (5, 6, 7, 8, 9, 10, 11, 12)],
    "burst_after": (409, _django(12)),
    "retained_again": (409, _django(1)),
}
#: fastapi-idempotency-key on Redis: every repeat of a used key, same payload or not, is
#: answered 422 "a different request payload".
FASTAPI_REDIS: dict[str, object] = {
    "retained_first": (201, _starlette(1)),
    "first": (201, _starlette(2)),
    "again": (422, FASTAPI_MISMATCH),
    "changed": (422, FASTAPI_MISMATCH),
    "other_key": (201, _starlette(3)),
    "burst": [(201, _starlette(4))] + [(422, FASTAPI_MISMATCH)] * 7,
    "burst_after": (422, FASTAPI_MISMATCH),
    "retained_again": (422, FASTAPI_MISMATCH),
}
#: fastapi-idempotency-key in memory: replays with the original 201.
FASTAPI_MEMORY: dict[str, object] = {
    "retained_first": (201, _starlette(1)),
    "first": (201, _starlette(2)),
    "again": (201, _starlette(2)),
    "changed": (422, FASTAPI_MISMATCH),
    "other_key": (201, _starlette(3)),
    "burst": [(201, _starlette(4))] * 8,
    "burst_after": (201, _starlette(4)),
    "retained_again": (201, _starlette(1)),
}


def _powertools(effect_id: int) -> bytes:
    # The handler's body: json.dumps with its default separators.
    return b'{"effect_id": %d, "received": {"quantity": 2, "sku": "TEST-BOLT"}}' % effect_id


POWERTOOLS_MISMATCH = b'{"message": "Idempotency key was used with a different payload"}'
POWERTOOLS_IN_PROGRESS = (
    b'{"message": "A request with this idempotency key is already in progress"}'
)
#: aws-lambda-powertools 3.37.0, ``@idempotent`` with ``RedisCachePersistenceLayer``
#: (redis 8.1.0 client), ``event_key_jmespath='headers."idempotency-key"'``,
#: ``payload_validation_jmespath="powertools_json(body)"``, expires_after_seconds=60 and
#: the checker's default 2 s retention delay, behind http.server building an API Gateway
#: proxy event. Its handler answers 201. The HTTP mapping of its exceptions is ours
#: (Powertools has none; unhandled, the invocation fails and API Gateway answers 502):
#: IdempotencyValidationError -> 422 POWERTOOLS_MISMATCH,
#: IdempotencyAlreadyInProgressError -> 409 POWERTOOLS_IN_PROGRESS. Its Redis layer
#: rewrites the record on completion without the payload validation hash
#: (``_update_record``), so every repeat of a completed key, same payload or not, fails
#: validation: 422. The burst's seven others found the first in progress: 409 (the
#: order within the burst is not recorded; the verdicts count, they do not read order).
POWERTOOLS: dict[str, object] = {
    "retained_first": (201, _powertools(1)),
    "first": (201, _powertools(2)),
    "again": (422, POWERTOOLS_MISMATCH),
    "changed": (422, POWERTOOLS_MISMATCH),
    "other_key": (201, _powertools(3)),
    "burst": [(201, _powertools(4))] + [(409, POWERTOOLS_IN_PROGRESS)] * 7,
    "burst_after": (422, POWERTOOLS_MISMATCH),
    "retained_again": (422, POWERTOOLS_MISMATCH),
}
#: The same with expires_after_seconds=1 and a 2.5 s retention delay: the key expired,
#: and the repeat after the delay was applied anew (effect 5).
POWERTOOLS_EXPIRED: dict[str, object] = {
    **POWERTOOLS,
    "retained_again": (201, _powertools(5)),
}


def test_django_a_replay_without_a_fresh_request_id_fails() -> None:
    o = _observed(DJANGO, replay_status=409)  # declared, as django-idempotency-key needs
    verdict = replay_fresh_request_id(o, same_key_same_result(o))
    assert verdict.passed is False
    assert "no X-Request-ID on the replay" in verdict.summary
    assert verdict.evidence["replay_sent"] == "same-request-2"
    assert verdict.evidence["replay_echoed"] is None
    # Undeclared, its 409 is no replay to the outbox: "same key" fails instead, and there
    # is no replay to inspect.
    o = _observed(DJANGO)
    assert same_key_same_result(o).passed is False
    assert replay_fresh_request_id(o, same_key_same_result(o)).passed is None


def test_django_the_same_refusal_after_the_delay_means_the_key_is_retained() -> None:
    verdict = key_retained(_observed(DJANGO), EP)
    assert verdict.passed is True, verdict.summary
    assert "the same refusal (409) as an immediate repeat" in verdict.summary
    assert verdict.evidence["immediate_repeat"]["status"] == 409
    assert any(line.startswith("compared: the answer after the delay (409)")
               for line in verdict.rests_on)  # fmt: skip


def test_django_declared_replays_count_no_effects() -> None:
    # Declared, the 409s are replays: they look right, but no answer counts effects.
    o = _observed(DJANGO, replay_status=409)
    for verdict in (same_key_same_result(o), key_retained(o, EP)):
        assert verdict.outcome == "not_observed", verdict.summary
    # Eight different results for one key are eight effects: observed, a FAIL.
    assert concurrent_duplicates(o).passed is False
    # It hashes the body into its key: a changed payload is applied as new.
    assert changed_payload_refused(o).passed is False


def test_fastapi_on_redis_the_same_refusal_after_the_delay_means_the_key_is_retained() -> None:
    o = _observed(FASTAPI_REDIS)
    verdict = key_retained(o, EP)
    assert verdict.passed is True, verdict.summary
    assert "the same refusal (422) as an immediate repeat" in verdict.summary
    # Its refusal of the unchanged repeat is a FAIL of "same key, same result".
    same_key = same_key_same_result(o)
    assert same_key.passed is False and "got 422 instead of the stored result" in same_key.summary
    assert changed_payload_refused(o).passed is True


def test_fastapi_in_memory_replays_count_no_effects() -> None:
    o = _observed(FASTAPI_MEMORY)
    for verdict in (same_key_same_result(o), concurrent_duplicates(o), key_retained(o, EP)):
        assert verdict.outcome == "not_observed", verdict.summary
        assert verdict.summary.startswith("not observed: ")
    assert changed_payload_refused(o).passed is True


def test_a_recorded_run_reports_what_it_could_not_observe() -> None:
    o = _observed(FASTAPI_MEMORY)
    same_key = same_key_same_result(o)
    report = CheckReport(
        endpoint="mw", base_url=EP.base_url, method="POST", path="/reservations", tenant="",
        verdicts=(same_key, changed_payload_refused(o), key_retained(o, EP)),
        probe_keys=("same", "new", "burst", "retained"), retention_delay_seconds=1.0,
    )  # fmt: skip
    assert report.not_observed == ["same_key_same_result", "key_retained"]
    assert report.exit_code == 0 and not report.decided_nothing
    text = "\n".join(report.lines())
    assert "N/O   same_key_same_result" in text
    assert "rests on: first request: request same-request-1 got 201" in text
    assert "rests on: status lookup: none configured, so effects were not counted" in text
    assert "1 passed, 0 failed, 0 could not tell, 2 not observed (N/O)" in text


def test_powertools_on_redis_the_same_refusal_after_the_delay_retains_the_key() -> None:
    """Powertools on Redis, its exceptions mapped the way a Powertools-based API commonly
    answers (our choice, the only part not Powertools'): IdempotencyValidationError ->
    422 {"message": "Idempotency key was used with a different payload"},
    IdempotencyAlreadyInProgressError -> 409 {"message": "A request with this idempotency
    key is already in progress"}; a completed key otherwise replays the stored 201."""
    o = _observed(POWERTOOLS)
    verdict = key_retained(o, EP)
    assert verdict.passed is True, verdict.summary
    assert "the same refusal (422) as an immediate repeat" in verdict.summary
    assert verdict.evidence["immediate_repeat"]["status"] == 422
    # Its 422 for the unchanged repeat (the lost validation hash) is a FAIL of "same key,
    # same result"; with no replay there is no request ID to inspect.
    same_key = same_key_same_result(o)
    assert same_key.passed is False and "got 422 instead of the stored result" in same_key.summary
    assert replay_fresh_request_id(o, same_key).passed is None
    # Every repeat is 422, so the changed payload is refused too: a key conflict.
    assert changed_payload_refused(o).passed is True
    # One result and seven 409s "in progress" look right, but no answer counts effects.
    burst = concurrent_duplicates(o)
    assert burst.outcome == "not_observed", burst.summary
    assert "(1x 201, 7x 409)" in burst.summary


def test_powertools_on_redis_a_key_expired_before_the_delay_is_forgotten() -> None:
    """The same server and mapping with expires_after_seconds=1: a new result after the
    delay is a new effect, a FAIL the answers alone decide."""
    verdict = key_retained(_observed(POWERTOOLS_EXPIRED), EP)
    assert verdict.passed is False, verdict.summary
    assert "forgot the key and applied it again" in verdict.summary
