"""check-receiver verdicts where the truth is knowable from the answers alone.

Pure functions over recorded answers: no HTTP here (the checker's integration tests
probe real receivers); these pin the wording and the verdict of shapes the test
receiver cannot produce on demand.
"""

from __future__ import annotations

import json
from datetime import timedelta

import httpx

from outbox import Endpoint
from outbox.checker.probes import Observed, Probe
from outbox.checker.verdicts import key_retained, replay_fresh_request_id, same_key_same_result

EP = Endpoint(name="rx", base_url="http://127.0.0.1:1", key_retention=timedelta(hours=2))


def probe(key: str, status: int | None, body: object, *, echo: str | None = "self",
          request_id: str | None = None) -> Probe:  # fmt: skip
    rid = request_id or f"rid-{key}-{status}-{json.dumps(body)}"
    headers = httpx.Headers({"X-Request-ID": rid if echo == "self" else echo} if echo else {})
    return Probe(key, rid, status, json.dumps(body).encode(), headers, None, "X-Request-ID")


def observed(**changes: object) -> Observed:
    first = probe("k1", 201, {"effect_id": 1})
    base = {
        "first": first,
        "again": probe("k1", 201, {"effect_id": 1}, request_id="rid-again"),
        "changed": probe("k1", 422, {"error": "idempotency_key_reused"}),
        "changed_how": "quantity: 2 -> 3",
        "other_key": probe("k2", 201, {"effect_id": 2}),
        "burst": [probe("k3", 201, {"effect_id": 3}, request_id=f"b{i}") for i in range(3)],
        "burst_after": probe("k3", 201, {"effect_id": 3}, request_id="after"),
        "retained_first": probe("k4", 201, {"effect_id": 4}),
        "retained_again": probe("k4", 201, {"effect_id": 4}, request_id="later"),
        "delay": 2.0,
        "lookups": {},
    }
    base.update(changes)
    return Observed(**base)  # type: ignore[arg-type]


def test_a_key_stuck_409_after_the_delay_fails_key_retained() -> None:
    o = observed(retained_again=probe("k4", 409, {"error": "idempotency_key_in_use"}))
    verdict = key_retained(o, EP)
    assert verdict.passed is False
    assert "still got 409" in verdict.summary and "stuck" in verdict.summary


def test_a_409_replay_fails_same_key_unless_declared() -> None:
    replay = probe("k1", 409, {"effect_id": 1}, request_id="rid-again")
    verdict = same_key_same_result(observed(again=replay))
    assert verdict.passed is False and "replay_status=409" in verdict.summary
    declared = observed(again=replay, replay_status=409)
    # A replay, but effects cannot be counted without a status lookup: not observed.
    assert same_key_same_result(declared).outcome == "not_observed"
    assert replay_fresh_request_id(declared, same_key_same_result(declared)).passed is True


def test_a_replay_without_the_request_id_header_is_named_as_such() -> None:
    silent = probe("k1", 201, {"effect_id": 1}, echo=None, request_id="rid-again")
    o = observed(again=silent)
    verdict = replay_fresh_request_id(o, same_key_same_result(o))
    assert verdict.passed is False
    assert "no X-Request-ID on the replay" in verdict.summary
    # A receiver that never echoes it: the replay carries none, a FAIL (issue 24).
    first = probe("k1", 201, {"effect_id": 1}, echo=None)
    o = observed(first=first, again=silent)
    verdict = replay_fresh_request_id(o, same_key_same_result(o))
    assert verdict.passed is False
    assert "no X-Request-ID on the replay (nor on the first answer" in verdict.summary


def test_a_run_that_decided_nothing_fails_and_names_the_cause() -> None:
    from outbox.checker.report import CheckReport, CheckVerdict, cause_of

    refused = (
        b'{"errors":[{"code":"INVALID_UUID_FORMAT","message":"Idempotency-Key must be a UUID"}]}'
    )
    cause = cause_of([(400, refused, None)] * 5)
    assert cause is not None
    assert cause.startswith("every probe was refused 400 INVALID_UUID_FORMAT")
    assert "key format" in cause
    assert cause_of([(400, refused, None), (201, b"{}", None)]) is None
    assert cause_of([(None, b"", "ConnectError")] * 3) is not None
    undecided = tuple(CheckVerdict(name, None, "could not tell", {}) for name in ("a", "b"))
    report = CheckReport(
        endpoint="rx", base_url="http://127.0.0.1:1", method="POST", path="/x", tenant="",
        verdicts=undecided, probe_keys=("k",), retention_delay_seconds=0.0, cause=cause,
    )  # fmt: skip
    assert report.decided_nothing
    assert (report.ok, report.exit_code) == (False, 1)  # without --strict
    assert any("decided nothing" in line and "INVALID_UUID_FORMAT" in line
               for line in report.lines())  # fmt: skip
