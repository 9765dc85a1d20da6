"""The fleet's limits of each receiver endpoint, in the database: its rate budget, its
throttle and the in-flight permits each dispatcher leases (``outbox.dispatch.limits``
is the dispatcher's side).

* **Rate.** ``rate_cursor_us`` on ``outbox_endpoints`` is the moment up to which the
  endpoint's budget was handed out. A dispatcher takes ``k`` requests at a time: the
  interval ``[max(cursor, now), +k/rate)`` is its own, and the cursor moves to its end
  (one conditional transaction). Intervals of the fleet never overlap, so however many
  dispatchers share it the receiver sees at most ``rate`` requests a second, each
  dispatcher spacing its ``k`` sends evenly inside its interval. No interval is handed
  out more than a horizon ahead of now: a dispatcher cannot hoard the budget.
* **Throttle.** ``rate`` (NULL: none) is what 429/503 answers taught the fleet; a
  declared ``rate_limit`` and the throttle both apply (the lower wins).
* **In flight.** ``outbox_endpoint_slices`` holds, per dispatcher, the permits of
  ``max_in_flight`` it leased until ``until``; their sum never exceeds the limit, and a
  dispatcher holding more than its fair share gives some back when another wants them.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

from sqlalchemy import Connection, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from outbox.store.tables import endpoint_slices, endpoint_states


@dataclass(frozen=True, slots=True)
class RateGrant:
    """Requests a dispatcher may send: ``count`` of them, spaced ``1/rate`` apart from
    ``start_us`` (epoch microseconds). ``count == 0``: come back at ``start_us``; ``rate``
    None: nothing limits the endpoint now."""

    start_us: int
    count: int
    rate: float | None


@dataclass(frozen=True, slots=True)
class Throttled:
    """The throttle after a refusal: its rate, and whether this call changed it."""

    rate: float
    changed: bool


def effective_rate(declared: float | None, throttle: float | None) -> float | None:
    rates = [r for r in (declared, throttle) if r is not None]
    return min(rates) if rates else None


class LimitQueries:
    """The limit transactions; mixed into the store through ``EndpointQueries``."""

    def write(self) -> AbstractContextManager[Connection]:
        raise NotImplementedError

    def _ensure_row(self, conn: Connection, name: str, now_ms: int) -> None:
        raise NotImplementedError

    def _locked_row(self, conn: Connection, name: str, now_ms: int) -> object:
        self._ensure_row(conn, name, now_ms)
        t = endpoint_states.c
        return conn.execute(
            select(t.rate, t.rate_changed_at, t.refused_at, t.rate_cursor_us)
            .where(t.name == name)
            .with_for_update()
        ).one()

    def grant_rate(
        self, name: str, *, now_ms: int, want: int, declared: float | None, horizon_ms: int
    ) -> RateGrant:
        """Hand out up to ``want`` requests of the endpoint's budget (see the module)."""
        t = endpoint_states.c
        now_us = now_ms * 1000
        with self.write() as conn:
            row = self._locked_row(conn, name, now_ms)
            rate = effective_rate(declared, row.rate)  # type: ignore[attr-defined]
            if rate is None:
                return RateGrant(now_us, want, None)
            start = max(row.rate_cursor_us or 0, now_us)  # type: ignore[attr-defined]
            fits = math.floor((now_us + horizon_ms * 1000 - start) * rate / 1e6)
            if fits < 1:  # the budget is handed out up to the horizon: come back later
                return RateGrant(start, 0, rate)
            count = min(want, fits)
            conn.execute(
                update(endpoint_states)
                .where(t.name == name)
                .values(rate_cursor_us=start + math.ceil(count * 1e6 / rate))
            )
        return RateGrant(start, count, rate)

    def throttle(
        self, name: str, *, now_ms: int, initial: float, said: float | None, decrease: float,
        min_rate: float, interval_ms: int, pause_until_ms: int | None,
        sent_at_ms: int | None = None,
    ) -> Throttled:  # fmt: skip
        """A refusal: start the throttle at the rate the receiver ``said`` (or else
        ``initial`` requests/s), or cut it by ``decrease`` (once per ``interval_ms``, never
        above what the receiver said); a pause moves the budget's cursor. A refusal of a
        request sent (``sent_at_ms``) before the rate's last change says nothing of the
        new rate: it is ignored."""
        t = endpoint_states.c
        with self.write() as conn:
            row = self._locked_row(conn, name, now_ms)
            rate: float | None = row.rate  # type: ignore[attr-defined]
            changed_at = row.rate_changed_at or 0  # type: ignore[attr-defined]
            if rate is not None and sent_at_ms is not None and sent_at_ms <= changed_at:
                return Throttled(rate, False)  # sent at the old rate
            values: dict[str, object] = {"refused_at": now_ms}
            changed = False
            if rate is None:
                rate, changed = max(min_rate, said or initial), True
            elif now_ms - changed_at >= interval_ms:
                cut = rate * decrease if said is None else min(rate * decrease, said)
                rate, changed = max(min_rate, cut), True
            if changed:
                values.update(rate=rate, rate_changed_at=now_ms)
            if pause_until_ms is not None:
                cursor = row.rate_cursor_us or 0  # type: ignore[attr-defined]
                values["rate_cursor_us"] = max(cursor, pause_until_ms * 1000)
            conn.execute(update(endpoint_states).where(t.name == name).values(values))
        return Throttled(rate, changed)

    def recover_rate(
        self, name: str, *, now_ms: int, seen_changed_at: int | None, step_fraction: float,
        min_step: float, interval_ms: int, release_after_ms: int,
    ) -> float | None:  # fmt: skip
        """No refusal for an interval: add ``step_fraction`` of the rate back (one
        dispatcher per interval wins), or lift the throttle after ``release_after_ms``
        of quiet. The rate after it (None: lifted or not throttled)."""
        t = endpoint_states.c
        with self.write() as conn:
            row = conn.execute(
                select(t.rate, t.rate_changed_at, t.refused_at).where(t.name == name)
            ).first()
            if row is None or row.rate is None:
                return None
            if (
                row.rate_changed_at != seen_changed_at
                or now_ms - (row.rate_changed_at or 0) < interval_ms
                or now_ms - (row.refused_at or 0) < interval_ms  # not a quiet interval
            ):
                return float(row.rate)
            if now_ms - (row.refused_at or 0) >= release_after_ms:
                values: dict[str, object] = {"rate": None, "rate_changed_at": now_ms}
                new: float | None = None
            else:
                new = row.rate + max(min_step, row.rate * step_fraction)
                values = {"rate": new, "rate_changed_at": now_ms}
            conn.execute(
                update(endpoint_states)
                .where(t.name == name, t.rate_changed_at == row.rate_changed_at)
                .values(values)
            )
        return new

    def lease_slots(
        self, name: str, *, owner: str, now_ms: int, want: int, limit: int, lease_ms: int,
        in_use: int = 0,
    ) -> int:  # fmt: skip
        """Lease in-flight permits of the endpoint's ``limit``: up to ``want``, within what
        the others hold, and no more than a fair share while another wants more than it
        holds, but never fewer than the ``in_use`` ones (requests on the wire keep their
        permits until they end). ``want == 0`` gives this dispatcher's permits back. The
        permits held."""
        s = endpoint_slices.c
        with self.write() as conn:
            self._locked_row(conn, name, now_ms)  # one lease of the endpoint at a time
            conn.execute(delete(endpoint_slices).where(s.endpoint == name, s.until < now_ms))
            if want == 0:
                conn.execute(delete(endpoint_slices).where(s.endpoint == name, s.owner == owner))
                return 0
            rows = conn.execute(
                select(s.owner, s.permits, s.wanted).where(s.endpoint == name).with_for_update()
            ).all()
            others = [r for r in rows if r.owner != owner]
            owners = sorted([owner, *(r.owner for r in others)])
            fair = limit // len(owners) + (1 if owners.index(owner) < limit % len(owners) else 0)
            held = sum(r.permits for r in others)
            permits = max(0, min(want, limit - held))
            if any(r.wanted > r.permits for r in others):
                permits = min(permits, fair)
            permits = max(permits, min(in_use, limit - held))
            values = {"permits": permits, "wanted": want, "until": now_ms + lease_ms}
            if any(r.owner == owner for r in rows):
                conn.execute(
                    update(endpoint_slices)
                    .where(s.endpoint == name, s.owner == owner)
                    .values(values)
                )
            else:
                try:
                    with conn.begin_nested():
                        conn.execute(
                            insert(endpoint_slices).values(endpoint=name, owner=owner, **values)
                        )
                except IntegrityError:
                    return 0  # raced by our own earlier lease: try again at the next one
        return int(permits)


__all__ = ["LimitQueries", "RateGrant", "Throttled", "effective_rate"]
