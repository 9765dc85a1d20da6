"""A conformance check of a receiver's idempotency, by probing it over HTTP.

:func:`check_receiver` sends a handful of probe operations (fresh operation IDs starting
with ``outbox-probe-``) to one endpoint, through httpx with the endpoint's base URL,
auth, static headers, idempotency and request ID headers, exactly as the dispatcher
would, and reports one verdict per property:

``same_key_same_result``
    The same key twice returns the same result, and (where the receiver can be asked
    through the endpoint's ``status_lookup``) one operation is recorded under the key.
``changed_payload_refused``
    The same key with changed arguments is refused (422, or whatever it does, said
    plainly), not silently replayed or applied.
``new_key_new_operation``
    A different key with the same payload is a new operation, not deduplicated by
    payload.
``replay_fresh_request_id``
    A replay carries the current attempt's request ID, not the cached first one.
``concurrent_duplicates``
    Several requests with one key at once yield one result.
``key_retained``
    The key is still honoured after a short delay: a hint about retention, no more.
``tenants_kept_apart``
    The same key under two tenants is two operations, the way the endpoint declares it
    scopes tenants (header, key prefix or per-tenant credentials).

Each verdict is passed (True), failed (False) or could not tell (None), with the status
codes, truncated bodies and header values it rests on. With ``strict`` an undecided
verdict also makes the exit code non-zero. The probes create real effects,
so the check refuses an endpoint not marked ``probe_safe=True`` unless told
``allow_unsafe=True``. Passing proves nothing about production: it is one test receiver,
probed a few times, at one moment.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from outbox.body import read_body
from outbox.canonical import check_tenant
from outbox.errors import ConfigurationError, ValidationError
from outbox.lookup import LookupResult, LookupStatus, lookup_status
from outbox.model import Verdict
from outbox.transport import build_client, classify_response, clean_message, request_headers

if TYPE_CHECKING:
    from outbox.client import Outbox
    from outbox.config import Endpoint

__all__ = [
    "CHECKS",
    "NOTICE",
    "PROBE_PREFIX",
    "PROBE_TENANTS",
    "CheckReport",
    "CheckVerdict",
    "UnsafeProbeRefused",
    "changed_payload",
    "check_receiver",
    "check_receiver_async",
]

PROBE_PREFIX = "outbox-probe-"
NOTICE = (
    "These probes exercised one receiver a few times, just now. Passing proves nothing "
    "about production: another deployment, configuration, load, failover or retention "
    "setting may behave differently."
)
#: The verdicts, in report order, with what each one checks.
CHECKS: dict[str, str] = {
    "same_key_same_result": "same key twice: same result, one effect",
    "changed_payload_refused": "same key, changed payload: refused",
    "new_key_new_operation": "new key, same payload: a new operation",
    "replay_fresh_request_id": "replay carries the current request ID",
    "concurrent_duplicates": "concurrent duplicates: one result",
    "key_retained": "key still honoured after a delay",
    "tenants_kept_apart": "same key, two tenants: two operations",
}
#: The tenants the tenant-scoping probe sends as, unless told others.
PROBE_TENANTS = (PROBE_PREFIX + "tenant-a", PROBE_PREFIX + "tenant-b")
_BODY_EVIDENCE_CHARS = 500
_MAX_BODY = 1024 * 1024


class UnsafeProbeRefused(ConfigurationError):
    """The endpoint is not marked ``probe_safe`` and ``allow_unsafe`` was not given."""


@dataclass(frozen=True, slots=True)
class CheckVerdict:
    """One property of the receiver, as observed."""

    name: str
    #: True passed, False failed, None could not tell.
    passed: bool | None
    #: One line, in plain words.
    summary: str
    #: Status codes, truncated bodies and header values the verdict rests on.
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return CHECKS.get(self.name, self.name)

    @property
    def mark(self) -> str:
        return {True: "PASS", False: "FAIL", None: "????"}[self.passed]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "passed": self.passed,
            "summary": self.summary,
            "evidence": self.evidence,
        }


@dataclass(frozen=True)
class CheckReport:
    """Every verdict of one run, with what was probed."""

    endpoint: str
    base_url: str
    method: str
    path: str
    tenant: str
    verdicts: tuple[CheckVerdict, ...]
    probe_keys: tuple[str, ...]
    retention_delay_seconds: float
    notice: str = NOTICE
    #: An undecided verdict counts as a failure too (``--strict``).
    strict: bool = False

    @property
    def ok(self) -> bool:
        """No verdict failed (some may be undecided; none, with ``strict``)."""
        if self.strict and self.undecided:
            return False
        return all(v.passed is not False for v in self.verdicts)

    @property
    def failed(self) -> list[str]:
        return [v.name for v in self.verdicts if v.passed is False]

    @property
    def undecided(self) -> list[str]:
        return [v.name for v in self.verdicts if v.passed is None]

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def verdict(self, name: str) -> CheckVerdict:
        for v in self.verdicts:
            if v.name == name:
                return v
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "base_url": self.base_url,
            "method": self.method,
            "path": self.path,
            "tenant": self.tenant,
            "ok": self.ok,
            "strict": self.strict,
            "failed": self.failed,
            "undecided": self.undecided,
            "verdicts": [v.as_dict() for v in self.verdicts],
            "probe_keys": list(self.probe_keys),
            "retention_delay_seconds": self.retention_delay_seconds,
            "notice": self.notice,
        }

    def lines(self) -> list[str]:
        """The human report: a header, one line per verdict, a tally and the notice."""
        width = max(len(v.name) for v in self.verdicts) if self.verdicts else 0
        out = [
            f"receiver check: endpoint {self.endpoint!r} at {self.base_url}, "
            f"{self.method} {self.path}" + (f", tenant {self.tenant!r}" if self.tenant else ""),
        ]
        out += [f"{v.mark}  {v.name:<{width}}  {v.summary}" for v in self.verdicts]
        passed = sum(1 for v in self.verdicts if v.passed is True)
        out.append(
            f"{passed} passed, {len(self.failed)} failed, {len(self.undecided)} could not "
            f"tell; probe keys: {', '.join(self.probe_keys)}"
        )
        out.append(f"NOTE: {self.notice}")
        return out


# -- probing ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Probe:
    key: str
    request_id: str
    status: int | None
    body: bytes
    headers: httpx.Headers | None
    error: str | None
    request_id_header: str

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def result(self) -> str:
        """The body, canonical when it is JSON: what two results are compared by."""
        try:
            return json.dumps(json.loads(self.body), sort_keys=True, separators=(",", ":"))
        except ValueError:
            return self.body.decode("utf-8", errors="replace")

    @property
    def echoed_request_id(self) -> str | None:
        if self.headers is None:
            return None
        value: str | None = self.headers.get(self.request_id_header)
        return value

    def describe(self) -> str:
        return str(self.status) if self.status is not None else f"no response ({self.error})"

    def evidence(self) -> dict[str, Any]:
        text = self.body.decode("utf-8", errors="replace")
        kept: dict[str, str] = {}
        if self.headers is not None:
            for name in (self.request_id_header, "idempotent-replayed", "retry-after"):
                if name in self.headers:
                    kept[name] = clean_message(self.headers[name], 200)
        return {
            "key": self.key,
            "request_id_sent": self.request_id,
            "status": self.status,
            "body": text[:_BODY_EVIDENCE_CHARS] + ("…" if len(text) > _BODY_EVIDENCE_CHARS else ""),
            "headers": kept,
            "error": self.error,
        }


class _Prober:
    def __init__(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        *,
        method: str,
        path: str,
        tenant: str,
    ) -> None:
        self.client = client
        self.endpoint = endpoint
        self.method = method
        self.path = path
        self.tenant = tenant

    async def send(self, key: str, body: bytes) -> _Probe:
        request_id = str(uuid.uuid4())
        try:
            headers = request_headers(
                self.endpoint,
                stored_headers={},
                operation_id=key,
                request_id=request_id,
                tenant=self.tenant,
                has_body=True,
            )
        except Exception as exc:  # a tenant_auth that does not know a probe tenant
            error = clean_message(f"could not build the request: {type(exc).__name__}: {exc}")
            return _Probe(key, request_id, None, b"", None, error, self.endpoint.request_id_header)
        response: httpx.Response | None = None
        try:
            async with asyncio.timeout(self.endpoint.timeout):
                request = self.client.build_request(
                    self.method, self.path, headers=headers, content=body
                )
                response = await self.client.send(request, stream=True)
                try:
                    read = await read_body(response, keep=_MAX_BODY, limit=_MAX_BODY)
                finally:
                    await response.aclose()
        except Exception as exc:
            error = (
                f"no complete response within {self.endpoint.timeout}s"
                if isinstance(exc, TimeoutError)
                else clean_message(f"{type(exc).__name__}: {exc}")
            )
            return _Probe(key, request_id, None, b"", None, error, self.endpoint.request_id_header)
        return _Probe(
            key,
            request_id,
            response.status_code,
            read.head,
            response.headers,
            None,
            self.endpoint.request_id_header,
        )

    async def lookup(self, key: str) -> LookupResult | None:
        if self.endpoint.status_lookup is None:
            return None
        return await lookup_status(self.client, self.endpoint, key, self.tenant)


def changed_payload(body: Any) -> tuple[Any, str]:
    """The same request with one argument changed, and what was changed.

    The first number is incremented, else the first string extended, else a field is
    added: the request stays as plausible as possible, so a refusal is about the key.
    """
    if isinstance(body, dict):
        for name, value in body.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                return {**body, name: value + 1}, f"{name}: {value!r} -> {value + 1!r}"
        for name, value in body.items():
            if isinstance(value, str):
                return {**body, name: value + "-changed"}, f"{name}: {value!r} -> changed"
        return {**body, "outbox_probe_variant": "changed"}, "added field outbox_probe_variant"
    if isinstance(body, list):
        return [*body, "outbox-probe-changed"], "appended an element"
    return {"value": body, "outbox_probe_variant": "changed"}, "wrapped the body in an object"


def _canonical_bytes(value: Any) -> bytes:
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise ValidationError(f"the probe body must be JSON: {exc}") from exc


def _probe_key() -> str:
    return PROBE_PREFIX + uuid.uuid4().hex


@dataclass
class _Observed:
    first: _Probe
    again: _Probe
    changed: _Probe
    changed_how: str
    other_key: _Probe
    burst: list[_Probe]
    burst_after: _Probe
    retained_first: _Probe
    retained_again: _Probe
    delay: float
    lookups: dict[str, LookupResult | None]
    tenant_probes: tuple[_Probe, _Probe] | None = None
    replay_status: int | None = None

    @property
    def discriminating(self) -> bool:
        """Do results identify the effect (a new key got a different result)?"""
        return self.first.ok and self.other_key.ok and self.first.result != self.other_key.result

    def replayed(self, probe: _Probe) -> bool:
        """A 2xx, or the status the endpoint declares its replays come with (and a body
        the outbox would read as a replay)."""
        if probe.ok:
            return True
        if probe.status is None or probe.status != self.replay_status:
            return False
        return _reading(probe, self.replay_status) is Verdict.SUCCESS


def _reading(probe: _Probe, replay_status: int | None = None) -> Verdict | None:
    """How the dispatcher's default rules would read this answer."""
    if probe.status is None:
        return None
    response = httpx.Response(probe.status, headers=probe.headers, content=probe.body)
    return classify_response(
        response, probe.body, int(time.time() * 1000), replay_status=replay_status
    ).verdict


