"""From what the probes observed to one verdict per property."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from outbox.checker.probes import BODY_EVIDENCE_CHARS, Observed, lookup_evidence, reading
from outbox.checker.report import CheckVerdict
from outbox.classify import RETENTION_HEADER, declared_retention
from outbox.model import LookupStatus, Verdict

if TYPE_CHECKING:
    from outbox.config import Endpoint
    from outbox.model import LookupResult

_NOT_ACCEPTED = (
    "the first probe was not accepted ({status}), so nothing could be checked: "
    "fix --path, --method or the probe body (--json-body, --form-body, --content)"
)


def _settle(
    name: str,
    evidence: dict[str, Any],
    lookup: LookupResult | None,
    *,
    applied: str,
    not_applied: str,
    unobserved: str,
) -> CheckVerdict:
    """The ending every effect-counting verdict shares, once the answers themselves did
    not decide: the receiver's status lookup decides when it can (the key applied:
    passed; unknown to it: failed). Else the property was not observed: answers that
    look right (the same result again, one result for a burst) are what a receiver that
    runs the handler every time and answers with its first stored response gives too,
    so without a way to count effects they are never a PASS."""
    if lookup is not None and lookup.status is LookupStatus.APPLIED:
        return CheckVerdict(name, True, applied, evidence)
    if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
        return CheckVerdict(name, False, not_applied, evidence)
    return CheckVerdict(name, None, unobserved, evidence, observed=False)


def _no_count(lookup: LookupResult | None) -> str:
    """Why effects were not counted."""
    if lookup is None:
        return "no status_lookup is configured to count them by"
    return f"the status lookup could not tell ({lookup.detail})"


def same_key_same_result(o: Observed) -> CheckVerdict:
    name = "same_key_same_result"
    lookup = o.lookups.get("same_key")
    evidence: dict[str, Any] = {
        "first": o.first.evidence(),
        "second": o.again.evidence(),
        "status_lookup": lookup_evidence(lookup),
    }
    if not o.first.ok:
        return CheckVerdict(name, None, _NOT_ACCEPTED.format(status=o.first.describe()), evidence)
    if not o.replayed(o.again):
        if o.again.status == 409:
            return CheckVerdict(
                name,
                False,
                "the same key and payload, after the first request had answered, got 409 "
                "instead of the stored result: against a lost response the outbox can never "
                "settle it (it reads 409 as 'still processing'). If this receiver replays "
                "with 409 and the original body, declare Endpoint(replay_status=409)",
                evidence,
            )
        return CheckVerdict(
            name,
            False,
            f"the same key and payload again got {o.again.describe()} instead of the stored "
            f"result ({o.first.status})",
            evidence,
        )
    if o.first.result != o.again.result:
        return CheckVerdict(
            name,
            False,
            f"the same key twice got two different results ({o.first.status}, "
            f"{o.again.status}): the second request was applied as a new operation",
            evidence,
        )
    told = (
        "results identify effects: a new key got a different one"
        if o.discriminating
        else "a new key got an equal result, so results do not identify effects"
    )
    evidence["compared"] = f"the two answers' bodies: equal; {told}"
    return _settle(
        name,
        evidence,
        lookup,
        applied="the same result twice, and the receiver's status lookup holds one applied "
        "operation under the key",
        not_applied="the same result twice, but the status lookup has no record of the key: "
        "the receiver does not keep a receipt for it",
        unobserved=f"not observed: the same result twice ({told}), but whether the second "
        f"request ran the operation again cannot be seen in an answer, and "
        f"{_no_count(lookup)}",
    )


def changed_payload_refused(o: Observed) -> CheckVerdict:
    name = "changed_payload_refused"
    evidence = {
        "first": o.first.evidence(),
        "changed": o.changed.evidence(),
        "change": o.changed_how,
    }
    if not o.first.ok:
        return CheckVerdict(name, None, _NOT_ACCEPTED.format(status=o.first.describe()), evidence)
    status = o.changed.status
    if status is None:
        return CheckVerdict(
            name, None, f"the changed payload got {o.changed.describe()}: could not tell", evidence
        )
    if 200 <= status < 300:
        if o.changed.result == o.first.result:
            summary = (
                f"the same key with a changed payload ({o.changed_how}) was accepted with "
                f"{status} and the first result: the new arguments were silently dropped "
                "(expected a refusal such as 422)"
            )
        else:
            summary = (
                f"the same key with a changed payload ({o.changed_how}) was accepted with "
                f"{status} and a different result: it was applied under a reused key "
                "(expected a refusal such as 422)"
            )
        return CheckVerdict(name, False, summary, evidence)
    if 400 <= status < 500:
        seen = reading(o.changed, o.replay_status)
        assert seen is not None
        evidence["outbox_classifies_as"] = seen.value
        if seen is Verdict.KEY_CONFLICT:
            return CheckVerdict(
                name,
                True,
                f"the same key with a changed payload ({o.changed_how}) was refused with "
                f"{status}; the outbox recognises it as a key conflict",
                evidence,
            )
        if seen is Verdict.IN_PROGRESS:
            how = (
                "the outbox reads it as 'still processing' and would retry it until the "
                "in-progress budget is spent (receiver_busy), never key_conflict"
            )
        else:
            how = f"the outbox would read it as {seen.value}, not as key_conflict"
        return CheckVerdict(
            name,
            False,
            f"the same key with a changed payload ({o.changed_how}) was refused with "
            f"{status}, but {how}: its body names no payload or key conflict the outbox "
            "knows (see the manual's dispatcher guide, 'How answers are read', or give "
            "the endpoint classify=)",
            evidence,
        )
    return CheckVerdict(
        name,
        None,
        f"the same key with a changed payload got {status}: could not tell whether it was "
        "refused or failed",
        evidence,
    )


def new_key_new_operation(o: Observed) -> CheckVerdict:
    name = "new_key_new_operation"
    lookup = o.lookups.get("new_key")
    evidence = {
        "first": o.first.evidence(),
        "new_key": o.other_key.evidence(),
        "status_lookup": lookup_evidence(lookup),
    }
    if not o.first.ok:
        return CheckVerdict(name, None, _NOT_ACCEPTED.format(status=o.first.describe()), evidence)
    b = o.other_key
    if b.ok and b.result != o.first.result:
        return CheckVerdict(
            name,
            True,
            f"a new key with the same payload got {b.status} and a different result: a new "
            "operation",
            evidence,
        )
    if b.ok:
        return _settle(
            name,
            evidence,
            lookup,
            applied="a new key with the same payload got an equal result, and the status "
            "lookup holds it as an operation of its own",
            not_applied="a new key with the same payload got the first result and the status "
            "lookup has no record of it: the receiver deduplicates by payload, so two "
            "intents with equal arguments would be one",
            unobserved="not observed: a new key with the same payload got an equal result: "
            "either results do not identify effects or the receiver deduplicates by payload, "
            f"and {_no_count(lookup)}",
        )
    if b.status is not None and 400 <= b.status < 500:
        return CheckVerdict(
            name,
            False,
            f"a new key with a payload seen before was refused with {b.status}: the "
            "receiver deduplicates by payload, so two intents with equal arguments "
            "would be one",
            evidence,
        )
    return CheckVerdict(
        name, None, f"a new key with the same payload got {b.describe()}: could not tell", evidence
    )


def _cached_ids(o: Observed) -> list[dict[str, Any]]:
    """Burst answers echoing another request's ID rather than their own."""
    sent = {p.request_id for p in o.burst}
    return [
        {"sent": p.request_id, "echoed": p.echoed_request_id}
        for p in o.burst
        if p.echoed_request_id is not None
        and p.echoed_request_id != p.request_id
        and p.echoed_request_id in sent
    ]


