"""``outbox migrate``, ``outbox status`` and ``outbox show``."""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click

from outbox.base.durations import format_duration
from outbox.cli.support import (
    DURATION,
    EXIT_REFUSED,
    Context,
    Page,
    command,
    page_options,
)
from outbox.model import State

if TYPE_CHECKING:
    from outbox.reconcile import OperationReport
    from outbox.reconcile.status import Figures, Watch
from outbox.cli.root import _emit_json, _filter_words, _reconciler, json_option, main, out

# -- schema ---------------------------------------------------------------------------


@command(main)
def migrate(obj: Context) -> None:
    """Create or upgrade the outbox tables (the only command that creates anything)."""
    from outbox.store.engine import create_engine, schema_of
    from outbox.store.migrate import HEAD, current_revision, upgrade

    schema = obj.schema
    if obj.db is None and obj.app:
        app = obj.outbox()
        url: Any = app.engine.url
        schema = schema_of(app.engine)  # the app's (a --schema that is not was refused)
    elif obj.db is None:
        raise click.UsageError("name the database: --db URL (or set OUTBOX_DB)")
    else:
        # A direct URL for the DDL while the application goes through pgbouncer: the
        # URL is migrated, and messages name it, not the application.
        url, obj.app = obj.db, None
    engine = create_engine(url, schema=schema)
    try:
        before = current_revision(engine)
        upgrade(engine)
        where = f" in schema {schema}" if schema else ""
        click.echo(f"outbox schema at revision {HEAD}{where} (was {before or 'empty'})")
    finally:
        engine.dispose()


# -- reading ----------------------------------------------------------------------------


#: The thresholds ``status --check`` holds the outbox to: (flag, type, default, what it
#: allows), in help order. Without --check they are not passed on.
_CHECK_THRESHOLDS = (
    ("--max-unresolved", click.IntRange(0), 0, "reconciliation backlog allowed."),
    ("--max-pending-age", DURATION, "1h", "age of the oldest pending operation allowed."),
    (
        "--max-near-expiry",
        click.IntRange(0),
        0,
        "live operations allowed within an hour of key expiry.",
    ),
)


def _check_thresholds(fn: Any) -> Any:
    for flag, kind, default, allowed in reversed(_CHECK_THRESHOLDS):
        fn = click.option(
            flag, type=kind, default=default, show_default=True, help=f"With --check: {allowed}"
        )(fn)
    return fn


@command(main, reads=True)
@json_option
@click.option("--check", is_flag=True, help="Exit 1 if a threshold below is exceeded.")
@_check_thresholds
@click.option(
    "--dispatcher-timeout",
    type=DURATION,
    default="30s",
    show_default=True,
    help="A dispatcher silent this long is listed as lost.",
)
@click.option(
    "--dispatcher-check/--no-dispatcher-check",
    default=True,
    show_default=True,
    help="With --check: fail when work is due and no dispatcher was seen within the "
    "dispatcher timeout (turn off for dispatchers run as `dispatch --once`).",
)
@click.option(
    "--settled/--no-settled",
    default=None,
    help="Count all the settled operations (a read of the whole history), or none. "
    "Default: count them up to 10000 (more: shown as not counted), none with --check; "
    "the other figures read the live rows only.",
)
def status(
    obj: Context,
    as_json: bool,
    check: bool,
    max_unresolved: int,
    max_pending_age: timedelta,
    max_near_expiry: int,
    dispatcher_timeout: timedelta,
    dispatcher_check: bool,
    settled: bool | None,
) -> None:
    """Counts per state, backlog per endpoint, reconciliation backlog, dispatchers."""
    from outbox.reconcile.status import SETTLED_COUNT_LIMIT

    report = _reconciler(obj).status(
        max_unresolved=max_unresolved if check else None,
        max_pending_age=max_pending_age if check else None,
        max_near_expiry=max_near_expiry if check else None,
        dispatcher_timeout=dispatcher_timeout,
        require_dispatcher=check and dispatcher_check,
        max_unsendable=0 if check else None,
        settled=not check if settled is None else settled,
        settled_limit=SETTLED_COUNT_LIMIT if settled is None else None,
    )
    if as_json:
        _emit_json(report.as_dict())
    else:
        from rich.table import Table

        table = Table(title="outbox status")
        table.add_column("state")
        table.add_column("operations", justify="right")
        for state, n in report.counts.items():
            table.add_row(state, "-" if n is None else str(n))
        out.print(table)
        over = report.figures.settled_over
        if over is not None:
            out.print(
                f"settled: more than {over}, not counted (outbox status --settled counts "
                "them: a read of the whole history)",
                markup=False,
            )
        age = report.oldest_pending_age_seconds
        out.print(f"oldest pending: {'-' if age is None else f'{age:.1f}s'}")
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(report.unresolved_by_reason.items()) if v)
        out.print(
            f"reconciliation backlog: {sum(report.unresolved_by_reason.values())}"
            + (f" ({reasons})" if reasons else "")
        )
        out.print(f"attempts in the last hour: {report.attempts_last_hour}")
        out.print(key_expiry_line(report.figures))
        if report.watch is not None:
            _render_watch(report.watch)
        from outbox.cli.endpoints import limits_line

        for c in report.as_dict()["endpoint_states"]:
            state = "paused" if c["paused"] else c["circuit"]
            why = c["reason"] or "-"
            out.print(f"endpoint {c['endpoint']}: {state} since {c['since']} ({why})")
            out.print(f"  {limits_line(c)}", markup=False)
        for problem in report.problems:
            out.print(f"PROBLEM: {problem}")
    if check and report.problems:
        sys.exit(EXIT_REFUSED)


