"""The parts of ``outbox status`` that watch the dispatchers and the backlog.

Dispatchers are *live* when their heartbeat is younger than the dispatcher timeout,
*stopped* when they exited gracefully, and *lost* when they went silent without
stopping (killed, crashed, frozen, or cut off from the database).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from outbox.model import ms_to_iso
from outbox.store import monitoring

if TYPE_CHECKING:
    from outbox.reconcile.parts import OutboxParts

#: A dispatcher silent for longer than this is listed as lost (``--dispatcher-timeout``).
DEFAULT_DISPATCHER_TIMEOUT = timedelta(seconds=30)
#: How far before key expiry an operation counts as "near" it.
NEAR_EXPIRY = timedelta(hours=1)


@dataclass(frozen=True)
class DispatcherInfo:
    """One dispatcher as ``outbox status`` shows it."""

    row: monitoring.DispatcherRow
    #: live | stopped | lost
    state: str
    last_seen_seconds_ago: float

    def as_dict(self) -> dict[str, Any]:
        r = self.row
        return {
            "id": r.id,
            "state": self.state,
            "host": r.host,
            "pid": r.pid,
            "version": r.version,
            "concurrency": r.concurrency,
            "in_flight": r.in_flight,
            "started_at": ms_to_iso(r.started_at_ms),
            "last_seen_at": ms_to_iso(r.last_seen_at_ms),
            "last_seen_seconds_ago": round(self.last_seen_seconds_ago, 3),
            "stopped_at": ms_to_iso(r.stopped_at_ms),
            "wake_mode": r.wake_mode,
        }


@dataclass(frozen=True)
class Watch:
    """Dispatchers, per-endpoint backlog and last hour's attempts by outcome."""

    dispatchers: list[DispatcherInfo]
    backlog: monitoring.Backlog
    #: (delivery, verdict, count) of the attempts started in the last hour.
    attempts_by_outcome: list[tuple[str, str, int]] = field(default_factory=list)

    @property
    def live(self) -> list[DispatcherInfo]:
        return [d for d in self.dispatchers if d.state == "live"]

    def endpoints_dict(self) -> dict[str, Any]:
        now = self.backlog.now_ms
        return {
            name: {
                "due": e.due,
                "oldest_due_age_seconds": None
                if e.oldest_due_at_ms is None
                else max(0.0, (now - e.oldest_due_at_ms) / 1000),
                "pending": e.pending,
                "in_flight": e.in_flight,
                "unresolved": e.unresolved,
                "near_key_expiry": e.near_expiry,
                "unsendable": e.unsendable,
            }
            for name, e in sorted(self.backlog.endpoints.items())
        }

    def attempts_dict(self) -> dict[str, Any]:
        total = sum(n for _, _, n in self.attempts_by_outcome)
        good = sum(n for _, verdict, n in self.attempts_by_outcome if verdict == "success")
        return {
            "total": total,
            "by_outcome": [
                {"delivery": d, "verdict": v, "count": n} for d, v, n in self.attempts_by_outcome
            ],
            # Attempts that did not succeed, of those started: a rate a person can read.
            "not_succeeded_ratio": None if total == 0 else round((total - good) / total, 4),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "dispatchers": [d.as_dict() for d in self.dispatchers],
            "live_dispatchers": len(self.live),
            "endpoints": self.endpoints_dict(),
            "due": self.backlog.due,
            "unsendable": self.backlog.unsendable,
            "attempts_last_hour_by_outcome": self.attempts_dict(),
        }


def near_expiry_cutoffs(
    outbox: OutboxParts, now_ms: int, near: timedelta = NEAR_EXPIRY
) -> dict[str, int]:
    """Per registered endpoint: first attempts before this put the key near expiry."""
    return {
        name: now_ms - int((e.key_retention - near).total_seconds() * 1000)
        for name, e in outbox.endpoints.items()
    }


def watch(outbox: OutboxParts, *, now_ms: int, dispatcher_timeout: timedelta) -> Watch:
    timeout_ms = dispatcher_timeout.total_seconds() * 1000
    infos = []
    for row in monitoring.list_dispatchers(outbox.store):
        silent_ms = now_ms - row.last_seen_at_ms
        if row.stopped_at_ms is not None:
            state = "stopped"
        elif silent_ms > timeout_ms:
            state = "lost"
        else:
            state = "live"
        infos.append(DispatcherInfo(row, state, max(0.0, silent_ms / 1000)))
    return Watch(
        dispatchers=infos,
        backlog=monitoring.backlog(
            outbox.store,
            now_ms=now_ms,
            near_expiry_before_ms=near_expiry_cutoffs(outbox, now_ms),
        ),
        attempts_by_outcome=monitoring.attempts_by_outcome(
            outbox.store, since_ms=now_ms - 3_600_000
        ),
    )