def replay_fresh_request_id(o: Observed, same_key: CheckVerdict) -> CheckVerdict:
    name = "replay_fresh_request_id"
    header = o.first.request_id_header
    echoed_first, echoed_again = o.first.echoed_request_id, o.again.echoed_request_id
    cached_in_burst = _cached_ids(o)
    evidence = {
        "header": header,
        "first_sent": o.first.request_id,
        "first_echoed": echoed_first,
        "replay_sent": o.again.request_id,
        "replay_echoed": echoed_again,
        "concurrent_echoing_another_request": cached_in_burst,
    }
    if not o.first.ok or not o.replayed(o.again) or same_key.passed is False:
        return CheckVerdict(
            name, None, "no replay to inspect (the second request was not replayed)", evidence
        )
    if echoed_again == o.first.request_id:
        return CheckVerdict(
            name,
            False,
            f"the replay carried the ORIGINAL request's {header} ({echoed_again}), cached with "
            "the response, instead of this attempt's: logs would tie this attempt to the first",
            evidence,
        )
    if cached_in_burst:
        return CheckVerdict(
            name,
            False,
            f"{len(cached_in_burst)} concurrent replays carried another request's {header} "
            "instead of their own",
            evidence,
        )
    if echoed_again == o.again.request_id:
        return CheckVerdict(name, True, f"the replay carried this attempt's {header}", evidence)
    if echoed_again is None:
        # The property is "the replay carries this attempt's request ID": a replay that
        # carries none is observed not to, whether or not the first answer did.
        also = (
            ", although the first answer echoed the caller's"
            if echoed_first == o.first.request_id
            else " (nor on the first answer: the receiver echoes none)"
        )
        return CheckVerdict(
            name,
            False,
            f"no {header} on the replay{also}: a replay cannot be tied to the attempt that "
            "received it",
            evidence,
        )
    if echoed_first != o.first.request_id:
        return CheckVerdict(
            name,
            None,
            f"the receiver sets its own {header} rather than echoing the caller's: could not tell",
            evidence,
        )
    return CheckVerdict(
        name,
        False,
        f"the replay carried a {header} that is neither this attempt's nor the first's "
        f"({echoed_again})",
        evidence,
    )


