"""What a receiver check reports: one verdict per property, and the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
        out += [f"{v.mark}  {v.name:<{width}}  {v.summary}" for v in self.verdicts]
        passed = sum(1 for v in self.verdicts if v.passed is True)
        out.append(
            f"{passed} passed, {len(self.failed)} failed, {len(self.undecided)} could not "
            f"tell; probe keys: {', '.join(self.probe_keys)}"
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
