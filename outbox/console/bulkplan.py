"""What a bulk preview found, kept for its apply: the console's bulk actions over any
number of operations.

A preview reads the matching operations (in the browser's pages) and dry-runs the
action on each, :data:`PREVIEW_PAGE` of them per request (a Continue button carries the
rest, so no request grows with the selection); the ``(tenant, operation_id, version)`` of
those it would change are kept in a :class:`BulkPlan`, in the console process's memory
next to the session that made it (sessions live there too: a restart drops both). The
apply form carries only the plan's ID and how far it got (the form's field limit is
what capped a bulk action at 1,500 operations when it carried every target). Each apply
request takes the next :data:`BULK_PAGE` targets, each still acted on only at the
version the preview saw.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from outbox.console.auth import Expiring, Session
from outbox.errors import ValidationError
from outbox.reconcile.bulk import BulkItem

#: Operations one apply request acts on; the rest wait in the plan for the next request
#: (the "Continue" button), so each request stays short and the page shows the progress.
BULK_PAGE = 250
#: Operations one preview request reads and dry-runs; the rest, the next request.
PREVIEW_PAGE = 2000
#: Rows of a bulk page's table (the summary above it counts every operation).
BULK_ROWS_SHOWN = 500
#: Previews kept per session; the oldest is dropped when a newer one is made.
PLANS_PER_SESSION = 4

_GONE = (
    "that bulk preview is gone (it expired, was replaced by a newer preview, or belongs "
    "to another session): preview again"
)


@dataclass(eq=False)
class BulkPlan:
    id: str
    session_id: str
    action: str
    note: str
    outcome: str | None
    accept_duplicate_risk: bool
    #: The previewed listing's filters, recorded by each audit row.
    filters: dict[str, str]
    #: The listing's filter (an :class:`~outbox.reconcile.browse.OperationFilter`).
    selection: Any
    #: Where "back" goes: the filtered list.
    back: str
    expires_at: float
    #: The preview's result for every operation read so far, oldest first.
    items: list[BulkItem] = field(default_factory=list)
    #: What the preview would change, oldest first, with the version it saw.
    targets: list[tuple[str, str, int]] = field(default_factory=list)
    seen: set[tuple[str, str]] = field(default_factory=set)
    #: Operations of the listing read so far, and how many it matched at the last read.
    previewed: int = 0
    matched: int = 0
    #: Every matching operation was previewed: the apply may start.
    complete: bool = False
    #: How many targets the apply has taken so far.
    done: int = 0
    busy: bool = False

    @property
    def left(self) -> int:
        return len(self.targets) - self.done


class BulkPlans(Expiring[BulkPlan]):
    """Bulk previews by ID, each usable only by the session that made it."""

    def add(self, session: Session, **fields: Any) -> BulkPlan:
        """A new preview (``action``, ``note``, ``outcome``, ``accept_duplicate_risk``,
        ``filters``, ``selection``, ``back``), held busy for its first page."""
        plan = BulkPlan(
            id=secrets.token_urlsafe(16),
            session_id=session.id,
            expires_at=self._expires_at(),
            busy=True,
            **fields,
        )
        with self._lock:
            self._drop_expired()
            mine = [p for p in self._items.values() if p.session_id == session.id]
            for old in mine[: max(0, len(mine) - PLANS_PER_SESSION + 1)]:
                del self._items[old.id]
            self._items[plan.id] = plan
        return plan

    def _mine(self, session: Session, plan_id: str) -> BulkPlan:
        plan = self._items.get(plan_id)
        if plan is None or plan.session_id != session.id or plan.expires_at <= self._clock():
            raise ValidationError(_GONE)
        return plan

    def claim_preview(self, session: Session, plan_id: str, *, at: int) -> BulkPlan:
        """The session's unfinished preview ``plan_id``, held busy for its next page, if
        the form was made when ``at`` operations had been read (a form posted twice
        previews nothing twice)."""
        with self._lock:
            plan = self._mine(session, plan_id)
            if plan.complete or plan.busy or at != plan.previewed:
                raise ValidationError(
                    f"this page of the preview was already read ({plan.previewed} of "
                    f"{plan.matched} previewed): use the newest page's button"
                )
            plan.busy = True
            return plan

    def release(self, plan: BulkPlan) -> None:
        """A preview page is done; a complete preview with nothing to apply is dropped."""
        with self._lock:
            plan.busy = False
            if plan.complete and not plan.targets:
                self._items.pop(plan.id, None)

    def take(
        self, session: Session, plan_id: str, *, at: int, size: int
    ) -> tuple[BulkPlan, list[tuple[str, str, int]]]:
        """The next ``size`` targets of the session's complete plan ``plan_id``, if the
        form was made at ``at`` (how far the apply had got): a form posted twice, or an
        old one, acts on nothing twice. The plan is dropped once every target was taken."""
        with self._lock:
            plan = self._mine(session, plan_id)
            if not plan.complete:
                raise ValidationError("that bulk preview is not finished: continue it first")
            if at != plan.done:
                raise ValidationError(
                    f"this page of the bulk action was already applied ({plan.done} of "
                    f"{len(plan.targets)} done): use the newest page's Continue button"
                )
            page = plan.targets[plan.done : plan.done + size]
            plan.done += len(page)
            if plan.left == 0:
                del self._items[plan.id]
            return plan, page
