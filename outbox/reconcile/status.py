"""The parts of ``outbox status`` that watch the dispatchers and the backlog.

Dispatchers are *live* when their heartbeat is younger than the dispatcher timeout,
*stopped* when they exited gracefully, and *lost* when they went silent without
stopping (killed, crashed, frozen, or cut off from the database).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from outbox.model import LIVE_STATES, Reason, State, ms_to_iso
from outbox.store import monitoring
from outbox.store.limits import effective_rate

if TYPE_CHECKING:
    from collections.abc import Mapping

    from outbox.config import Endpoint
    from outbox.reconcile.parts import OutboxParts
    from outbox.store.endpoints import EndpointState

#: A dispatcher silent for longer than this is listed as lost (``--dispatcher-timeout``).
DEFAULT_DISPATCHER_TIMEOUT = timedelta(seconds=30)
#: How far before key expiry an operation counts as "near" it.
NEAR_EXPIRY = timedelta(hours=1)
#: ``outbox status`` counts the settled operations only up to this many (more: not
#: counted, ``Figures.settled_over``), so its cost stays bounded however long the
#: history; ``outbox status --settled`` counts them all.
SETTLED_COUNT_LIMIT = 10_000


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
class EndpointFigures:
    """One endpoint's live operations, as every view shows them."""

    pending: int = 0
    in_flight: int = 0
    unresolved: int = 0
    #: Pending, or in flight past their lease, and due now.
    due: int = 0
    #: How long the longest-waiting due operation has been due (None: nothing due).
    oldest_due_age_seconds: float | None = None
    #: Live, attempted operations whose key the receiver forgets within the window.
    near_key_expiry: int = 0
    #: Live, attempted operations whose key the receiver has already forgotten.
    key_expired: int = 0
    #: Live, attempted operations without a policy snapshot (retention unknown).
    key_retention_unknown: int = 0
    #: Pending operations no dispatcher can send now.
    unsendable: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class EndpointLimits:
    """One endpoint's rate and in-flight limits as every view shows them (``outbox
    status``, ``outbox endpoint list``, the console's endpoints page, ``/metrics``):
    what it declares, known when the endpoint is registered with this outbox, and the
    fleet's throttle, read from ``outbox_endpoints`` (:func:`endpoint_limits`)."""

    name: str
    #: Registered with this outbox: its declared limits are known (else they read None).
    registered: bool = False
    #: ``Endpoint.rate_limit``, requests per second (None: none declared).
    rate_limit: float | None = None
    #: ``Endpoint.max_in_flight`` (None: none declared).
    max_in_flight: int | None = None
    #: ``Endpoint.throttle`` is on (None: not known, the endpoint is not registered).
    throttle_enabled: bool | None = None
    #: The fleet's throttle while 429/503 answers hold it, requests per second; None:
    #: not throttled.
    throttle_rate: float | None = None
    #: Epoch ms of the throttle's last change (set, cut, raised or lifted).
    rate_changed_at: int | None = None
    #: Epoch ms of the last refusal (429/503) that reached the throttle.
    refused_at: int | None = None

    @property
    def throttled(self) -> bool:
        """The adaptive throttle is engaged: the fleet sends at its rate."""
        return self.throttle_rate is not None

    @property
    def rate(self) -> float | None:
        """The fleet's current rate limit, requests per second: the lower of the declared
        one and the throttle's (the rule the dispatchers keep); None: nothing limits it."""
        return effective_rate(self.rate_limit, self.throttle_rate)

    def as_dict(self) -> dict[str, object]:
        """Its fields but ``name`` (times in ISO 8601), ``rate`` and ``throttled``."""
        fields = dataclasses.asdict(self)
        del fields["name"]
        return {
            **fields,
            "rate": self.rate,
            "throttled": self.throttled,
            "rate_changed_at": ms_to_iso(self.rate_changed_at),
            "refused_at": ms_to_iso(self.refused_at),
        }