def concurrent_duplicates(o: Observed) -> CheckVerdict:
    name = "concurrent_duplicates"
    lookup = o.lookups.get("burst")
    statuses = Counter(p.status if p.status is not None else "no response" for p in o.burst)
    results = Counter(p.result for p in o.burst if p.ok)
    after = o.burst_after
    evidence = {
        "requests": len(o.burst),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "distinct_results": len(results),
        "results": [r[:BODY_EVIDENCE_CHARS] for r in results],
        "after": o.burst_after.evidence(),
        "status_lookup": lookup_evidence(lookup),
    }
    n = len(o.burst)
    tally = ", ".join(f"{v}x {k}" for k, v in sorted(statuses.items(), key=str))
    if len(results) > 1:
        return CheckVerdict(
            name,
            False,
            f"{n} concurrent requests with one key got {len(results)} different results "
            f"({tally}): duplicates were applied",
            evidence,
        )
    if not results and after.ok:
        results[after.result] += 1  # all were "still processing": the settled answer counts
    if not results:
        return CheckVerdict(
            name, None, f"no concurrent request got a 2xx ({tally}): could not tell", evidence
        )
    if after.ok and after.result not in results:
        return CheckVerdict(
            name,
            False,
            f"{n} concurrent requests with one key got one result ({tally}), but a request "
            "after them got another: the key does not hold",
            evidence,
        )
    odd = [k for k in statuses if not (isinstance(k, int) and (200 <= k < 300 or k == 409))]
    if odd:
        return CheckVerdict(
            name,
            None,
            f"{n} concurrent requests: one result, but some got {odd} ({tally}): could not tell",
            evidence,
        )
    one_result = f"{n} concurrent requests with one key got one result ({tally})"
    return _settle(
        name,
        evidence,
        lookup,
        applied=one_result + ", and the status lookup holds one applied operation",
        not_applied=f"{n} concurrent requests got one result ({tally}), but the status "
        "lookup has no record of the key",
        unobserved=f"not observed: {n} concurrent requests with one key got one result "
        f"({tally}), but a receiver that ran each of them and answered with the first "
        f"stored result would answer the same, and {_no_count(lookup)}",
    )


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def key_retained(o: Observed, endpoint: Endpoint) -> CheckVerdict:
    name = "key_retained"
    lookup = o.lookups.get("retained")
    first, again = o.retained_first, o.retained_again
    hint = (
        "a hint only: the endpoint assumes keys are kept "
        f"{_duration(endpoint.key_retention.total_seconds())}"
    )
    evidence: dict[str, Any] = {
        "delay_seconds": o.delay,
        "first": first.evidence(),
        "after_delay": again.evidence(),
        "status_lookup_before_resend": lookup_evidence(lookup),
    }
    if not first.ok:
        return CheckVerdict(name, None, _NOT_ACCEPTED.format(status=first.describe()), evidence)
    declared = declared_retention(first.headers)
    if declared is not None:
        evidence["declared_retention_seconds"] = int(declared.total_seconds())
        if declared < endpoint.key_retention:
            return CheckVerdict(
                name,
                False,
                f"the receiver declares ({RETENTION_HEADER}) that it keeps keys "
                f"{_duration(declared.total_seconds())}, less than the endpoint's "
                f"key_retention of {_duration(endpoint.key_retention.total_seconds())}: "
                "retries late in the window would be new operations",
                evidence,
            )
    if o.replayed(again) and again.result != first.result:
        return CheckVerdict(
            name,
            False,
            f"after {o.delay:g}s the same key and payload got a different result: the "
            f"receiver forgot the key and applied it again ({hint})",
            evidence,
        )
    forgotten = f"after {o.delay:g}s the status lookup no longer knows the key ({hint})"
    if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
        return CheckVerdict(name, False, forgotten, evidence)
    repeat = o.again  # the immediate repeat of another key (same_key_same_result's)
    if (
        again.status is not None
        and not o.replayed(again)
        and o.first.ok
        and not o.replayed(repeat)
        and repeat.status == again.status
        and reading(repeat, o.replay_status) is reading(again, o.replay_status)
    ):
        evidence["immediate_repeat"] = repeat.evidence()
        evidence["compared"] = (
            f"the answer after the delay ({again.status}) with the answer to an immediate "
            f"repeat of a key just used ({repeat.status}): the same refusal"
        )
        return CheckVerdict(
            name,
            True,
            f"after {o.delay:g}s the same key and payload got the same refusal "
            f"({again.status}) as an immediate repeat; a forgotten key would have been "
            f"applied anew ({first.status} and a new result), so the key is retained ({hint})",
            evidence,
        )
    if again.status == 409 and not o.replayed(again):
        return CheckVerdict(
            name,
            False,
            f"after {o.delay:g}s the same key and payload still got 409: the key is stuck "
            f"'in progress' and the stored result is never given back ({hint})",
            evidence,
        )
    if not o.replayed(again):
        return CheckVerdict(
            name,
            None,
            f"after {o.delay:g}s the same key and payload got {again.describe()}: could not "
            f"tell ({hint})",
            evidence,
        )
    honoured = f"the key was still honoured after {o.delay:g}s ({hint})"
    evidence["compared"] = f"the first answer's body with the one after {o.delay:g}s: equal"
    return _settle(
        name,
        evidence,
        lookup,
        applied=honoured + ": the status lookup holds it as applied",
        not_applied=forgotten,
        unobserved=f"not observed: the same result after {o.delay:g}s, but whether the "
        f"request ran again cannot be seen in an answer, and {_no_count(lookup)} ({hint})",
    )