def _lookup_evidence(result: LookupResult | None) -> dict[str, Any] | None:
    if result is None:
        return None
    return {
        "status": result.status.value,
        "http_status": result.http_status,
        "detail": result.detail,
        "path": result.path,
    }


_NOT_ACCEPTED = (
    "the first probe was not accepted ({status}), so nothing could be checked: "
    "fix --path, --method or --json-body"
)


def _same_key(o: _Observed) -> CheckVerdict:
    name = "same_key_same_result"
    lookup = o.lookups.get("same_key")
    evidence = {
        "first": o.first.evidence(),
        "second": o.again.evidence(),
        "status_lookup": _lookup_evidence(lookup),
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
    if lookup is not None and lookup.status is LookupStatus.APPLIED:
        return CheckVerdict(
            name,
            True,
            "the same result twice, and the receiver's status lookup holds one applied "
            "operation under the key",
            evidence,
        )
    if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
        return CheckVerdict(
            name,
            False,
            "the same result twice, but the status lookup has no record of the key: the "
            "receiver does not keep a receipt for it",
            evidence,
        )
    why = (
        "no status_lookup is configured"
        if lookup is None
        else f"the status lookup could not tell ({lookup.detail})"
    )
    if o.discriminating:
        return CheckVerdict(
            name,
            True,
            f"the same result twice (results identify effects: a new key got a different "
            f"one); could not count effects ({why})",
            evidence,
        )
    return CheckVerdict(
        name,
        None,
        f"the same result twice, but results do not identify effects (a new key got an "
        f"equal one) and {why}: could not count effects",
        evidence,
    )


def _changed(o: _Observed) -> CheckVerdict:
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
        seen = _reading(o.changed, o.replay_status)
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
            "knows (see the README's classification table, or give the endpoint classify=)",
            evidence,
        )
    return CheckVerdict(
        name,
        None,
        f"the same key with a changed payload got {status}: could not tell whether it was "
        "refused or failed",
        evidence,
    )


