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
