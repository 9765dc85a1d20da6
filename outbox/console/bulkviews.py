"""The console's bulk actions: a preview of every operation the filtered list matches,
then the apply in pages, both through :func:`outbox.reconcile.browse.bulk_action` (the
CLI's engine, :mod:`outbox.reconcile.bulk`), over a plan kept with the session
(:mod:`outbox.console.bulkplan`) so that no request or form grows with the selection."""

from __future__ import annotations

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response

from outbox.console.app import in_thread, query_url
from outbox.console.auth import Session
from outbox.console.bulkplan import BULK_PAGE, BULK_ROWS_SHOWN, PREVIEW_PAGE, BulkPlan
from outbox.console.views import Views, _bulk_filters, _field, _int, parse_listing
from outbox.errors import OutboxError, ValidationError
from outbox.reconcile.browse import BULK_ACTIONS, MAX_PAGE, bulk_action
from outbox.reconcile.bulk import BulkOutcome, BulkReport, Selection


class BulkViews:
    def __init__(self, views: Views) -> None:
        self.v = views
        self.c = views.c

    async def bulk(self, request: Request, session: Session, form: FormData) -> Response:
        step = _field(form, "step")
        try:
            if step == "preview":
                return await self._start(session, form)
            if step not in ("preview-more", "apply"):
                raise ValidationError("step is preview or apply")
            plan_id, at = _field(form, "plan"), _int(_field(form, "at") or "0", "at")
            if step == "preview-more":
                plan = self.c.bulk_plans.claim_preview(session, plan_id, at=at)
                return await self._preview_page(session, plan)
            return await self._apply(session, plan_id, at)
        except OutboxError as exc:
            return self.v._failure(session, exc, link=None)

    async def _start(self, session: Session, form: FormData) -> Response:
        """A new preview of the listing the form describes: its first page."""
        view = "/queue" if _field(form, "view") == "queue" else "/operations"
        action = _field(form, "action")
        note = _field(form, "note")
        outcome = _field(form, "outcome") or None
        accept = _field(form, "accept_duplicate_risk") == "yes"
        if action not in BULK_ACTIONS:
            raise ValidationError(f"bulk action must be one of {', '.join(BULK_ACTIONS)}")
        listing = parse_listing(form, queue=view == "/queue")
        filters = _bulk_filters(listing.raw, view)
        # Every check the engine makes up front (outcome, note, operator), before a plan.
        bulk_action(self.c.outbox, [], action=action, note=note, operator=session.actor,
                    outcome=outcome, accept_duplicate_risk=accept, dry_run=True)  # fmt: skip
        plan = self.c.bulk_plans.add(
            session, action=action, note=note, outcome=outcome,
            accept_duplicate_risk=accept, filters=filters, selection=listing.flt,
            back=query_url(view, {k: v for k, v in listing.raw.items() if k != "limit"}),
        )  # fmt: skip
        return await self._preview_page(session, plan)

    async def _preview_page(self, session: Session, plan: BulkPlan) -> Response:
        """Read and dry-run the next :data:`PREVIEW_PAGE` operations of the plan's listing
        (an operation already previewed, met again because the list moved, is skipped)."""

        def more() -> None:
            read = 0
            while read < PREVIEW_PAGE:
                page = self.v.browser.operations(
                    plan.selection, limit=min(MAX_PAGE, PREVIEW_PAGE - read),
                    offset=plan.previewed,
                )  # fmt: skip
                fresh = [op for op in page.items if (op.tenant, op.operation_id) not in plan.seen]
                targets = [(op.tenant, op.operation_id, op.version) for op in fresh]
                report = bulk_action(
                    self.c.outbox, targets, action=plan.action, note=plan.note,
                    operator=session.actor, outcome=plan.outcome,
                    accept_duplicate_risk=plan.accept_duplicate_risk, dry_run=True,
                    filters=plan.filters,
                )  # fmt: skip
                versions = {(t, o): v for t, o, v in targets}
                plan.items += report.items
                plan.targets += [
                    (i.tenant, i.operation_id, versions[(i.tenant, i.operation_id)])
                    for i in report.items
                    if i.outcome is BulkOutcome.CHANGED
                ]
                plan.seen.update(versions)
                plan.previewed += len(page.items)
                plan.matched = page.total
                read += len(page.items)
                if not page.has_next or not page.items:
                    plan.complete = True
                    plan.matched = len(plan.seen)
                    break

        try:
            await in_thread(more)
        finally:
            self.c.bulk_plans.release(plan)
        report = BulkReport(plan.action, dry_run=True, selection=Selection(), items=plan.items)
        return self._page(session, report, plan=plan, progress=None)

    async def _apply(self, session: Session, plan_id: str, at: int) -> Response:
        """The next :data:`BULK_PAGE` operations of the plan, each only at the version
        the preview saw; the page shows the progress and a Continue button."""
        plan, now = self.c.bulk_plans.take(session, plan_id, at=at, size=BULK_PAGE)
        report = await in_thread(
            lambda: bulk_action(
                self.c.outbox, now, action=plan.action, note=plan.note,
                operator=session.actor, outcome=plan.outcome,
                accept_duplicate_risk=plan.accept_duplicate_risk, dry_run=False,
                filters=plan.filters,
            )
        )  # fmt: skip
        return self._page(session, report, plan=plan, progress=(at + len(now), len(plan.targets)))

    def _page(
        self,
        session: Session,
        report: BulkReport,
        *,
        plan: BulkPlan,
        progress: tuple[int, int] | None,
    ) -> Response:
        return self.c.page(
            "bulk.html",
            session=session,
            title=f"Bulk {report.action}",
            nav="",
            report=report,
            shown=report.items[:BULK_ROWS_SHOWN],
            plan=plan,
            progress=progress,
            bulk_page=BULK_PAGE,
            back=plan.back,
        )
