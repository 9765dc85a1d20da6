"""The fleet's shared state of each receiver endpoint: its circuit breaker and an
operator's pause, in ``outbox_endpoints`` (one row per endpoint that ever failed or was
paused; no row means closed).

Every transition is one conditional UPDATE, so two dispatchers racing to open, probe or
close an endpoint agree on one winner. The claim reads only ``blocked``
(:func:`outbox.store.statements.endpoint_blocked`).
"""

from __future__ import annotations

import enum
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Unpack

from sqlalchemy import Connection, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from outbox.store.dispatching import DispatchQueries
from outbox.store.limits import LimitQueries
from outbox.store.records import ClaimResult, ProbeClaimArgs
from outbox.store.tables import audit, endpoint_states

#: The audit trail names an endpoint action by this tenant (no operation's tenant can
#: be it: ``@`` is not allowed in tenants) and the endpoint's name.
ENDPOINT_AUDIT_TENANT = "@endpoint"


class Circuit(enum.StrEnum):
    """An endpoint's circuit, as every dispatcher of the database sees it."""

    #: Operations are claimed and sent as usual.
    CLOSED = "closed"
    #: The endpoint failed; nothing of it is claimed until the next probe.
    OPEN = "open"
    #: One dispatcher holds the probe lease and sends one real operation.
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class EndpointState:
    name: str
    circuit: Circuit
    paused: bool
    reason: str | None
    #: Epoch ms of the last change of circuit or pause.
    since: int
    probes: int
    failures: int
    next_probe_at: int | None
    probe_owner: str | None
    probe_until: int | None
    #: The fleet's throttle in requests per second (``outbox.store.limits``); None: none.
    rate: float | None = None
    #: Epoch ms of the throttle's last change, and of the last refusal that throttled.
    rate_changed_at: int | None = None
    refused_at: int | None = None

    @property
    def blocked(self) -> bool:
        return self.paused or self.circuit is not Circuit.CLOSED


def _state(r: Any) -> EndpointState:
    return EndpointState(
        name=r.name, circuit=Circuit(r.circuit), paused=bool(r.paused), reason=r.reason,
        since=r.since, probes=r.probes, failures=r.failures, next_probe_at=r.next_probe_at,
        probe_owner=r.probe_owner, probe_until=r.probe_until, rate=r.rate,
        rate_changed_at=r.rate_changed_at, refused_at=r.refused_at,
    )  # fmt: skip


