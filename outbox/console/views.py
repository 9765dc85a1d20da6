"""The console's pages and actions: parse the request, make one library call, render."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from starlette.datastructures import FormData, QueryParams
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.console.app import Console, in_thread, op_link, query_url
from outbox.console.auth import Session
from outbox.console.bulkplan import BULK_PAGE
from outbox.console.render import JSON_DISPLAY_LIMIT, masked, pretty_json
from outbox.errors import (
    ConcurrentModification,
    ConfigurationError,
    OperationNotFound,
    OperatorActionRefused,
    OutboxError,
    StoreError,
    ValidationError,
)
from outbox.forms import body_view
from outbox.model import Reason, State
from outbox.reconcile import Reconciler, attempt_dict, parse_duration
from outbox.reconcile.browse import (
    Browser,
    GuardedReconciler,
    OperationFilter,
    probe_refusal,
)

NO_TENANT = "(none)"
PAGE_SIZES = (25, 50, 100, 200)
DONE = {
    "resolved": "Resolved. The audit trail below records it under your name.",
    "requeued": "Requeued: pending again under the same operation ID.",
    "cancelled": "Cancelled: it will never be sent.",
}
FILTER_KEYS = ("state", "reason", "endpoint", "tenant", "older_than", "q", "sort")


@dataclass(frozen=True)
class Listing:
    flt: OperationFilter
    raw: dict[str, Any]
    newest_first: bool
    limit: int
    offset: int


def parse_listing(params: QueryParams | FormData, *, queue: bool) -> Listing:
    """The list filters from a query string or a form; ValidationError when bad."""

    def get(name: str) -> str:
        value = params.get(name)
        return value.strip() if isinstance(value, str) else ""

    raw: dict[str, Any] = {k: get(k) for k in FILTER_KEYS}
    states: tuple[State, ...] = ()
    if queue:
        states = (State.UNRESOLVED,)
        raw["state"] = ""
    elif raw["state"]:
        try:
            states = (State(raw["state"]),)
        except ValueError:
            raise ValidationError(f"unknown state {raw['state']!r}") from None
    reason = None
    if raw["reason"]:
        try:
            reason = Reason(raw["reason"])
        except ValueError:
            raise ValidationError(f"unknown reason {raw['reason']!r}") from None
    tenant: str | None = raw["tenant"] or None
    if tenant == NO_TENANT:
        tenant = ""
    if raw["endpoint"] and len(raw["endpoint"]) > 64:
        raise ValidationError("endpoint names are at most 64 characters")
    older = parse_duration(raw["older_than"]) if raw["older_than"] else None
    if raw["sort"] not in ("", "oldest", "newest"):
        raise ValidationError("sort is oldest or newest")
    raw["sort"] = raw["sort"] or "oldest"
    limit = _int(get("limit") or "50", "limit")
    if limit not in PAGE_SIZES:
        raise ValidationError(f"limit must be one of {', '.join(map(str, PAGE_SIZES))}")
    offset = _int(get("offset") or "0", "offset")
    raw["limit"] = limit
    flt = OperationFilter(
        states=states,
        reason=reason,
        endpoint=raw["endpoint"] or None,
        tenant=tenant,
        older_than=older,
        id_contains=raw["q"] or None,
    )
    return Listing(flt, raw, raw["sort"] == "newest", limit, max(0, offset))


def _int(text: str, name: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValidationError(f"{name} must be a whole number") from None
    if value < 0 or value > 10**9:
        raise ValidationError(f"{name} is out of range")
    return value


def _utc(text: str, name: str) -> int | None:
    if not text:
        return None
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ValidationError(f"{name} must be a date and time like 2026-12-01T09:30") from None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return int(value.timestamp() * 1000)


class Views:
    def __init__(self, console: Console) -> None:
        self.c = console
        self.outbox = console.outbox
        self.browser = Browser(console.outbox)

    def _failure(self, session: Session, exc: OutboxError, *, link: str | None) -> Response:
        """A refusal as a page: what happened, that nothing changed, where to go."""
        if isinstance(exc, ConcurrentModification):
            return self.c.message(
                session,
                status=409,
                heading="Changed since you looked",
                message=f"{exc}. Someone else acted on it, or a dispatcher claimed it, after "
                "the page was shown. Look at its current state before acting again.",
                link=link,
                link_text="See the current state",
            )
        status, heading = 409, "Refused"
        if isinstance(exc, ValidationError | ConfigurationError):
            status, heading = 400, "Not accepted"
        elif isinstance(exc, OperationNotFound):
            status, heading = 404, "Not found"
        elif isinstance(exc, StoreError):
            status, heading = 503, "The database failed"
        return self.c.message(
            session,
            status=status,
            heading=heading,
            message=f"{exc}. Nothing was changed.",
            link=link,
            link_text="Back to the operation" if link else "",
        )

    # -- pages ------------------------------------------------------------------------

    async def overview(self, request: Request, session: Session) -> Response:
        ov = await in_thread(self.browser.overview)
        return self.c.page(
            "overview.html", session=session, title="Overview", nav="overview", ov=ov
        )

    async def queue(self, request: Request, session: Session) -> Response:
        return await self._list(request, session, queue=True)

    async def operations(self, request: Request, session: Session) -> Response:
        return await self._list(request, session, queue=False)

    async def _list(self, request: Request, session: Session, *, queue: bool) -> Response:
        path = "/queue" if queue else "/operations"
        error = None
        try:
            listing = parse_listing(request.query_params, queue=queue)
        except ValidationError as exc:
            error = str(exc)
            listing = parse_listing(QueryParams(""), queue=queue)

        def load() -> Any:
            page = self.browser.operations(
                listing.flt,
                newest_first=listing.newest_first,
                limit=listing.limit,
                offset=listing.offset,
            )
            return page, self.browser.facets(), self.outbox.clock.now_ms()

        page, facets, now_ms = await in_thread(load)
        params = {k: v for k, v in listing.raw.items() if k != "limit"}
        params["limit"] = listing.limit if listing.limit != 50 else ""
        prev_url = next_url = None
        if page.has_previous:
            prev_url = query_url(path, {**params, "offset": max(0, page.offset - page.limit) or ""})
        if page.has_next:
            next_url = query_url(path, {**params, "offset": page.offset + page.limit})
        filter_fields = [(k, v) for k, v in listing.raw.items() if k in FILTER_KEYS and v]
        return self.c.page(
            "operations.html",
            session=session,
            status=400 if error else 200,
            error=error,
            title="Reconciliation queue" if queue else "All operations",
            nav="queue" if queue else "operations",
            queue=queue,
            base_path=path,
            page=page,
            f=listing.raw,
            facets=facets,
            states=[s.value for s in State],
            reasons=[r.value for r in Reason],
            now_ms=now_ms,
            prev_url=prev_url,
            next_url=next_url,
            filter_fields=filter_fields,
            bulk_page=BULK_PAGE,
        )

    async def operation(self, request: Request, session: Session) -> Response:
        tenant = request.query_params.get("tenant", "")
        operation_id = request.query_params.get("id", "")
        notice = DONE.get(request.query_params.get("done", ""))
        return await self._operation_page(session, tenant, operation_id, notice=notice)

    async def _operation_page(
        self,
        session: Session,
        tenant: str,
        operation_id: str,
        *,
        notice: str | None = None,
        probe_outcome: Any = None,
    ) -> Response:
        def load() -> Any:
            report = Reconciler(self.outbox).show(operation_id, tenant=tenant)
            return report, self._actions(report.operation, session.actor)

        try:
            report, actions = await in_thread(load)
        except OutboxError as exc:
            return self._failure(session, exc, link=None)
        op = report.operation
        secret = self.outbox.secret_headers
        attempts = [{**attempt_dict(a), "started_ms": a.started_at_ms} for a in op.attempts]
        return self.c.page(
            "operation.html",
            session=session,
            title=op.operation_id,
            nav="",
            report=report,
            actions=actions,
            attempts=attempts,
            headers=masked(op.headers, secret),
            body=pretty_json(op.body)
            if op.body_raw is None
            else pretty_json(body_view(op.content_type, op.body_raw)),
            result_headers=masked(op.result.headers if op.result else None, secret),
            result_body=pretty_json(op.result.body if op.result else None),
            json_limit=JSON_DISPLAY_LIMIT,
            notice=notice,
            probe_outcome=probe_outcome,
            now_ms=self.outbox.clock.now_ms(),
        )

    def _actions(self, op: Any, actor: str) -> dict[str, Any]:
        """Which actions apply, asked of the library by dry runs (no rule copied here)."""
        out: dict[str, Any] = {
            "resolve": False,
            "requeue": False,
            "requeue_risk": None,
            "cancel": False,
            "cancel_refused": None,
            "probe": False,
        }
        if self.c.read_only:
            return out
        dry = GuardedReconciler(self.outbox, dry_run=True)
        kw: dict[str, Any] = {"tenant": op.tenant, "note": "(preview)", "operator": actor}
        if op.state is State.UNRESOLVED:
            out["resolve"] = True
            try:
                dry.requeue(op.operation_id, **kw)
                out["requeue"] = True
            except OperatorActionRefused:
                try:
                    dry.requeue(op.operation_id, accept_duplicate_risk=True, **kw)
                    out["requeue"] = True
                    out["requeue_risk"] = Reconciler(self.outbox).requeue_risk(op).note
                except OperatorActionRefused:
                    pass
            out["probe"] = probe_refusal(self.outbox, op) is None
        if op.state is State.PENDING:
            try:
                dry.cancel(op.operation_id, **kw)
                out["cancel"] = True
            except OperatorActionRefused as exc:
                out["cancel_refused"] = str(exc)
        out["any"] = any(out[k] for k in ("resolve", "requeue", "cancel", "probe"))
        return out

    async def audit(self, request: Request, session: Session) -> Response:
        q = request.query_params
        raw = {k: (q.get(k) or "").strip() for k in ("actor", "within", "since", "until")}
        raw["operation_id"] = (q.get("operation_id") or "").strip()
        error = None
        try:
            offset = _int(q.get("offset") or "0", "offset")
            since = _utc(raw["since"], "from")
            until = _utc(raw["until"], "until")
            if raw["within"]:
                cutoff = self.outbox.clock.now_ms() - int(
                    parse_duration(raw["within"]) / timedelta(milliseconds=1)
                )
                since = max(since or cutoff, cutoff)
        except ValidationError as exc:
            error, offset, since, until = str(exc), 0, None, None

        def load() -> Any:
            page = self.browser.audit_log(
                actor=raw["actor"] or None,
                since_ms=since,
                until_ms=until,
                operation_id=raw["operation_id"] or None,
                limit=50,
                offset=offset,
            )
            return page, self.browser.facets()

        page, facets = await in_thread(load)
        params = dict(raw)
        prev_url = next_url = None
        if page.has_previous:
            prev_url = query_url("/audit", {**params, "offset": max(0, offset - 50) or ""})
        if page.has_next:
            next_url = query_url("/audit", {**params, "offset": offset + 50})
        return self.c.page(
            "audit.html",
            session=session,
            status=400 if error else 200,
            error=error,
            title="Audit log",
            nav="audit",
            page=page,
            f=raw,
            facets=facets,
            prev_url=prev_url,
            next_url=next_url,
        )

    # -- actions ----------------------------------------------------------------------

    async def act(self, request: Request, session: Session, form: FormData) -> Response:
        action = request.path_params["action"]
        tenant = _field(form, "tenant")
        operation_id = _field(form, "id")
        link = op_link(tenant, operation_id)
        note = _field(form, "note")
        try:
            version = _int(_field(form, "version"), "version")
            if action not in ("resolve", "requeue", "cancel", "probe"):
                raise ValidationError(f"unknown action {action!r}")
        except ValidationError as exc:
            return self._failure(session, exc, link=link)
        rec = GuardedReconciler(self.outbox, expected_version=version)

        def run() -> Any:
            if action == "resolve":
                outcome = _field(form, "outcome")
                if outcome not in ("succeeded", "failed"):
                    raise ValidationError("choose the outcome: succeeded or failed")
                return rec.resolve(
                    operation_id,
                    tenant=tenant,
                    outcome=outcome,
                    note=note,
                    operator=session.actor,
                )
            if action == "requeue":
                return rec.requeue(
                    operation_id,
                    tenant=tenant,
                    note=note,
                    operator=session.actor,
                    accept_duplicate_risk=_field(form, "accept_duplicate_risk") == "yes",
                )
            if action == "cancel":
                return rec.cancel(operation_id, tenant=tenant, note=note, operator=session.actor)
            # probe: the status lookup decides; refuse if the page was stale.
            current = self.outbox.get(operation_id, tenant=tenant)
            if current.version != version:
                raise ConcurrentModification(
                    f"operation {operation_id!r} changed since it was shown (version "
                    f"{version}, now {current.version}: {current.state.value}); nothing was "
                    "looked up"
                )
            return rec.probe(operation_id, tenant=tenant)

        try:
            result = await in_thread(run)
        except OutboxError as exc:
            return self._failure(session, exc, link=link)
        if action == "probe":
            return await self._operation_page(session, tenant, operation_id, probe_outcome=result)
        done = {"resolve": "resolved", "requeue": "requeued", "cancel": "cancelled"}[action]
        return RedirectResponse(f"{link}&done={done}", status_code=303)


def _bulk_filters(raw: dict[str, Any], view: str) -> dict[str, str]:
    """The listing's filters as the audit row records them (the view, and each filter
    that is set)."""
    out = {"view": view.strip("/")}
    out.update({k: str(raw[k]) for k in FILTER_KEYS if k != "sort" and raw.get(k)})
    return out


def _field(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""
