"""The last hour as the console's overview draws it: the reconciliation queue's size
minute by minute, and each endpoint's attempt latency. Computed here once, from the
tables (SQL in :mod:`outbox.store.monitoring`), so every view that shows them agrees.

The queue's past size is not stored; it is derived, honestly, from what the tables keep:

* **now**: the operations unresolved now;
* **entries**: an unresolved operation's ``updated_at`` is its entry into the queue
  (nothing changes an unresolved operation but taking it out), so one that entered
  after a minute's end was not in the queue then;
* **exits**: every way out of the queue (resolve, requeue, a probe's settlement) writes
  an audit row ``from_state = unresolved``; an operation that left after a minute's end
  was in the queue then, *if* it had entered by then. Its entry is no longer on its row
  (the row has moved on), so the end of its last attempt before it left stands for it
  (the attempt that put it there; for a deadline that passed later, an earlier time, so
  the chart may show such an operation in the queue a little early). An operation that
  left and was never attempted (or whose row was purged since) counts from the start of
  the hour.

So ``size(t) = now - entered after t + left after t (having entered by t)``, exact for
every operation still in the queue and for every departure whose entry was an attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox.store import monitoring

if TYPE_CHECKING:
    from outbox.reconcile.parts import OutboxParts

HOUR_MS = 3_600_000
MINUTES = 60
#: Upper bounds (ms) of the latency histogram's buckets; one more holds the rest.
LATENCY_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 30_000)


@dataclass(frozen=True)
class QueueHistory:
    """The reconciliation queue's size at the end of each minute of the last hour,
    oldest first; the last is the size now (``Figures.reconciliation_queue``)."""

    now_ms: int
    sizes: list[int]

    def as_dict(self) -> dict[str, Any]:
        return {"now_ms": self.now_ms, "sizes": self.sizes}


@dataclass(frozen=True)
class EndpointLatency:
    """An endpoint's attempts started in the last hour with a duration: how many, their
    mean and maximum, and percentiles read from the histogram (each the upper bound of
    the bucket it falls in, never above the maximum seen)."""

    endpoint: str
    count: int
    mean_ms: float
    max_ms: int
    p50_ms: int
    p95_ms: int
    p99_ms: int
    #: Attempts per bucket of :data:`LATENCY_BOUNDS_MS` (the last: above them all).
    buckets: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "count": self.count, "mean_ms": self.mean_ms,
            "max_ms": self.max_ms, "p50_ms": self.p50_ms, "p95_ms": self.p95_ms,
            "p99_ms": self.p99_ms, "buckets": self.buckets,
        }  # fmt: skip


def queue_history(outbox: OutboxParts, *, now_ms: int) -> QueueHistory:
    """See the module's note for how the past sizes are derived."""
    since = now_ms - HOUR_MS
    now, entries = monitoring.queue_entries(outbox.store, since_ms=since)
    exits = monitoring.queue_exits(outbox.store, since_ms=since)
    sizes = []
    for i in range(MINUTES - 1):
        end = since + (i + 1) * 60_000  # the end of minute i
        # An entry in minute m is at or after m's start: after ``end`` when m > i.
        entered_after = sum(n for minute, n in entries if minute > i)
        left_after = sum(
            1 for at, entered in exits if at > end and (entered is None or entered <= end)
        )
        sizes.append(max(0, now - entered_after + left_after))
    sizes.append(now)  # the end of the last minute is now
    return QueueHistory(now_ms, sizes)


def _percentile(buckets: list[int], count: int, q: float, top: int) -> int:
    wanted = q * count
    seen = 0
    for i, n in enumerate(buckets):
        seen += n
        if n and seen >= wanted:
            bound = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else top
            return min(bound, top)
    return top


def _empty() -> dict[str, Any]:
    return {"buckets": [0] * (len(LATENCY_BOUNDS_MS) + 1), "total": 0, "top": 0}


def endpoint_latency(outbox: OutboxParts, *, now_ms: int) -> list[EndpointLatency]:
    """Each endpoint's attempt latency over the last hour, by endpoint name; every
    registered endpoint is named (with no attempts: count 0)."""
    rows = monitoring.latency_histogram(
        outbox.store, since_ms=now_ms - HOUR_MS, bounds_ms=LATENCY_BOUNDS_MS
    )
    per: dict[str, dict[str, Any]] = {name: _empty() for name in outbox.endpoints}
    for endpoint, bucket, n, total, top in rows:
        e = per.setdefault(endpoint, _empty())
        e["buckets"][bucket] += n
        e["total"] += total
        e["top"] = max(e["top"], top)
    out = []
    for name, e in sorted(per.items()):
        count, top = sum(e["buckets"]), e["top"]
        out.append(
            EndpointLatency(
                endpoint=name,
                count=count,
                mean_ms=round(e["total"] / count, 1) if count else 0.0,
                max_ms=top,
                p50_ms=_percentile(e["buckets"], count, 0.50, top),
                p95_ms=_percentile(e["buckets"], count, 0.95, top),
                p99_ms=_percentile(e["buckets"], count, 0.99, top),
                buckets=e["buckets"],
            )
        )
    return out