def _other_key(o: _Observed) -> CheckVerdict:
    name = "new_key_new_operation"
    lookup = o.lookups.get("new_key")
    evidence = {
        "first": o.first.evidence(),
        "new_key": o.other_key.evidence(),
        "status_lookup": _lookup_evidence(lookup),
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
        if lookup is not None and lookup.status is LookupStatus.APPLIED:
            return CheckVerdict(
                name,
                True,
                "a new key with the same payload got an equal result, and the status lookup "
                "holds it as an operation of its own",
                evidence,
            )
        if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
            return CheckVerdict(
                name,
                False,
                "a new key with the same payload got the first result and the status lookup "
                "has no record of it: the receiver deduplicates by payload, so two intents "
                "with equal arguments would be one",
                evidence,
            )
        return CheckVerdict(
            name,
            None,
            "a new key with the same payload got an equal result: either results do not "
            "identify effects or the receiver deduplicates by payload; could not tell",
            evidence,
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


def _cached_ids(o: _Observed) -> list[dict[str, Any]]:
    """Burst answers echoing another request's ID rather than their own."""
    sent = {p.request_id for p in o.burst}
    return [
        {"sent": p.request_id, "echoed": p.echoed_request_id}
        for p in o.burst
        if p.echoed_request_id is not None
        and p.echoed_request_id != p.request_id
        and p.echoed_request_id in sent
    ]


def _request_id(o: _Observed, same_key: CheckVerdict) -> CheckVerdict:
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
    if echoed_again is None and echoed_first == o.first.request_id:
        return CheckVerdict(
            name,
            False,
            f"no {header} on the replay, although the first answer echoed the caller's: "
            "a replay cannot be tied to the attempt that received it",
            evidence,
        )
    if echoed_again is None:
        return CheckVerdict(
            name,
            None,
            f"no {header} on the replay (nor on the first answer): the receiver does not "
            "echo it, so could not tell",
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


def _burst(o: _Observed) -> CheckVerdict:
    name = "concurrent_duplicates"
    lookup = o.lookups.get("burst")
    statuses = Counter(p.status if p.status is not None else "no response" for p in o.burst)
    results = Counter(p.result for p in o.burst if p.ok)
    after = o.burst_after
    evidence = {
        "requests": len(o.burst),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "distinct_results": len(results),
        "results": [r[:_BODY_EVIDENCE_CHARS] for r in results],
        "after": o.burst_after.evidence(),
        "status_lookup": _lookup_evidence(lookup),
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
    if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
        return CheckVerdict(
            name,
            False,
            f"{n} concurrent requests got one result ({tally}), but the status lookup has no "
            "record of the key",
            evidence,
        )
    if (lookup is not None and lookup.status is LookupStatus.APPLIED) or o.discriminating:
        return CheckVerdict(
            name, True, f"{n} concurrent requests with one key got one result ({tally})", evidence
        )
    return CheckVerdict(
        name,
        None,
        f"{n} concurrent requests got one result ({tally}), but results do not identify "
        "effects and there is no status lookup: could not count effects",
        evidence,
    )


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def _retained(o: _Observed, endpoint: Endpoint) -> CheckVerdict:
    name = "key_retained"
    lookup = o.lookups.get("retained")
    first, again = o.retained_first, o.retained_again
    hint = (
        "a hint only: the endpoint assumes keys are kept "
        f"{_duration(endpoint.key_retention.total_seconds())}"
    )
    evidence = {
        "delay_seconds": o.delay,
        "first": first.evidence(),
        "after_delay": again.evidence(),
        "status_lookup_before_resend": _lookup_evidence(lookup),
    }
    if not first.ok:
        return CheckVerdict(name, None, _NOT_ACCEPTED.format(status=first.describe()), evidence)
    if o.replayed(again) and again.result != first.result:
        return CheckVerdict(
            name,
            False,
            f"after {o.delay:g}s the same key and payload got a different result: the "
            f"receiver forgot the key and applied it again ({hint})",
            evidence,
        )
    if lookup is not None and lookup.status is LookupStatus.NOT_APPLIED:
        return CheckVerdict(
            name,
            False,
            f"after {o.delay:g}s the status lookup no longer knows the key ({hint})",
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
    if (lookup is not None and lookup.status is LookupStatus.APPLIED) or o.discriminating:
        return CheckVerdict(
            name, True, f"the key was still honoured after {o.delay:g}s ({hint})", evidence
        )
    return CheckVerdict(
        name,
        None,
        f"the same result after {o.delay:g}s, but results do not identify effects and there "
        f"is no status lookup: could not tell ({hint})",
        evidence,
    )


def _tenants(o: _Observed, endpoint: Endpoint) -> CheckVerdict:
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
    if b.status is not None and 400 <= b.status < 500 and _reading(b) is not Verdict.FAILED:
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


async def check_receiver_async(
    outbox: Outbox,
    *,
    endpoint: str,
    path: str,
    json_body: Any,
    method: str = "POST",
    tenant: str = "",
    retention_delay: float = 2.0,
    concurrency: int = 8,
    allow_unsafe: bool = False,
    strict: bool = False,
    probe_tenants: tuple[str, str] = PROBE_TENANTS,
) -> CheckReport:
    """:func:`check_receiver` for callers already inside an event loop."""
    ep = outbox.endpoints.get(endpoint)
    if ep is None:
        raise ConfigurationError(
            f"unknown endpoint {endpoint!r}; registered: {sorted(outbox.endpoints)}"
        )
    if not ep.probe_safe and not allow_unsafe:
        raise UnsafeProbeRefused(
            f"endpoint {endpoint!r} is not marked probe_safe=True: the checker sends real "
            "operations that create real effects on the receiver. Point it at a staging or "
            "test receiver and mark that endpoint probe_safe=True, or pass "
            "--i-understand-this-sends-real-requests (library: allow_unsafe=True)."
        )
    if not path.startswith("/"):
        raise ValidationError(f"the probe path must start with '/', got {path!r}")
    if not method.isalpha():
        raise ValidationError(f"not an HTTP method: {method!r}")
    if retention_delay < 0:
        raise ValidationError("the retention delay must be >= 0 seconds")
    if concurrency < 2:
        raise ValidationError("concurrency must be at least 2")
    if len(probe_tenants) != 2 or probe_tenants[0] == probe_tenants[1]:
        raise ValidationError("probe_tenants must be two different tenants")
    for probe_tenant in probe_tenants:
        check_tenant(probe_tenant)
    method = method.upper()
    body = _canonical_bytes(json_body)
    changed, changed_how = changed_payload(json_body)
    changed_body = _canonical_bytes(changed)
    keys = {
        "same_key": _probe_key(),
        "new_key": _probe_key(),
        "burst": _probe_key(),
        "retained": _probe_key(),
    }
    if ep.tenant_scope is not None:
        keys["tenants"] = _probe_key()
    factory = outbox.transport_factory
    async with build_client(ep, factory(ep) if factory else None) as client:
        p = _Prober(client, ep, method=method, path=path, tenant=tenant)
        # The retention probe goes first; its delay runs while the other checks do.
        retained_first = await p.send(keys["retained"], body)
        retained_sent = time.monotonic()
        first = await p.send(keys["same_key"], body)
        again = await p.send(keys["same_key"], body)
        changed_probe = await p.send(keys["same_key"], changed_body)
        other = await p.send(keys["new_key"], body)
        burst = list(
            await asyncio.gather(*(p.send(keys["burst"], body) for _ in range(concurrency)))
        )
        burst_after = await p.send(keys["burst"], body)
        tenant_probes: tuple[_Probe, _Probe] | None = None
        if "tenants" in keys:
            a, b = (
                _Prober(client, ep, method=method, path=path, tenant=t) for t in probe_tenants
            )
            tenant_probes = (
                await a.send(keys["tenants"], body),
                await b.send(keys["tenants"], body),
            )
        lookups: dict[str, LookupResult | None] = {}
        for name in ("same_key", "new_key", "burst"):
            lookups[name] = await p.lookup(keys[name])
        remaining = retention_delay - (time.monotonic() - retained_sent)
        if remaining > 0:
            await asyncio.sleep(remaining)
        lookups["retained"] = await p.lookup(keys["retained"])
        retained_again = await p.send(keys["retained"], body)
    observed = _Observed(
        first=first,
        again=again,
        changed=changed_probe,
        changed_how=changed_how,
        other_key=other,
        burst=burst,
        burst_after=burst_after,
        retained_first=retained_first,
        retained_again=retained_again,
        delay=retention_delay,
        lookups=lookups,
        tenant_probes=tenant_probes,
        replay_status=ep.replay_status,
    )
    same_key = _same_key(observed)
    verdicts = (
        same_key,
        _changed(observed),
        _other_key(observed),
        _request_id(observed, same_key),
        _burst(observed),
        _retained(observed, ep),
        _tenants(observed, ep),
    )
    return CheckReport(
        endpoint=ep.name,
        base_url=ep.base_url,
        method=method,
        path=path,
        tenant=tenant,
        verdicts=verdicts,
        probe_keys=tuple(keys.values()),
        retention_delay_seconds=retention_delay,
        strict=strict,
    )


def check_receiver(
    outbox: Outbox,
    *,
    endpoint: str,
    path: str,
    json_body: Any,
    method: str = "POST",
    tenant: str = "",
    retention_delay: float = 2.0,
    concurrency: int = 8,
    allow_unsafe: bool = False,
    strict: bool = False,
    probe_tenants: tuple[str, str] = PROBE_TENANTS,
) -> CheckReport:
    """Probe ``endpoint``'s receiver and report one verdict per idempotency property.

    Sends about ``concurrency + 7`` requests with fresh ``outbox-probe-`` keys (and a
    few status lookups when the endpoint has a ``status_lookup``); takes at least
    ``retention_delay`` seconds. Nothing is written to the outbox's database. Raises
    :class:`UnsafeProbeRefused`, before sending anything, for an endpoint not marked
    ``probe_safe`` unless ``allow_unsafe``; :class:`ConfigurationError` for an unknown
    endpoint; :class:`ValidationError` for a bad path, method or body.
    """
    return asyncio.run(
        check_receiver_async(
            outbox,
            endpoint=endpoint,
            path=path,
            json_body=json_body,
            method=method,
            tenant=tenant,
            retention_delay=retention_delay,
            concurrency=concurrency,
            allow_unsafe=allow_unsafe,
            strict=strict,
            probe_tenants=probe_tenants,
        )
    )
