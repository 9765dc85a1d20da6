"""What a bulk preview found, kept for its apply: the console's bulk actions over any
number of operations.

A preview reads every matching operation (in the browser's pages) and dry-runs the
action on each; the ``(tenant, operation_id, version)`` of those it would change become a
:class:`BulkPlan`, held in the console process's memory next to the session that made it
(sessions live there too: a restart drops both). The apply form carries only the plan's
ID and how far it got, so its size no longer grows with the selection (the form's field
limit is what capped a bulk action at 1,500 operations before). Each apply request takes
the next :data:`~outbox.console.views.BULK_PAGE` targets, each still acted on only at the
version the preview saw.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox.console.auth import SESSION_TTL_SECONDS, Session
from outbox.errors import ValidationError

#: Previews kept per session; an older one is dropped when a newer one is made.
PLANS_PER_SESSION = 4


@dataclass
class BulkPlan:
    id: str
    session_id: str
    action: str
    note: str
    outcome: str | None
    accept_duplicate_risk: bool
    #: The previewed listing's filters, recorded by each audit row.
    filters: dict[str, str]
    #: What the preview would change, oldest first, with the version it saw.
    targets: list[tuple[str, str, int]]
    #: How many targets the apply has taken so far.
    done: int = 0
    expires_at: float = field(default=0.0)

    @property
    def left(self) -> int:
        return len(self.targets) - self.done


class BulkPlans:
    """Bulk previews by ID, each usable only by the session that made it."""

    def __init__(
        self, ttl_seconds: float = SESSION_TTL_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._plans: dict[str, BulkPlan] = {}

    def add(
        self,
        session: Session,
        *,
        action: str,
        note: str,
        outcome: str | None,
        accept_duplicate_risk: bool,
        filters: dict[str, str],
        targets: list[tuple[str, str, int]],
    ) -> BulkPlan:
        plan = BulkPlan(
            id=secrets.token_urlsafe(16),
            session_id=session.id,
            action=action,
            note=note,
            outcome=outcome,
            accept_duplicate_risk=accept_duplicate_risk,
            filters=dict(filters),
            targets=targets,
            expires_at=self._clock() + self.ttl,
        )
        with self._lock:
            now = self._clock()
            for pid in [k for k, p in self._plans.items() if p.expires_at <= now]:
                del self._plans[pid]
            mine = [p for p in self._plans.values() if p.session_id == session.id]
            for old in mine[: max(0, len(mine) - PLANS_PER_SESSION + 1)]:
                del self._plans[old.id]
            self._plans[plan.id] = plan
        return plan

    def take(
        self, session: Session, plan_id: str, *, at: int, size: int
    ) -> tuple[BulkPlan, list[tuple[str, str, int]]]:
        """The next ``size`` targets of the session's plan ``plan_id``, if the form was
        made at ``at`` (how far the plan had got): a form posted twice, or an old one,
        acts on nothing twice. The plan is dropped once every target was taken."""
        with self._lock:
            plan = self._plans.get(plan_id)
            if plan is None or plan.session_id != session.id or plan.expires_at <= self._clock():
                raise ValidationError(
                    "that bulk preview is gone (it expired, was replaced by a newer preview, "
                    "or belongs to another session): preview again"
                )
            if at != plan.done:
                raise ValidationError(
                    f"this page of the bulk action was already applied ({plan.done} of "
                    f"{len(plan.targets)} done): use the newest page's Continue button"
                )
            page = plan.targets[plan.done : plan.done + size]
            plan.done += len(page)
            if plan.left == 0:
                del self._plans[plan.id]
            return plan, page