def key_expiry_line(fig: Figures) -> str:
    """The key-expiry figures in words (the console's overview says the same)."""
    window = format_duration(fig.near_key_expiry_window)
    line = (
        f"keys near expiry (within {window}): {fig.near_key_expiry}; "
        f"keys already expired: {fig.key_expired}"
    )
    if fig.key_retention_unknown:
        line += f"; key retention unknown: {fig.key_retention_unknown}"
    return line


def _render_watch(watch: Watch) -> None:
    from rich.table import Table

    attempts = watch.attempts_dict()
    if attempts["total"]:
        parts = ", ".join(
            f"{o['delivery']}/{o['verdict']} {o['count']}" for o in attempts["by_outcome"]
        )
        out.print(
            f"  by outcome: {parts}; {attempts['not_succeeded_ratio'] * 100:.1f}% did not succeed",
            markup=False,
        )
    endpoints = watch.endpoints_dict()
    if endpoints:
        table = Table(title="backlog by endpoint")
        for column in ("endpoint", "due", "oldest due", "in flight", "unresolved", "unsendable"):
            table.add_column(column, justify="left" if column == "endpoint" else "right")
        for name, e in endpoints.items():
            age = e["oldest_due_age_seconds"]
            table.add_row(
                name,
                str(e["due"]),
                "-" if age is None else f"{age:.1f}s",
                str(e["in_flight"]),
                str(e["unresolved"]),
                str(e["unsendable"]),
            )
        out.print(table)
    if not watch.dispatchers:
        out.print("dispatchers: none seen (`outbox dispatch` writes a heartbeat every few seconds)")
        return
    table = Table(title=f"dispatchers ({len(watch.live)} live)")
    for column in ("id", "state", "host", "pid", "in flight", "wake", "last seen", "started"):
        table.add_column(column)
    for d in watch.dispatchers:
        row = d.as_dict()
        table.add_row(
            d.row.id,
            d.state,
            d.row.host,
            str(d.row.pid),
            f"{d.row.in_flight}/{d.row.concurrency}",
            d.row.wake_mode or "",
            f"{d.last_seen_seconds_ago:.1f}s ago",
            row["started_at"] or "",
        )
    out.print(table)


def _render_body(op: Any) -> None:
    """The body as the receiver gets it: JSON as text, a form as a table of fields, raw
    bytes as size, digest and a hex head (never as text that a terminal interprets)."""
    from rich.table import Table
    from rich.text import Text

    from outbox.base.safetext import neutralise
    from outbox.forms import body_view

    if op.body_raw is None:
        out.print(f"body: {_shown(op.body)}", markup=False)
        return
    view = body_view(op.content_type, op.body_raw)
    if view["kind"] == "form":
        out.print(f"body: form, {view['size']} bytes ({op.content_type})", markup=False)
        table = Table("field", "value")
        for name, value in view["fields"]:
            table.add_row(Text(neutralise(name)), Text(neutralise(value)))
        out.print(table)
        return
    out.print(
        f"body: {view['size']} bytes of {op.content_type}, sha256 {view.get('sha256', '-')}, "
        f"starts {view.get('hex', '')}",
        markup=False,
    )