def tenants_kept_apart(o: Observed, endpoint: Endpoint) -> CheckVerdict:
    name = "tenants_kept_apart"
    scope = endpoint.tenant_scope
    if scope is None or o.tenant_probes is None:
        return CheckVerdict(
            name,
            None,
            "the endpoint declares no tenant scope (tenant_header, tenant_scope): operations "
            "with a tenant are refused at enqueue, so there was nothing to check",
        )
    a, b = o.tenant_probes
    evidence = {"scope": scope.value, "tenant_a": a.evidence(), "tenant_b": b.evidence()}
    if not a.ok:
        return CheckVerdict(
            name, None, f"tenant A's probe got {a.describe()}: could not tell", evidence
        )
    if b.status is not None and 400 <= b.status < 500 and reading(b) is not Verdict.FAILED:
        return CheckVerdict(
            name,
            False,
            f"tenant B, sending tenant A's key (scope: {scope.value}), got {b.status}: the "
            "receiver saw the key as tenant A's, so two tenants share keys",
            evidence,
        )
    if not b.ok:
        return CheckVerdict(
            name, None, f"tenant B's probe got {b.describe()}: could not tell", evidence
        )
    if a.result != b.result:
        return CheckVerdict(
            name,
            True,
            f"one key under two tenants (scope: {scope.value}) got two different results: "
            "two operations",
            evidence,
        )
    if o.discriminating:
        return CheckVerdict(
            name,
            False,
            f"tenant B, sending tenant A's key (scope: {scope.value}), got tenant A's result: "
            "one effect for two intents (a false success)",
            evidence,
        )
    return CheckVerdict(
        name,
        None,
        "two tenants got equal results, but results do not identify effects (a new key got "
        "an equal one): could not count effects",
        evidence,
    )
