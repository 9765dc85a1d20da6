"""What a receiver check reports: one verdict per property, and the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.classify import REPLAY_HEADERS

if TYPE_CHECKING:
    pass

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
    #: False: the property cannot be seen in what the probes can read (the effects
    #: behind answers that look right, with nothing to count them by); never a PASS.
    observed: bool = True

    def __post_init__(self) -> None:
        if not self.observed and self.passed is not None:
            raise ValueError("a property that was not observed is neither passed nor failed")

    @property
    def title(self) -> str:
        return CHECKS.get(self.name, self.name)

    @property
    def outcome(self) -> str:
        """``pass``, ``fail``, ``not_observed`` or ``could_not_tell``."""
        if self.passed is True:
            return "pass"
        if self.passed is False:
            return "fail"
        return "could_not_tell" if self.observed else "not_observed"

    @property
    def mark(self) -> str:
        return {"pass": "PASS", "fail": "FAIL", "not_observed": "N/O ", "could_not_tell": "????"}[
            self.outcome
        ]

    @property
    def rests_on(self) -> list[str]:
        """What the verdict rests on, in plain words: each request sent (its request ID)
        and its answer, the status lookup asked (or that there is none), what was
        compared."""
        return evidence_basis(self.evidence)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "passed": self.passed,
            "outcome": self.outcome,
            "observed": self.observed,
            "summary": self.summary,
            "rests_on": self.rests_on,
            "evidence": self.evidence,
        }


_LABELS = {
    "first": "first request",
    "second": "same key again",
    "changed": "same key, changed payload",
    "new_key": "new key",
    "after": "same key after the burst",
    "after_delay": "same key after the delay",
    "tenant_a": "tenant A",
    "tenant_b": "tenant B",
}


_REPLAY_HEADERS = frozenset(h.lower() for h in REPLAY_HEADERS)


def _probe_words(label: str, probe: dict[str, Any]) -> str:
    answer = probe.get("status") or f"no response ({probe.get('error')})"
    words = f"{_LABELS.get(label, label)}: request {probe.get('request_id_sent')} got {answer}"
    headers = probe.get("headers") or {}
    if any(
        h.lower() in _REPLAY_HEADERS and str(v).strip().lower() in ("true", "1", "yes")
        for h, v in headers.items()
    ):
        words += ", marked as a replay"
    return words


def evidence_basis(evidence: dict[str, Any]) -> list[str]:
    """The evidence of a verdict (:attr:`CheckVerdict.evidence`) as plain lines."""
    out: list[str] = []
    for name, value in evidence.items():
        if isinstance(value, dict) and "request_id_sent" in value:
            out.append(_probe_words(name, value))
        elif name.startswith("status_lookup"):
            out.append(
                "status lookup: none configured, so effects were not counted"
                if value is None
                else f"status lookup: {value.get('status')} ({value.get('http_status')}, "
                f"{value.get('detail')})"
            )
    if "statuses" in evidence:
        out.append(
            f"{evidence.get('requests')} concurrent requests: statuses {evidence['statuses']}, "
            f"{evidence.get('distinct_results')} distinct 2xx results compared"
        )
    if "change" in evidence:
        out.append(f"changed: {evidence['change']}")
    if "outbox_classifies_as" in evidence:
        out.append(f"the outbox reads the answer as {evidence['outbox_classifies_as']}")
    if "declared_retention_seconds" in evidence:
        out.append(f"declared retention: {evidence['declared_retention_seconds']}s")
    if "replay_sent" in evidence:
        header = evidence.get("header")
        out.append(
            f"{header}: first sent {evidence.get('first_sent')}, echoed "
            f"{evidence.get('first_echoed')}; replay sent {evidence.get('replay_sent')}, "
            f"echoed {evidence.get('replay_echoed')}"
        )
    if "compared" in evidence:
        out.append(f"compared: {evidence['compared']}")
    return out


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
    #: What the answers had in common, when the run decided nothing (see ``cause_of``).
    cause: str | None = None
    #: The probe body's form as sent: ``json``, ``form`` or ``raw``, and its media type.
    body_kind: str = "json"
    content_type: str = "application/json"

    @property
    def decided_nothing(self) -> bool:
        """Every verdict undecided: the run proved nothing, a failure even unstrict."""
        return bool(self.verdicts) and all(v.passed is None for v in self.verdicts)

    @property
    def ok(self) -> bool:
        """No verdict failed (some may be undecided; none, with ``strict``), and at
        least one was decided."""
        if self.decided_nothing or (self.strict and self.undecided):
            return False
        return all(v.passed is not False for v in self.verdicts)

    @property
    def failed(self) -> list[str]:
        return [v.name for v in self.verdicts if v.passed is False]

    @property
    def undecided(self) -> list[str]:
        return [v.name for v in self.verdicts if v.passed is None]

    @property
    def not_observed(self) -> list[str]:
        """Undecided because the property cannot be seen in the answers (a subset of
        :attr:`undecided`)."""
        return [v.name for v in self.verdicts if not v.observed]

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
            "body_kind": self.body_kind,
            "content_type": self.content_type,
            "ok": self.ok,
            "strict": self.strict,
            "decided_nothing": self.decided_nothing,
            "cause": self.cause,
            "failed": self.failed,
            "undecided": self.undecided,
            "not_observed": self.not_observed,
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
            f"{self.method} {self.path}"
            + (f", tenant {self.tenant!r}" if self.tenant else "")
            + (
                f", {self.body_kind} body ({self.content_type})" if self.body_kind != "json" else ""
            ),
        ]
        for v in self.verdicts:
            out.append(f"{v.mark}  {v.name:<{width}}  {v.summary}")
            out += [f"{'':4}  {'':<{width}}    rests on: {line}" for line in v.rests_on]
        passed = sum(1 for v in self.verdicts if v.passed is True)
        unseen = len(self.not_observed)
        out.append(
            f"{passed} passed, {len(self.failed)} failed, {len(self.undecided) - unseen} could "
            f"not tell, {unseen} not observed (N/O); probe keys: {', '.join(self.probe_keys)}"
        )
        if self.decided_nothing:
            out.append(
                "FAILED: the run decided nothing" + (f": {self.cause}" if self.cause else "")
            )
        out.append(f"NOTE: {self.notice}")
        return out


def cause_of(statuses: list[tuple[int | None, bytes, str | None]]) -> str | None:
    """What every probe answer had in common, in the receiver's words: ``(status, body,
    error)`` of each probe. None when they differ."""
    if not statuses:
        return None
    kinds = {(status, error if status is None else None) for status, _, error in statuses}
    if len(kinds) != 1:
        return None
    status, body, error = statuses[0]
    if status is None:
        return f"no probe got an answer ({error}): is the receiver running at this URL?"
    if 200 <= status < 300:
        return None
    words = _answer_words(body)
    said = f" {words}" if words else ""
    hint = ""
    if status in (400, 422) and any(w in words.lower() for w in ("uuid", "key", "format")):
        hint = ": the probe keys may break the receiver's key format (declare key_pattern)"
    elif status in (401, 403):
        hint = ": the probes are not authorised (the endpoint's auth)"
    elif status == 404:
        hint = ": check --path"
    elif status == 405:
        hint = ": check --method"
    return f"every probe was refused {status}{said}{hint}"


def _answer_words(body: bytes) -> str:
    import json

    try:
        data = json.loads(body) if body else None
    except ValueError:
        return body[:80].decode("utf-8", errors="replace").strip()
    found: list[str] = []
    stack = [data]
    while stack and len(found) < 3:
        item = stack.pop(0)  # breadth first, codes before messages
        if isinstance(item, dict):
            keys = ("errors", "error", "error_code", "code", "type", "message", "detail")
            stack.extend(item.get(k) for k in keys)
        elif isinstance(item, list):
            stack.extend(item[:4])
        elif isinstance(item, str):
            found.append(item)
    return " ".join(found)[:160]
