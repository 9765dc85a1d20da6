"""The ``outbox`` command: a thin shell over the library.

Each command parses its options, makes one library call and renders the result as a
table (default) or JSON (``--json``). Every failure is one line on stderr and a
documented exit code (see :mod:`outbox.cli_support`); ``--debug`` adds the traceback.
Read commands never create or migrate a database. Heavy modules (the dispatcher, httpx,
aiohttp, Alembic, tenacity) are imported only by the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from outbox.cli_support import (
    DB_ENVVARS,
    DURATION,
    EXIT_REFUSED,
    EXIT_USAGE,
    Context,
    OutboxGroup,
    command,
    fail,
)
from outbox.errors import ConfigurationError, StoreError
from outbox.model import Reason, State
from outbox.safetext import neutralise

if TYPE_CHECKING:
    from outbox.bulk import BulkReport, Selection
    from outbox.client import Outbox
    from outbox.reconcile import OperationReport
    from outbox.status import Watch


class SafeConsole(Console):
    """A rich Console that spells out control characters in every string it renders
    (``print`` arguments and table cells alike; ``outbox.safetext``), so a stored note,
    error or body cannot clear or rewrite the operator's screen. Rich's own styling is
    unaffected."""

    def render_str(self, text: str, **kwargs: Any) -> Any:
        return super().render_str(neutralise(text), **kwargs)


# Markup off by default: a stored string in a table cell ("[link=…]") must print as
# written, never be read as rich markup. Our own styled lines ask for markup=True.
out = SafeConsole(highlight=False, soft_wrap=True, markup=False)
err = SafeConsole(highlight=False, soft_wrap=True, stderr=True, markup=False)

_LOG_LEVELS = ["debug", "info", "warning", "error", "critical"]


def json_option(fn: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _reconciler(obj: Context) -> Any:
    from outbox.reconcile import Reconciler

    return Reconciler(obj.outbox())


@click.group(cls=OutboxGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", envvar=list(DB_ENVVARS), help="Database URL (or OUTBOX_DB).")
@click.option(
    "--schema",
    envvar="OUTBOX_SCHEMA",
    help="PostgreSQL schema holding the outbox tables (or OUTBOX_SCHEMA).",
)
@click.option(
    "--app",
    envvar="OUTBOX_APP",
    help="module:attr naming the application's Outbox (endpoints, credentials).",
)
@click.option(
    "--log-level",
    type=click.Choice(_LOG_LEVELS, case_sensitive=False),
    default="info",
    show_default=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    show_default=True,
)
@click.option("--debug", is_flag=True, help="On failure, print the traceback too.")
@click.version_option(package_name="outbox")
@click.pass_context
def main(
    ctx: click.Context,
    db: str | None,
    schema: str | None,
    app: str | None,
    log_level: str,
    log_format: str,
    debug: bool,
) -> None:
    """A durable, client-side operation outbox for HTTP integrations.

    --db, --schema, --app and --debug may come before or after the command.
    """
    # Piped or captured output: never cut IDs to an 80-column guess; operators copy them.
    out.width = None if sys.stdout.isatty() else 4096  # type: ignore[assignment]
    obj = ctx.ensure_object(Context)
    obj.db, obj.schema, obj.app, obj.debug = db, schema, app, debug
    obj.log_level, obj.log_format = log_level, log_format
    if db is not None and ctx.get_parameter_source("db") is click.core.ParameterSource.ENVIRONMENT:
        obj.db_env = next((name for name in DB_ENVVARS if os.environ.get(name)), None)
    ctx.call_on_close(obj.close)


# -- schema ---------------------------------------------------------------------------


@command(main)
def migrate(obj: Context) -> None:
    """Create or upgrade the outbox tables (the only command that creates anything)."""
    from outbox.store.engine import create_engine
    from outbox.store.migrate import HEAD, current_revision, upgrade

    if obj.db is None and obj.app:
        url: Any = obj.outbox().engine.url
    elif obj.db is None:
        raise click.UsageError("name the database: --db URL (or set OUTBOX_DB)")
    else:
        url = obj.db
    engine = create_engine(url, schema=obj.schema)
    try:
        before = current_revision(engine)
        upgrade(engine)
        where = f" in schema {obj.schema}" if obj.schema else ""
        click.echo(f"outbox schema at revision {HEAD}{where} (was {before or 'empty'})")
    finally:
        engine.dispose()


# -- reading ----------------------------------------------------------------------------


@command(main, reads=True)
@json_option
@click.option("--check", is_flag=True, help="Exit 1 if a threshold below is exceeded.")
@click.option(
    "--max-unresolved",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="With --check: reconciliation backlog allowed.",
)
@click.option(
    "--max-pending-age",
    type=DURATION,
    default="1h",
    show_default=True,
    help="With --check: age of the oldest pending operation allowed.",
)
@click.option(
    "--max-near-expiry",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="With --check: live operations allowed within an hour of key expiry.",
)
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
def status(
    obj: Context,
    as_json: bool,
    check: bool,
    max_unresolved: int,
    max_pending_age: timedelta,
    max_near_expiry: int,
    dispatcher_timeout: timedelta,
    dispatcher_check: bool,
) -> None:
    """Counts per state, backlog per endpoint, reconciliation backlog, dispatchers."""
    report = _reconciler(obj).status(
        max_unresolved=max_unresolved if check else None,
        max_pending_age=max_pending_age if check else None,
        max_near_expiry=max_near_expiry if check else None,
        dispatcher_timeout=dispatcher_timeout,
        require_dispatcher=check and dispatcher_check,
        max_unsendable=0 if check else None,
    )
    if as_json:
        _emit_json(report.as_dict())
    else:
        from rich.table import Table

        table = Table(title="outbox status")
        table.add_column("state")
        table.add_column("operations", justify="right")
        for state, n in report.counts.items():
            table.add_row(state, str(n))
        out.print(table)
        age = report.oldest_pending_age_seconds
        out.print(f"oldest pending: {'-' if age is None else f'{age:.1f}s'}")
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(report.unresolved_by_reason.items()))
        out.print(
            f"reconciliation backlog: {sum(report.unresolved_by_reason.values())}"
            + (f" ({reasons})" if reasons else "")
        )
        out.print(f"attempts in the last hour: {report.attempts_last_hour}")
        out.print(f"live operations within an hour of key expiry: {report.keys_near_expiry}")
        if report.watch is not None:
            _render_watch(report.watch)
        for problem in report.problems:
            out.print(f"PROBLEM: {problem}")
    if check and report.problems:
        sys.exit(EXIT_REFUSED)


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
    for column in ("id", "state", "host", "pid", "in flight", "last seen", "started"):
        table.add_column(column)
    for d in watch.dispatchers:
        row = d.as_dict()
        table.add_row(
            d.row.id,
            d.state,
            d.row.host,
            str(d.row.pid),
            f"{d.row.in_flight}/{d.row.concurrency}",
            f"{d.last_seen_seconds_ago:.1f}s ago",
            row["started_at"] or "",
        )
    out.print(table)


def _render_report(report: OperationReport) -> None:
    from rich.table import Table

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
    out.print(f"request: {op.method} {op.path}")
    if op.headers:
        out.print(f"headers: {json.dumps(op.headers, sort_keys=True)}")
    out.print(f"body: {json.dumps(op.body, sort_keys=True)}", markup=False)
    if op.result is not None:
        out.print(
            f"result: {op.result.status_code} {json.dumps(op.result.body, sort_keys=True)}",
            markup=False,
        )
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


# -- dispatching --------------------------------------------------------------------------


@command(main)
@click.option("--once", is_flag=True, help="Claim and send one batch, then exit.")
@click.option(
    "--until-empty",
    is_flag=True,
    help="Send what is due until nothing is, then exit (for cron and batch jobs).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 10_000),
    default=None,
    help="Requests on the wire at once (default 32).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Serve /metrics (Prometheus), /healthz and /readyz on this port.",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option(
    "--processes",
    type=click.IntRange(1, 1024),
    default=None,
    help="Run N dispatcher processes under a supervisor (restarts, SIGTERM drains all).",
)
@json_option
def dispatch(
    obj: Context,
    once: bool,
    until_empty: bool,
    concurrency: int | None,
    metrics_port: int | None,
    metrics_host: str,
    processes: int | None,
    as_json: bool,
) -> None:
    """Run the dispatcher. SIGTERM or Ctrl-C: stop claiming, finish in-flight work, exit 0."""
    if once and until_empty:
        raise click.UsageError("--once and --until-empty exclude each other")
    if not obj.app:
        raise click.UsageError("dispatch needs --app module:attr: endpoints live in code")
    if processes is not None:
        if once or until_empty:
            flag = "--once" if once else "--until-empty"
            raise click.UsageError(f"{flag} and --processes do not go together")
        if metrics_port is not None:
            raise click.UsageError(
                "--metrics-port and --processes do not go together: each process would "
                "need its own port"
            )
        _supervise(obj, processes, concurrency, as_json)
        return
    from outbox.supervise import catch_sigterm_early

    # Before loading the application: a SIGTERM during start-up stops us cleanly.
    stop = None if once or until_empty else catch_sigterm_early()
    ob = _open_waiting_for_database(obj, stop)
    if not ob.endpoints:
        raise click.UsageError(f"--app {obj.app} registers no endpoint: nothing can be sent")
    server = None
    if metrics_port is not None:
        from outbox.metrics import serve

        try:
            server = serve(ob.metrics(), host=metrics_host, port=metrics_port)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}"
            ) from exc
    try:
        if once:
            summary = ob.dispatch_once()
        elif until_empty:
            with _live_line() as show_progress:
                summary = ob.run_dispatcher(
                    concurrency=concurrency, until_empty=True, on_progress=show_progress
                )
        else:
            summary = ob.run_dispatcher(concurrency=concurrency, stop=stop)
    finally:
        if server is not None:
            server.close()
    if as_json:
        _emit_json(summary.as_dict())
    else:
        out.print(" ".join(f"{k}={v}" for k, v in summary.as_dict().items()))


def _supervise(obj: Context, processes: int, concurrency: int | None, as_json: bool) -> None:
    from outbox.supervise import Supervisor

    # Fail here, once, on what every child would fail on (a bad module, no endpoint).
    if not obj.outbox().endpoints:
        raise click.UsageError(f"--app {obj.app} registers no endpoint: nothing can be sent")
    obj.close()  # the children open their own connections
    command = [sys.executable, "-m", "outbox.cli", *_child_args(obj), "dispatch", "--json"]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    supervisor = Supervisor(command, processes)
    report = supervisor.run()
    if as_json:
        _emit_json(report.as_dict())
    else:
        out.print(" ".join(f"{k}={v}" for k, v in report.as_dict().items()), markup=False)
    if supervisor.exit_status:
        sys.exit(supervisor.exit_status)


def _child_args(obj: Context) -> list[str]:
    """The options this command was given (before or after it), for a child process."""
    args = ["--log-level", obj.log_level, "--log-format", obj.log_format]
    for option, value in (("--db", obj.db), ("--schema", obj.schema), ("--app", obj.app)):
        if value is not None:
            args += [option, value]
    return args


@contextmanager
def _live_line() -> Iterator[Any]:
    """A one-line progress display on a terminal (stderr); nothing when piped."""
    if not err.is_terminal:
        yield lambda _summary: None
        return
    from rich.live import Live
    from rich.text import Text

    with Live(Text("starting"), console=err, transient=True, refresh_per_second=4) as live:

        def show(summary: Any) -> None:
            d = summary.as_dict()
            live.update(
                Text(
                    f"claimed {d['claimed']}  succeeded {d['succeeded']}  failed {d['failed']}"
                    f"  retry later {d['retry_scheduled']}  unresolved {d['unresolved']}"
                )
            )

        yield show


def _open_waiting_for_database(obj: Context, stop: threading.Event | None) -> Outbox:
    """A dispatcher started while its database is down (restarting, failing over) waits
    for it with backoff, as a running one does; a SIGTERM meanwhile (``stop``) ends the
    wait with the database's error."""
    from sqlalchemy.exc import DBAPIError

    from outbox.dispatch import logger

    delay = 0.25
    while True:
        try:
            return obj.outbox()
        except StoreError as exc:
            if not isinstance(exc.__cause__, DBAPIError):
                raise  # a schema or file problem: waiting will not fix it
            logger.warning("store_unavailable", phase="start", detail=str(exc)[:300],
                           retry_in_seconds=delay)  # fmt: skip
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                raise
            delay = min(delay * 2, 5.0)