def endpoint_limits(
    name: str, state: EndpointState | None, endpoint: Endpoint | None
) -> EndpointLimits:
    """The limits of endpoint ``name``: its fleet ``state`` (the row of
    ``store.endpoint_states()``, None when it has none) and its registered ``endpoint``."""
    return EndpointLimits(
        name,
        registered=endpoint is not None,
        rate_limit=float(endpoint.rate_limit) if endpoint and endpoint.rate_limit else None,
        max_in_flight=endpoint.max_in_flight if endpoint is not None else None,
        throttle_enabled=endpoint.throttle is not None if endpoint is not None else None,
        throttle_rate=state.rate if state is not None else None,
        rate_changed_at=state.rate_changed_at if state is not None else None,
        refused_at=state.refused_at if state is not None else None,
    )


def limits_by_endpoint(
    states: list[EndpointState], endpoints: Mapping[str, Endpoint]
) -> dict[str, EndpointLimits]:
    """Every registered endpoint's and every fleet state row's limits, by name."""
    rows = {s.name: s for s in states}
    return {
        name: endpoint_limits(name, rows.get(name), endpoints.get(name))
        for name in sorted(set(rows) | set(endpoints))
    }


class _EndpointTotal:
    """A :class:`Figures` figure that is the sum of the :class:`EndpointFigures` field
    of its name over every endpoint."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    def __get__(self, figures: Figures, owner: type | None = None) -> int:
        return sum(int(getattr(e, self._name)) for e in figures.endpoints.values())


@dataclass(frozen=True)
class Figures:
    """Every operator figure, computed once (:func:`figures`) and rendered by each view:
    ``outbox status`` and ``status --check``, the console's overview and ``/metrics``.

    Live figures come from one query over the live rows (a partial index); the settled
    counts from a count over the state index, read only when asked for (``/metrics``
    does not). Key expiry is judged by the policy snapshot stored with each operation,
    so no view needs the application.
    """

    now_ms: int
    near_key_expiry_window: timedelta
    #: Operations by state, every state present. Settled states are None when not read.
    counts: dict[str, int | None]
    #: The reconciliation queue by reason, every reason present.
    unresolved_by_reason: dict[str, int]
    #: Every registered endpoint (with 0s) and every endpoint that has live operations.
    endpoints: dict[str, EndpointFigures]
    oldest_pending_age_seconds: float | None
    #: (delivery, verdict, count) of the attempts started in the last hour.
    attempts_by_outcome: list[tuple[str, str, int]] = field(default_factory=list)
    #: The last hour minute by minute, oldest first: 60 maps of outcome -> attempts
    #: started in that minute (outcomes: success, retry, failed, other). They add up to
    #: ``attempts_last_hour``.
    attempts_per_minute: list[dict[str, int]] = field(default_factory=list)
    #: Endpoint -> its fleet state: the circuit breaker's ("closed", "open",
    #: "half_open") or "paused" by an operator (``outbox_endpoints``). Every registered
    #: endpoint is named ("closed" until the fleet ever saw it fail).
    circuits: dict[str, str] = field(default_factory=dict)
    #: The same fleet state in detail, one row per endpoint that ever failed or was
    #: paused (:func:`endpoint_state_dict`): what ``outbox endpoint list`` prints.
    endpoint_states: list[EndpointState] = field(default_factory=list)
    #: Each endpoint's rate and in-flight limits and the fleet's throttle, from the same
    #: read (:func:`limits_by_endpoint`): registered endpoints and state rows.
    limits: dict[str, EndpointLimits] = field(default_factory=dict)
    #: The settled count's limit when more settled operations than it exist (their
    #: counts are then None, not read); None when counted, or not asked for.
    settled_over: int | None = None

    #: Totals over every endpoint's figures of the same name.
    due = _EndpointTotal()
    unsendable = _EndpointTotal()
    near_key_expiry = _EndpointTotal()
    key_expired = _EndpointTotal()
    key_retention_unknown = _EndpointTotal()

    @property
    def reconciliation_queue(self) -> int:
        return sum(self.unresolved_by_reason.values())

    @property
    def attempts_last_hour(self) -> int:
        return sum(n for _, _, n in self.attempts_by_outcome)

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts,
            "unresolved_by_reason": self.unresolved_by_reason,
            "reconciliation_queue": self.reconciliation_queue,
            "due": self.due,
            "unsendable": self.unsendable,
            "near_key_expiry_window_seconds": self.near_key_expiry_window.total_seconds(),
            "keys_near_expiry": self.near_key_expiry,
            "keys_expired": self.key_expired,
            "keys_retention_unknown": self.key_retention_unknown,
            "oldest_pending_age_seconds": self.oldest_pending_age_seconds,
            "attempts_last_hour": self.attempts_last_hour,
            "endpoints": {name: e.as_dict() for name, e in sorted(self.endpoints.items())},
            "attempts_per_minute": self.attempts_per_minute,
            "circuits": self.circuits,
            "limits": {name: e.as_dict() for name, e in self.limits.items()},
            "settled_over_limit": self.settled_over,
        }


def figures(
    outbox: OutboxParts,
    *,
    now_ms: int,
    near: timedelta = NEAR_EXPIRY,
    settled: bool = True,
    settled_limit: int | None = None,
) -> Figures:
    """The operator figures of ``outbox`` as of ``now_ms`` (see :class:`Figures`).

    ``settled_limit``: count the settled operations only if there are at most that
    many (see :func:`outbox.store.monitoring.settled_counts`)."""
    retention = {
        name: int(e.key_retention.total_seconds() * 1000) for name, e in outbox.endpoints.items()
    }
    snap = monitoring.backlog(
        outbox.store,
        now_ms=now_ms,
        near_ms=int(near.total_seconds() * 1000),
        retention_ms_by_endpoint=retention,
    )
    counts: dict[str, int | None] = {s.value: 0 if s in LIVE_STATES else None for s in State}
    for e in snap.endpoints.values():
        counts[State.PENDING.value] = (counts[State.PENDING.value] or 0) + e.pending
        counts[State.IN_FLIGHT.value] = (counts[State.IN_FLIGHT.value] or 0) + e.in_flight
        counts[State.UNRESOLVED.value] = (counts[State.UNRESOLVED.value] or 0) + e.unresolved
    settled_over = None
    found = monitoring.settled_counts(outbox.store, limit=settled_limit) if settled else None
    if found is not None:
        for s in State:
            if s not in LIVE_STATES:
                counts[s.value] = 0
        counts.update(found)
    elif settled:
        settled_over = settled_limit
    reasons = {r.value: 0 for r in Reason}
    reasons.update(snap.unresolved_by_reason)
    endpoints = {name: EndpointFigures() for name in outbox.endpoints}
    for name, e in snap.endpoints.items():
        endpoints[name] = EndpointFigures(
            pending=e.pending,
            in_flight=e.in_flight,
            unresolved=e.unresolved,
            due=e.due,
            oldest_due_age_seconds=None
            if e.oldest_due_at_ms is None
            else max(0.0, (now_ms - e.oldest_due_at_ms) / 1000),
            near_key_expiry=e.near_expiry,
            key_expired=e.key_expired,
            key_retention_unknown=e.retention_unknown,
            unsendable=e.unsendable,
        )
    oldest = snap.oldest_pending_created_ms
    states = outbox.store.endpoint_states()
    hour_ago = now_ms - 3_600_000
    return Figures(
        now_ms=now_ms,
        near_key_expiry_window=near,
        counts=counts,
        unresolved_by_reason=reasons,
        endpoints=endpoints,
        oldest_pending_age_seconds=None if oldest is None else max(0.0, (now_ms - oldest) / 1000),
        attempts_by_outcome=monitoring.attempts_by_outcome(outbox.store, since_ms=hour_ago),
        attempts_per_minute=_per_minute(monitoring.attempts_per_minute(outbox.store,
                                                                       since_ms=hour_ago)),
        circuits=_circuits(outbox, states),
        endpoint_states=states,
        limits=limits_by_endpoint(states, outbox.endpoints),
        settled_over=settled_over,
    )  # fmt: skip


def _circuits(outbox: OutboxParts, states: list[EndpointState]) -> dict[str, str]:
    circuits = dict.fromkeys(outbox.endpoints, "closed")
    for s in states:
        circuits[s.name] = "paused" if s.paused else str(s.circuit)
    return dict(sorted(circuits.items()))


def endpoint_state_dict(
    s: EndpointState, limits: EndpointLimits | None = None
) -> dict[str, object]:
    """One endpoint's fleet state as every view prints it (status, endpoint list): its
    circuit, and its ``limits`` (by default those of ``s`` alone, none declared)."""
    limits = limits if limits is not None else endpoint_limits(s.name, s, None)
    return {
        "endpoint": s.name, "circuit": s.circuit.value, "paused": s.paused,
        "reason": s.reason, "since": ms_to_iso(s.since), "probes": s.probes,
        "next_probe_at": ms_to_iso(s.next_probe_at) if s.next_probe_at else None,
        "probe_owner": s.probe_owner, **limits.as_dict(),
    }  # fmt: skip


#: Chart outcome of each attempt verdict.
CHART_OUTCOMES = ("success", "retry", "failed", "other")


def _per_minute(rows: list[tuple[int, str, int]]) -> list[dict[str, int]]:
    minutes = [dict.fromkeys(CHART_OUTCOMES, 0) for _ in range(60)]
    for minute, verdict, n in rows:
        outcome = verdict if verdict in CHART_OUTCOMES else "other"
        minutes[min(max(minute, 0), 59)][outcome] += n
    return minutes


@dataclass(frozen=True)
class Watch:
    """Dispatchers and the operator figures."""

    dispatchers: list[DispatcherInfo]
    figures: Figures

    @property
    def live(self) -> list[DispatcherInfo]:
        return [d for d in self.dispatchers if d.state == "live"]

    @property
    def attempts_by_outcome(self) -> list[tuple[str, str, int]]:
        return self.figures.attempts_by_outcome

    def endpoints_dict(self) -> dict[str, Any]:
        return {name: e.as_dict() for name, e in sorted(self.figures.endpoints.items())}

    def attempts_dict(self) -> dict[str, Any]:
        rows = self.figures.attempts_by_outcome
        total = sum(n for _, _, n in rows)
        good = sum(n for _, verdict, n in rows if verdict == "success")
        return {
            "total": total,
            "by_outcome": [{"delivery": d, "verdict": v, "count": n} for d, v, n in rows],
            # Attempts that did not succeed, of those started: a rate a person can read.
            "not_succeeded_ratio": None if total == 0 else round((total - good) / total, 4),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "dispatchers": [d.as_dict() for d in self.dispatchers],
            "live_dispatchers": len(self.live),
            "endpoints": self.endpoints_dict(),
            "due": self.figures.due,
            "unsendable": self.figures.unsendable,
            "attempts_last_hour_by_outcome": self.attempts_dict(),
            "figures": self.figures.as_dict(),
        }


def watch(
    outbox: OutboxParts,
    *,
    now_ms: int,
    dispatcher_timeout: timedelta,
    near: timedelta = NEAR_EXPIRY,
    settled: bool = True,
    settled_limit: int | None = None,
) -> Watch:
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
    fig = figures(outbox, now_ms=now_ms, near=near, settled=settled, settled_limit=settled_limit)
    return Watch(dispatchers=infos, figures=fig)