class EndpointQueries(LimitQueries, DispatchQueries):
    """The endpoint-state transactions; :class:`~outbox.store.base.Store` mixes them in."""

    def read(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def _probe_claim_statement(self) -> Any:
        """The dialect's claim of the half-open probe (parameter ``probe_endpoint``)."""
        raise NotImplementedError

    def endpoint_states(self) -> list[EndpointState]:
        with self.read() as conn:
            rows = conn.execute(select(endpoint_states).order_by(endpoint_states.c.name)).all()
        return [_state(r) for r in rows]

    def _ensure_row(self, conn: Connection, name: str, now_ms: int) -> None:
        exists = conn.execute(
            select(endpoint_states.c.name).where(endpoint_states.c.name == name)
        ).first()
        if exists is None:
            try:
                with conn.begin_nested():
                    conn.execute(
                        insert(endpoint_states).values(
                            name=name, circuit=Circuit.CLOSED.value, blocked=0, paused=0,
                            since=now_ms, probes=0, updated_at=now_ms,
                        )
                    )  # fmt: skip
            except IntegrityError:
                pass  # another dispatcher made it first

    def count_failures(
        self, name: str, *, failures: int, threshold: int, reason: str, now_ms: int,
        next_probe_at: int,
    ) -> bool:
        """Add ``failures`` consecutive failures to a closed circuit's count, and open it
        at ``threshold``; True if this call opened it."""
        t = endpoint_states.c
        with self.write() as conn:
            self._ensure_row(conn, name, now_ms)
            conn.execute(
                update(endpoint_states)
                .where(t.name == name, t.circuit == Circuit.CLOSED.value)
                .values(failures=t.failures + failures, updated_at=now_ms)
            )
            return bool(
                conn.execute(
                    update(endpoint_states)
                    .where(t.name == name, t.circuit == Circuit.CLOSED.value,
                           t.failures >= threshold)
                    .values(circuit=Circuit.OPEN.value, blocked=1, reason=reason[:500],
                            since=now_ms, probes=0, failures=0, next_probe_at=next_probe_at,
                            probe_owner=None, probe_until=None, updated_at=now_ms)
                ).rowcount
            )

    def reset_failures(self, name: str, *, now_ms: int) -> None:
        """A success: the count of consecutive failures starts again."""
        t = endpoint_states.c
        with self.write() as conn:
            conn.execute(
                update(endpoint_states)
                .where(t.name == name, t.failures > 0)
                .values(failures=0, updated_at=now_ms)
            )

    def take_probe(self, name: str, *, owner: str, now_ms: int, lease_ms: int) -> bool:
        """Take the half-open probe lease of an open (or abandoned half-open) circuit
        whose probe is due; False if another dispatcher holds it or it is not due."""
        t = endpoint_states.c
        with self.write() as conn:
            return bool(
                conn.execute(
                    update(endpoint_states)
                    .where(
                        t.name == name,
                        t.paused == 0,
                        t.circuit.in_([Circuit.OPEN.value, Circuit.HALF_OPEN.value]),
                        t.next_probe_at <= now_ms,
                        or_(t.probe_until.is_(None), t.probe_until < now_ms),
                    )
                    .values(circuit=Circuit.HALF_OPEN.value, probe_owner=owner,
                            probe_until=now_ms + lease_ms, updated_at=now_ms)
                ).rowcount
            )

    def claim_probe(self, *, endpoint: str, **claim: Unpack[ProbeClaimArgs]) -> ClaimResult:
        """Claim the endpoint's oldest due operation (one) and begin its attempt, past
        the block of its circuit: the half-open probe. Only the probe lease's holder.
        ``server_clock``, ``steady_ms``: as :meth:`claim`."""
        with self.write() as conn:
            return self._claim_and_begin_on(
                conn,
                **claim,
                limit=1,
                statement=self._probe_claim_statement(),
                extra={"probe_endpoint": endpoint},
            )

    def probe_failed(self, name: str, *, owner: str, now_ms: int, next_probe_at: int,
                     reason: str) -> bool:  # fmt: skip
        """The probe failed (or found nothing to send): open again, next probe later."""
        t = endpoint_states.c
        with self.write() as conn:
            return bool(
                conn.execute(
                    update(endpoint_states)
                    .where(t.name == name, t.probe_owner == owner)
                    .values(circuit=Circuit.OPEN.value, probes=t.probes + 1,
                            next_probe_at=next_probe_at, probe_owner=None, probe_until=None,
                            reason=reason[:500], updated_at=now_ms)
                ).rowcount
            )

    def close_circuit(self, name: str, *, now_ms: int, reason: str) -> bool:
        """A success: close the circuit (unblocked unless paused); False if closed."""
        t = endpoint_states.c
        with self.write() as conn:
            return bool(
                conn.execute(
                    update(endpoint_states)
                    .where(t.name == name, t.circuit != Circuit.CLOSED.value)
                    .values(circuit=Circuit.CLOSED.value, blocked=t.paused, probes=0, failures=0,
                            next_probe_at=None, probe_owner=None, probe_until=None,
                            reason=reason[:500], since=now_ms, updated_at=now_ms)
                ).rowcount
            )

    def set_paused(
        self, name: str, *, paused: bool, now_ms: int, actor: str, note: str
    ) -> EndpointState:
        """Pause or resume an endpoint, audited in the same transaction."""
        t = endpoint_states.c
        with self.write() as conn:
            self._ensure_row(conn, name, now_ms)
            before = _state(conn.execute(select(endpoint_states).where(t.name == name)).one())
            values: dict[str, Any] = {"paused": int(paused), "updated_at": now_ms, "since": now_ms}
            if paused:
                values.update(blocked=1, reason=f"paused by {actor}: {note}"[:500])
            else:
                closed = before.circuit is Circuit.CLOSED
                values.update(blocked=0 if closed else 1,
                              reason=f"resumed by {actor}: {note}"[:500])
                if not closed:
                    values["next_probe_at"] = now_ms  # probe at once
            conn.execute(update(endpoint_states).where(t.name == name).values(values))
            conn.execute(
                insert(audit).values(
                    tenant=ENDPOINT_AUDIT_TENANT, operation_id=name, actor=actor,
                    action="pause" if paused else "resume",
                    from_state="paused" if before.paused else before.circuit.value,
                    to_state="paused" if paused else before.circuit.value,
                    note=note, details=None, at=now_ms,
                )
            )  # fmt: skip
            after = conn.execute(select(endpoint_states).where(t.name == name)).one()
        return _state(after)


def blocked_names(states: list[EndpointState]) -> list[str]:
    return [s.name for s in states if s.blocked]


__all__ = [
    "ENDPOINT_AUDIT_TENANT",
    "Circuit",
    "EndpointQueries",
    "EndpointState",
    "blocked_names",
]