# -- operator actions -----------------------------------------------------------------------


@main.group()
def reconcile() -> None:
    """The reconciliation queue: operations whose outcome is not proven."""


def filter_options(fn: Any) -> Any:
    """The selection of a bulk action (with --all) or a listing."""
    for option in reversed(
        (
            click.option("--endpoint", default=None, help="Only this endpoint's operations."),
            click.option(
                "--reason",
                type=click.Choice([r.value for r in Reason]),
                default=None,
                help="Only unresolved operations with this reason.",
            ),
            click.option(
                "--older-than",
                type=DURATION,
                default=None,
                help="Only those last changed longer ago than this (e.g. 2h, 1h30m).",
            ),
            click.option(
                "--newer-than",
                type=DURATION,
                default=None,
                help="Only those last changed more recently than this.",
            ),
        )
    ):
        fn = option(fn)
    return fn


@command(reconcile, "list", reads=True)
@click.option("--tenant", default=None, help="Only this tenant's operations.")
@filter_options
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True)
@json_option
def reconcile_list(
    obj: Context,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """Unresolved operations, oldest first, and how many match in all."""
    from outbox.reconcile import operation_dict

    rec = _reconciler(obj)
    filters: dict[str, Any] = {
        "tenant": tenant,
        "endpoint": endpoint,
        "reason": reason,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    ops = rec.list(**filters, limit=limit, offset=offset)
    total = rec.count(**filters)
    if as_json:
        operations = [operation_dict(op) for op in ops]
        _emit_json({"total": total, "limit": limit, "offset": offset, "operations": operations})
        return
    from rich.table import Table

    table = Table(title=f"unresolved operations ({len(ops)} shown of {total} matching)")
    for column in ("operation id", "tenant", "endpoint", "reason", "attempts", "since"):
        table.add_column(column)
    for op in ops:
        table.add_row(
            op.operation_id,
            op.tenant,
            op.endpoint,
            op.reason.value if op.reason else "",
            str(op.attempts_total),
            operation_dict(op)["updated_at"],
        )
    out.print(table)
    if offset + len(ops) < total:
        more = [*_filter_words(**filters), "--limit", str(limit)]
        more += ["--offset", str(offset + len(ops))]
        out.print(f"more: {obj.command_hint('reconcile', 'list', *more)}", markup=False)
    if ops:
        first = ops[0]
        tenant_words = ["--tenant", first.tenant] if first.tenant else []
        show_first = obj.command_hint("reconcile", "show", first.operation_id, *tenant_words)
        out.print(f"next: {show_first}, then resolve or requeue it", markup=False)


@command(main, reads=True)
@click.option("--actor", default=None, help="Only this operator's actions.")
@click.option("--operation", "operation_id", default=None, help="Only this operation ID's.")
@click.option(
    "--older-than", type=DURATION, default=None, help="Only actions longer ago than this."
)
@click.option(
    "--newer-than", type=DURATION, default=None, help="Only actions more recent than this."
)
@click.option("--limit", type=click.IntRange(1, 500), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True)
@json_option
def audit(
    obj: Context,
    actor: str | None,
    operation_id: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """The audit trail of operator actions, newest first, and how many match in all."""
    from outbox.browse import Browser
    from outbox.reconcile import audit_dict

    ob = obj.outbox()
    now_ms = ob.clock.now_ms()
    page = Browser(ob).audit_log(
        actor=actor,
        operation_id=operation_id,
        until_ms=None if older_than is None else now_ms - _ms(older_than) + 1,
        since_ms=None if newer_than is None else now_ms - _ms(newer_than),
        limit=limit,
        offset=offset,
    )
    entries = [
        {"tenant": r.tenant, "operation_id": r.operation_id, **audit_dict(r)} for r in page.items
    ]
    if as_json:
        _emit_json({"total": page.total, "limit": limit, "offset": offset, "entries": entries})
        return
    from rich.table import Table

    table = Table(title=f"audit ({len(entries)} shown of {page.total} matching)")
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
    if offset + len(entries) < page.total:
        more = [
            *_filter_words(
                actor=actor, operation=operation_id, older_than=older_than, newer_than=newer_than
            ),
            *("--limit", str(limit), "--offset", str(offset + len(entries))),
        ]
        out.print(f"more: {obj.command_hint('audit', *more)}", markup=False)


def _ms(duration: timedelta) -> int:
    return int(duration.total_seconds() * 1000)


def _filter_words(**filters: Any) -> list[str]:
    """The command-line words that give these filters again."""
    from outbox.durations import format_duration

    words: list[str] = []
    for name, value in filters.items():
        if value is None:
            continue
        shown = format_duration(value) if isinstance(value, timedelta) else str(value)
        words += [f"--{name.replace('_', '-')}", shown]
    return words


@command(reconcile, "show", reads=True)
@click.argument("operation_id")
@click.option("--tenant", default="", help="The tenant (namespace) of the operation ID.")
@json_option
def reconcile_show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    """The evidence: every attempt, its request ID and what was observed."""
    _show(obj, operation_id, tenant, as_json)


def bulk_options(fn: Any) -> Any:
    """One operation ID, or --all with filters; --dry-run and --yes."""
    for option in reversed(
        (
            click.argument("operation_id", required=False),
            click.option("--all", "every", is_flag=True, help="Act on every match of the filters."),
            click.option(
                "--tenant",
                default=None,
                help="The operation's tenant (default ''); with --all, a filter.",
            ),
            filter_options,
            click.option(
                "--dry-run", is_flag=True, help="With --all: say what would change; change nothing."
            ),
            click.option("--yes", is_flag=True, help="With --all: do not ask for confirmation."),
        )
    ):
        fn = option(fn)
    return fn


def _selection(
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    filters: dict[str, Any],
    flags: dict[str, bool],
) -> Selection | None:
    """The bulk selection with --all; None for one operation (refusing bulk-only flags)."""
    if every == (operation_id is not None):
        raise click.UsageError("name one operation, or pass --all (with filters)")
    if not every:
        given = [f"--{k.replace('_', '-')}" for k, v in {**filters, **flags}.items() if v]
        if given:
            raise click.UsageError(f"{', '.join(given)} go with --all, not with one operation")
        return None
    from outbox.bulk import Selection

    return Selection(tenant=tenant, **filters)


def _run_bulk(
    obj: Context,
    action: str,
    selection: Selection,
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
    **kwargs: Any,
) -> None:
    """Dry run (always first), confirmation on a terminal, then the run with a progress
    bar, and the summary. Exit 1 if anything was refused or changed by someone else."""
    from outbox.bulk import bulk, select

    rec = _reconciler(obj)
    ops = select(rec, action, selection)
    plan = bulk(rec, action, selection, dry_run=True, selected=ops, **kwargs)
    if dry_run:
        _bulk_summary(plan, as_json)
        return
    would = plan.counts["changed"]
    if would and not yes:
        if not sys.stdin.isatty():
            fail(
                EXIT_USAGE,
                f"{action} --all would change {would} operations; without a terminal to "
                "confirm on, pass --yes (or look first with --dry-run)",
            )
        _bulk_summary(plan, False, to=err)
        click.confirm(f"{action} {would} operations?", abort=True, err=True)
    with _progress_bar(f"{action}", len(ops)) as advance:
        report = bulk(rec, action, selection, selected=ops, on_progress=advance, **kwargs)
    _bulk_summary(report, as_json)
    if not report.exit_ok:
        sys.exit(EXIT_REFUSED)


@contextmanager
def _progress_bar(label: str, total: int) -> Iterator[Any]:
    """A rich progress bar on a terminal (stderr); nothing when piped."""
    if not err.is_terminal or total == 0:
        yield None
        return
    from rich.progress import Progress

    with Progress(console=err, transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda done, _total: progress.update(task, completed=done)


def _bulk_summary(report: BulkReport, as_json: bool, *, to: Console | None = None) -> None:
    if as_json:
        _emit_json(report.as_dict())
        return
    console = to or out
    counts = report.counts
    verb = "would change" if report.dry_run else "changed"
    head = "dry run: " if report.dry_run else ""
    console.print(
        f"{head}{report.action}: {len(report.items)} matched, {verb} {counts['changed']}, "
        f"refused {counts['refused']}, changed by someone else "
        f"{counts['changed_by_someone_else']}",
        markup=False,
    )
    for why, n in report.refusals.items():
        console.print(f"  refused {n}: {why}", markup=False)
    for item in report.items:
        tenant = f" (tenant {item.tenant!r})" if item.tenant else ""
        if item.outcome.value == "changed":
            line = f"{'would change' if report.dry_run else 'changed'} -> {item.detail}"
        else:
            line = f"{item.outcome.value.replace('_', ' ')}: {item.detail}"
        console.print(f"  {item.operation_id}{tenant}: {line}", markup=False)


def _one_done(op: Any, as_json: bool, message: str) -> None:
    from outbox.reconcile import operation_dict

    if as_json:
        _emit_json(operation_dict(op))
    else:
        out.print(message, markup=False)


@command(reconcile, "resolve")
@bulk_options
@click.option("--as", "outcome", type=click.Choice(["succeeded", "failed"]), required=True)
@click.option("--note", required=True, help="What you checked, for the audit trail.")
@click.option("--operator", default=None, help="Your name (default: the OS user).")
@json_option
def reconcile_resolve(
    obj: Context,
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    dry_run: bool,
    yes: bool,
    outcome: str,
    note: str,
    operator: str | None,
    as_json: bool,
) -> None:
    """Settle an unresolved operation (or, with --all, every match) as succeeded or failed."""
    filters = {
        "endpoint": endpoint,
        "reason": reason,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    selection = _selection(operation_id, every, tenant, filters, {"dry_run": dry_run, "yes": yes})
    if selection is not None:
        _run_bulk(obj, "resolve", selection, dry_run=dry_run, yes=yes, as_json=as_json,
                  outcome=outcome, note=note, operator=operator)  # fmt: skip
        return
    assert operation_id is not None
    op = _reconciler(obj).resolve(
        operation_id, tenant=tenant or "", outcome=outcome, note=note, operator=operator
    )
    _one_done(op, as_json, f"resolved {operation_id} as {op.state.value}")


@command(reconcile, "requeue")
@bulk_options
@click.option("--note", required=True, help="What you checked, for the audit trail.")
@click.option("--operator", default=None, help="Your name (default: the OS user).")
@click.option(
    "--accept-duplicate-risk",
    is_flag=True,
    help=(
        "Requeue even though the receiver may have forgotten the key: restarts the key's "
        "life (new window and key retention from the next attempt); if an earlier attempt "
        "was applied, the resend may cause a second effect."
    ),
)
@json_option
def reconcile_requeue(
    obj: Context,
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    dry_run: bool,
    yes: bool,
    note: str,
    operator: str | None,
    accept_duplicate_risk: bool,
    as_json: bool,
) -> None:
    """Send again under the same operation ID, with a new retry window.

    Decided from the database alone (the policy stored with each operation): no --app
    needed; the dispatcher that sends it needs the application.
    """
    filters = {
        "endpoint": endpoint,
        "reason": reason,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    selection = _selection(operation_id, every, tenant, filters, {"dry_run": dry_run, "yes": yes})
    if selection is not None:
        _run_bulk(obj, "requeue", selection, dry_run=dry_run, yes=yes, as_json=as_json,
                  note=note, operator=operator,
                  accept_duplicate_risk=accept_duplicate_risk)  # fmt: skip
        return
    assert operation_id is not None
    op = _reconciler(obj).requeue(
        operation_id,
        tenant=tenant or "",
        note=note,
        operator=operator,
        accept_duplicate_risk=accept_duplicate_risk,
    )
    _one_done(op, as_json, f"requeued {operation_id}: pending, same operation ID")


@command(main)
@click.argument("operation_id", required=False)
@click.option("--all", "every", is_flag=True, help="Cancel every pending match of the filters.")
@click.option(
    "--tenant", default=None, help="The operation's tenant (default ''); with --all, a filter."
)
@click.option("--endpoint", default=None, help="With --all: only this endpoint's operations.")
@click.option("--older-than", type=DURATION, default=None, help="With --all: last changed before.")
@click.option("--newer-than", type=DURATION, default=None, help="With --all: last changed since.")
@click.option("--dry-run", is_flag=True, help="With --all: say what would change; change nothing.")
@click.option("--yes", is_flag=True, help="With --all: do not ask for confirmation.")
@click.option("--note", required=True, help="Why, for the audit trail.")
@click.option("--operator", default=None)
@json_option
def cancel(
    obj: Context,
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    endpoint: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    dry_run: bool,
    yes: bool,
    note: str,
    operator: str | None,
    as_json: bool,
) -> None:
    """Cancel a pending operation that was never sent (or, with --all, every match)."""
    filters = {"endpoint": endpoint, "older_than": older_than, "newer_than": newer_than}
    selection = _selection(operation_id, every, tenant, filters, {"dry_run": dry_run, "yes": yes})
    if selection is not None:
        _run_bulk(obj, "cancel", selection, dry_run=dry_run, yes=yes, as_json=as_json,
                  note=note, operator=operator)  # fmt: skip
        return
    assert operation_id is not None
    op = _reconciler(obj).cancel(operation_id, tenant=tenant or "", note=note, operator=operator)
    _one_done(op, as_json, f"cancelled {operation_id}")


@command(main)
@click.option(
    "--older-than", type=DURATION, required=True, help="e.g. 30d: finished longer ago than this."
)
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option(
    "--vacuum",
    is_flag=True,
    help="SQLite: afterwards give the freed space back to the file system (VACUUM).",
)
@click.option("--operator", default=None)
@json_option
def purge(
    obj: Context,
    older_than: timedelta,
    dry_run: bool,
    vacuum: bool,
    operator: str | None,
    as_json: bool,
) -> None:
    """Delete old succeeded, failed and cancelled operations; never unresolved ones."""
    rec = _reconciler(obj)
    if vacuum and rec.store.dialect != "sqlite":
        raise click.UsageError("--vacuum is for SQLite; PostgreSQL's autovacuum does this")
    if dry_run and vacuum:
        raise click.UsageError("--dry-run changes nothing; --vacuum would")
    if dry_run:
        removed = rec.purge(older_than=older_than, dry_run=True)
    else:
        total = sum(rec.purge(older_than=older_than, dry_run=True).values())
        with _progress_bar("purge", total) as advance:
            done = [0]

            def on_batch(n: int) -> None:
                done[0] += n
                if advance is not None:
                    advance(done[0], total)

            removed = rec.purge(older_than=older_than, operator=operator, on_batch=on_batch)
    result: dict[str, Any] = {
        "removed": removed,
        "total": sum(removed.values()),
        "dry_run": dry_run,
    }
    if vacuum:
        before, after = rec.vacuum()
        result["bytes_before"], result["bytes_after"] = before, after
    if as_json:
        _emit_json(result)
        return
    detail = ", ".join(f"{k}={v}" for k, v in sorted(removed.items())) or "nothing"
    verb = "would purge" if dry_run else "purged"
    out.print(f"{verb} {result['total']} operations ({detail})")
    if vacuum:
        out.print(f"vacuum: {result['bytes_before']} bytes before, {result['bytes_after']} after")


@command(main)
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Keep the demo's files here (default: a temporary directory, removed).",
)
def demo(obj: Context, directory: str | None) -> None:
    """A guided run against a local receiver: lost responses, replays, reconciliation."""
    from outbox.demo import run_demo

    del obj
    run_demo(directory, out)


@command(main, "console")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True)
@click.option(
    "--allow-remote",
    is_flag=True,
    help="Allow a non-loopback --host (needs --token-file or OUTBOX_CONSOLE_TOKEN).",
)
@click.option(
    "--token-file",
    default=None,
    help="Sign-in tokens, one per line: TOKEN or NAME:TOKEN (else OUTBOX_CONSOLE_TOKEN, "
    "else one is generated and printed once).",
)
@click.option(
    "--operator",
    default=None,
    help="The name audited for a token given without one (default: the OS user).",
)
@click.option("--read-only", is_flag=True, help="Show everything, change nothing.")
def console_command(
    obj: Context,
    host: str,
    port: int,
    allow_remote: bool,
    token_file: str | None,
    operator: str | None,
    read_only: bool,
) -> None:
    """A web console for the reconciliation queue (needs the `console` extra).

    Every action goes through the same library calls as the commands here and is
    audited under the name tied to the sign-in token. Binds 127.0.0.1 by default.
    """

    try:
        from outbox.console.auth import Credentials
        from outbox.console.server import check_bind, serve
    except ImportError as exc:
        raise click.UsageError(
            f"outbox console needs the console extra: pip install 'outbox[console]' ({exc})"
        ) from exc
    from outbox.reconcile import default_operator

    name = operator or default_operator()
    credentials = Credentials.configured(token_file=token_file, default_name=name)
    check_bind(host, allow_remote=allow_remote, credentials=credentials)
    ob = obj.outbox()  # never creates: a missing file or schema is exit 3
    serve(
        ob,
        host=host,
        port=port,
        credentials=credentials or Credentials.generate(name),
        read_only=read_only,
        echo=click.echo,
    )


# -- receiver conformance check and status lookups ------------------------------------------


@command(main, "check-receiver")
@click.option("--endpoint", required=True, help="The registered endpoint to probe.")
@click.option("--path", required=True, help="The operation's path, e.g. /reservations.")
@click.option("--json-body", required=True, help="The probe operation's JSON body.")
@click.option("--method", default="POST", show_default=True)
@click.option("--tenant", default="", help="Tenant sent with the probes (if the endpoint does).")
@click.option(
    "--retention-delay",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="Seconds before re-sending a key, as a hint about key retention.",
)
@click.option("--concurrency", type=click.IntRange(2, 256), default=8, show_default=True)
@click.option(
    "--i-understand-this-sends-real-requests",
    "allow_unsafe",
    is_flag=True,
    help="Probe an endpoint not marked probe_safe=True (the probes create real effects).",
)
@click.option("--strict", is_flag=True, help="Exit 1 also when a check could not tell (undecided).")
@click.option(
    "--probe-tenants",
    default=None,
    metavar="A,B",
    help="The two tenants of the tenant-scoping probe (default outbox-probe-tenant-a,-b).",
)
@json_option
def check_receiver_command(
    obj: Context,
    endpoint: str,
    path: str,
    json_body: str,
    method: str,
    tenant: str,
    retention_delay: float,
    concurrency: int,
    allow_unsafe: bool,
    strict: bool,
    probe_tenants: str | None,
    as_json: bool,
) -> None:
    """Probe a (staging) receiver's idempotency: one verdict line per property.

    Exit 0 when no check failed (with --strict: and none was undecided), 1 when one did,
    2 on a usage error or an endpoint not marked probe_safe. Passing proves nothing
    about production.
    """
    from outbox.checker import PROBE_TENANTS, check_receiver

    tenants = PROBE_TENANTS
    if probe_tenants is not None:
        parts = tuple(t.strip() for t in probe_tenants.split(","))
        if len(parts) != 2:
            raise click.UsageError("--probe-tenants takes two tenants: A,B")
        tenants = (parts[0], parts[1])

    try:
        body = json.loads(json_body)
    except ValueError as exc:
        raise click.UsageError(f"--json-body is not JSON: {exc}") from exc
    if not obj.app:
        raise click.UsageError("check-receiver needs --app module:attr: endpoints live in code")
    report = check_receiver(
        obj.outbox(),
        endpoint=endpoint,
        method=method,
        path=path,
        json_body=body,
        tenant=tenant,
        retention_delay=retention_delay,
        concurrency=concurrency,
        allow_unsafe=allow_unsafe,
        strict=strict,
        probe_tenants=tenants,
    )
    if as_json:
        _emit_json(report.as_dict())
    else:
        for line in report.lines():
            out.print(line, markup=False)
    sys.exit(report.exit_code)


@command(reconcile, "probe")
@click.argument("operation_id", required=False)
@click.option("--all", "every", is_flag=True, help="Probe every unresolved match of the filters.")
@click.option("--tenant", default=None, help="The operation's tenant (with --all: a filter).")
@filter_options
@json_option
def reconcile_probe(
    obj: Context,
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    as_json: bool,
) -> None:
    """Ask the receiver (the endpoint's status_lookup) and settle what it answers.

    Applied: resolved as succeeded. Not applied, within the key retention: requeued under
    the same operation ID. After it: left unresolved, evidence in the audit. Unknown: left
    for you. Every action is audited as actor status-lookup.
    """
    filters = {
        "endpoint": endpoint,
        "reason": reason,
        "older_than": older_than,
        "newer_than": newer_than,
    }
    _selection(operation_id, every, tenant, filters, {})
    rec = _reconciler(obj)
    if operation_id is not None:
        outcomes = [rec.probe(operation_id, tenant=tenant or "")]
    else:
        outcomes = rec.probe_all(tenant=tenant, **filters)
    if as_json:
        _emit_json([o.as_dict() for o in outcomes])
        return
    for o in outcomes:
        tenant_note = f" (tenant {o.tenant!r})" if o.tenant else ""
        out.print(
            f"{o.operation_id}{tenant_note}: {o.action.value}, now {o.state.value}",
            markup=False,
        )
        if o.lookup is not None:
            out.print(f"  lookup: {o.lookup.describe()}", markup=False)
        if o.lookup is None or o.detail != o.lookup.detail:
            out.print(f"  {o.detail}", markup=False)
    out.print(f"{len(outcomes)} operations probed", markup=False)


if __name__ == "__main__":  # pragma: no cover
    main()