def _render_report(report: OperationReport) -> None:
    from rich.table import Table

    from outbox.model import ms_to_iso
    from outbox.reconcile import attempt_dict

    op = report.operation
    out.print(
        f"[bold]{op.operation_id}[/bold]  tenant={op.tenant!r}  endpoint={op.endpoint}",
        markup=True,  # the operation ID, tenant and endpoint name cannot hold markup
    )
    out.print(f"state: {op.state.value}" + (f" ({op.reason.value})" if op.reason else ""))
    out.print(f"why: {report.explanation}")
    if op.last_error:
        out.print(f"last error: {op.last_error}", markup=False)
    if report.blocked_by:
        out.print(f"waiting for: {report.blocked_by} (same ordering key, not yet settled)")
    if op.priority:
        out.print(f"priority: {op.priority}")
    if op.not_before_ms is not None:
        out.print(f"not before: {ms_to_iso(op.not_before_ms)} (a scheduled send)")
    if op.deliver_within_ms is not None:
        by = ms_to_iso(op.created_at_ms + op.deliver_within_ms)
        out.print(f"deliver by: {by} (its own deadline, if never sent)")
    out.print(f"request: {op.method} {op.path}")
    if op.headers:
        out.print(f"headers: {json.dumps(op.headers, sort_keys=True)}")
    _render_body(op)
    if op.result is not None:
        out.print(f"result: {op.result.status_code} {_shown(op.result.body)}", markup=False)
    table = Table(title="attempts")
    for column in (
        "#",
        "request id",
        "started",
        "delivery",
        "status",
        "error",
        "ms",
        "receiver request id",
    ):
        table.add_column(column)
    for a in op.attempts:
        d = attempt_dict(a)
        table.add_row(
            str(a.number),
            a.request_id,
            d["started_at"] or "",
            d["delivery"] or "open",
            str(a.status_code or ""),
            a.error_class or "",
            str(a.duration_ms or ""),
            a.receiver_request_id or "",
        )
    out.print(table)
    for a in op.attempts:
        out.print(f"  - {attempt_dict(a)['description']}", markup=False)
    if op.state is State.UNRESOLVED:
        out.print(f"requeue risk: {report.requeue_risk.note}", markup=False)
    if report.audit:
        out.print("audit:")
        for r in report.audit:
            out.print(
                f"  {r.actor} {r.action} {r.from_state} -> {r.to_state}: {r.note}", markup=False
            )


def _shown(value: Any) -> str:
    """A stored body as JSON, or, sealed and not opened here, what key it needs."""
    # Encrypted rows (outbox.store.sealing) without their key: say so, never "null".
    return str(value) if type(value).__name__ == "Sealed" else json.dumps(value, sort_keys=True)


def _show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    report = _reconciler(obj).show(operation_id, tenant=tenant)
    if as_json:
        _emit_json(report.as_dict())
    else:
        _render_report(report)


@command(main, reads=True)
@click.argument("operation_id")
@click.option("--tenant", default="", help="The tenant (namespace) of the operation ID.")
@json_option
def show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    """An operation's arguments, state and every attempt."""
    _show(obj, operation_id, tenant, as_json)


@command(main, reads=True)
@click.option("--actor", default=None, help="Only this operator's actions.")
@click.option("--operation", "operation_id", default=None, help="Only this operation ID's.")
@click.option(
    "--older-than", type=DURATION, default=None, help="Only actions longer ago than this."
)
@click.option(
    "--newer-than", type=DURATION, default=None, help="Only actions more recent than this."
)
@page_options(500)
@json_option
def audit(
    obj: Context,
    actor: str | None,
    operation_id: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    page: Page,
    as_json: bool,
) -> None:
    """The audit trail of operator actions, newest first, and how many match in all."""
    from outbox.reconcile import audit_dict
    from outbox.reconcile.browse import Browser

    ob = obj.outbox()
    now_ms = ob.clock.now_ms()
    log = Browser(ob).audit_log(
        actor=actor,
        operation_id=operation_id,
        until_ms=None if older_than is None else now_ms - _ms(older_than) + 1,
        since_ms=None if newer_than is None else now_ms - _ms(newer_than),
        limit=page.limit,
        offset=page.offset,
    )
    entries = [
        {"tenant": r.tenant, "operation_id": r.operation_id, **audit_dict(r)} for r in log.items
    ]
    if as_json:
        _emit_json(page.as_json(log.total, "entries", entries))
        return
    from rich.table import Table

    table = Table(title=f"audit ({len(entries)} shown of {log.total} matching)")
    for column in ("at", "actor", "action", "operation id", "tenant", "from", "to", "note"):
        table.add_column(column)
    for e in entries:
        table.add_row(
            e["at"],
            e["actor"],
            e["action"],
            e["operation_id"],
            e["tenant"],
            e["from_state"] or "",
            e["to_state"] or "",
            e["note"] or "",
        )
    out.print(table)
    more = page.next_words(len(entries), log.total)
    if more is not None:
        filters = _filter_words(
            actor=actor, operation=operation_id, older_than=older_than, newer_than=newer_than
        )
        out.print(f"more: {obj.command_hint('audit', *filters, *more)}", markup=False)


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)
