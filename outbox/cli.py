"""The ``outbox`` command: a thin shell over the library.

Each command parses its options, makes one library call and renders the result as a
table (default) or JSON (``--json``). Exit codes: 0 ok, 1 refused (wrong state,
conflict, not found, a failed ``status --check``), 2 usage, 3 the database failed.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import click
from rich.console import Console
from rich.table import Table

from outbox import logs
from outbox.client import Outbox
from outbox.errors import (
    ConfigurationError,
    OperationConflict,
    OperationNotFound,
    OperatorActionRefused,
    OutboxError,
    StoreError,
    ValidationError,
)
from outbox.model import Reason, State
from outbox.reconcile import (
    OperationReport,
    Reconciler,
    attempt_dict,
    operation_dict,
    parse_duration,
)
from outbox.status import Watch

F = TypeVar("F", bound=Callable[..., Any])
EXIT_REFUSED, EXIT_USAGE, EXIT_STORE = 1, 2, 3

out = Console(highlight=False, soft_wrap=True)


class Context:
    def __init__(self, db: str | None, app: str | None) -> None:
        self.db = db
        self.app = app
        self._outbox: Outbox | None = None

    def outbox(self) -> Outbox:
        if self._outbox is None:
            self._outbox = load_outbox(self.db, self.app)
        return self._outbox

    def close(self) -> None:
        if self._outbox is not None:
            self._outbox.close()


def load_outbox(db: str | None, app: str | None) -> Outbox:
    """The application's Outbox (``--app module:attr``) or one on ``--db``."""
    if app:
        module_name, _, attr = app.partition(":")
        if not attr:
            raise click.UsageError("--app takes module:attribute, e.g. myapp.jobs:outbox")
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
        target = getattr(module, attr)
        ob = target() if callable(target) and not isinstance(target, Outbox) else target
        if not isinstance(ob, Outbox):
            raise click.UsageError(f"{app} is not an outbox.Outbox")
        return ob
    if not db:
        raise click.UsageError("name the database: --db URL or OUTBOX_DATABASE_URL (or --app)")
    return Outbox(db)


def json_option(fn: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(fn)


def tenant_option(fn: F) -> F:
    return click.option(
        "--tenant",
        default="",
        show_default=True,
        help="The tenant (namespace) of the operation ID.",
    )(fn)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def _fail(code: int, message: str, exc: BaseException | None = None) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    cause = exc.__cause__ if exc is not None else None
    while cause is not None:
        click.echo(f"  caused by: {type(cause).__name__}: {cause}", err=True)
        cause = cause.__cause__
    sys.exit(code)


def run_guarded(fn: Callable[[], None]) -> None:
    try:
        fn()
    except (OperatorActionRefused, OperationNotFound, OperationConflict) as exc:
        _fail(EXIT_REFUSED, str(exc), exc)
    except (ValidationError, ConfigurationError) as exc:
        _fail(EXIT_USAGE, str(exc), exc)
    except StoreError as exc:
        _fail(EXIT_STORE, str(exc), exc)
    except OutboxError as exc:
        _fail(EXIT_REFUSED, str(exc), exc)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--db", envvar="OUTBOX_DATABASE_URL", help="Database URL (or OUTBOX_DATABASE_URL).")
@click.option(
    "--app",
    envvar="OUTBOX_APP",
    help="module:attr naming the application's Outbox (endpoints, credentials).",
)
@click.option("--log-level", default="info", show_default=True, help="debug, info, warning, error")
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    show_default=True,
)
@click.version_option(package_name="outbox")
@click.pass_context
def main(
    ctx: click.Context, db: str | None, app: str | None, log_level: str, log_format: str
) -> None:
    """A durable, client-side operation outbox for HTTP integrations."""
    logs.configure(log_level, log_format)
    # Piped or captured output: never cut IDs to an 80-column guess; operators copy them.
    out.width = None if sys.stdout.isatty() else 4096  # type: ignore[assignment]
    ctx.obj = Context(db, app)
    ctx.call_on_close(ctx.obj.close)


# -- schema ---------------------------------------------------------------------------


@main.command()
@click.pass_obj
def migrate(obj: Context) -> None:
    """Create or upgrade the outbox tables (Alembic migrations bundled with outbox)."""
    from outbox.store.engine import create_engine
    from outbox.store.migrate import HEAD, current_revision, upgrade

    def go() -> None:
        url = obj.db or (obj.outbox().engine.url if obj.app else None)
        if url is None:
            raise click.UsageError("name the database: --db URL or OUTBOX_DATABASE_URL")
        engine = create_engine(url)
        try:
            before = current_revision(engine)
            upgrade(engine)
            click.echo(f"outbox schema at revision {HEAD} (was {before or 'empty'})")
        finally:
            engine.dispose()

    run_guarded(go)


# -- reading ----------------------------------------------------------------------------


@main.command()
@json_option
@click.option("--check", is_flag=True, help="Exit 1 if a threshold below is exceeded.")
@click.option(
    "--max-unresolved",
    type=int,
    default=0,
    show_default=True,
    help="With --check: reconciliation backlog allowed.",
)
@click.option(
    "--max-pending-age",
    default="1h",
    show_default=True,
    help="With --check: age of the oldest pending operation allowed.",
)
@click.option(
    "--max-near-expiry",
    type=int,
    default=0,
    show_default=True,
    help="With --check: live operations allowed within an hour of key expiry.",
)
@click.option(
    "--dispatcher-timeout",
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
@click.pass_obj
def status(
    obj: Context,
    as_json: bool,
    check: bool,
    max_unresolved: int,
    max_pending_age: str,
    max_near_expiry: int,
    dispatcher_timeout: str,
    dispatcher_check: bool,
) -> None:
    """Counts per state, backlog per endpoint, reconciliation backlog, dispatchers."""

    def go() -> None:
        report = Reconciler(obj.outbox()).status(
            max_unresolved=max_unresolved if check else None,
            max_pending_age=parse_duration(max_pending_age) if check else None,
            max_near_expiry=max_near_expiry if check else None,
            dispatcher_timeout=parse_duration(dispatcher_timeout),
            require_dispatcher=check and dispatcher_check,
            max_unsendable=0 if check else None,
        )
        if as_json:
            _emit_json(report.as_dict())
        else:
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

    run_guarded(go)


def _render_watch(watch: Watch) -> None:
    attempts = watch.attempts_dict()
    if attempts["total"]:
        parts = ", ".join(
            f"{o['delivery']}/{o['verdict']} {o['count']}" for o in attempts["by_outcome"]
        )
        out.print(
            f"  by outcome: {parts}; {attempts['not_succeeded_ratio'] * 100:.1f}% "
            "did not succeed",
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
    op = report.operation
    out.print(f"[bold]{op.operation_id}[/bold]  tenant={op.tenant!r}  endpoint={op.endpoint}")
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
        out.print(f"requeue risk: {report.requeue_risk.note}")
    if report.audit:
        out.print("audit:")
        for r in report.audit:
            out.print(
                f"  {r.actor} {r.action} {r.from_state} -> {r.to_state}: {r.note}", markup=False
            )


def _show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    def go() -> None:
        report = Reconciler(obj.outbox()).show(operation_id, tenant=tenant)
        if as_json:
            _emit_json(report.as_dict())
        else:
            _render_report(report)

    run_guarded(go)


@main.command()
@click.argument("operation_id")
@tenant_option
@json_option
@click.pass_obj
def show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    """An operation's arguments, state and every attempt."""
    _show(obj, operation_id, tenant, as_json)


# -- dispatching --------------------------------------------------------------------------


@main.command()
@click.option("--once", is_flag=True, help="Claim and send one batch, then exit.")
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
@click.pass_obj
def dispatch(
    obj: Context,
    once: bool,
    concurrency: int | None,
    metrics_port: int | None,
    metrics_host: str,
    processes: int | None,
    as_json: bool,
) -> None:
    """Run the dispatcher. SIGTERM or Ctrl-C: stop claiming, finish in-flight work, exit 0."""
    if processes is not None:
        if once:
            raise click.UsageError("--once and --processes do not go together")
        if metrics_port is not None:
            raise click.UsageError(
                "--metrics-port and --processes do not go together: each process would "
                "need its own port"
            )
        _supervise(obj, processes, concurrency, as_json)
        return

    def go() -> None:
        from outbox.supervise import catch_sigterm_early

        # Before loading the application: a SIGTERM during start-up stops us cleanly.
        stop = None if once else catch_sigterm_early()
        ob = obj.outbox()
        if not ob.endpoints:
            raise click.UsageError("dispatch needs --app module:attr: endpoints live in code")
        server = None
        if metrics_port is not None:
            metrics = ob.metrics()
            from outbox.metrics import serve

            try:
                server = serve(metrics, host=metrics_host, port=metrics_port)
            except OSError as exc:
                raise ConfigurationError(
                    f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}"
                ) from exc
        try:
            summary = (
                ob.dispatch_once()
                if once
                else ob.run_dispatcher(concurrency=concurrency, stop=stop)
            )
        finally:
            if server is not None:
                server.close()
        if as_json:
            _emit_json(summary.as_dict())
        else:
            out.print(" ".join(f"{k}={v}" for k, v in summary.as_dict().items()))

    run_guarded(go)


def _supervise(obj: Context, processes: int, concurrency: int | None, as_json: bool) -> None:
    from outbox.supervise import Supervisor

    def go() -> None:
        # Fail here, once, on what every child would fail on (no --app, a bad module).
        if not obj.outbox().endpoints:
            raise click.UsageError("dispatch needs --app module:attr: endpoints live in code")
        obj.close()  # the children open their own connections
        command = [sys.executable, "-m", "outbox.cli", *_root_args(), "dispatch", "--json"]
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

    run_guarded(go)


def _root_args() -> list[str]:
    """The top-level options this command was given, for a child ``outbox`` process."""
    root = click.get_current_context().find_root()
    args: list[str] = []
    for param in root.command.params:
        if not isinstance(param, click.Option) or param.name is None:
            continue
        value = root.params.get(param.name)
        if value is None or param.is_flag or param.name == "version":
            continue
        args += [param.opts[0], str(value)]
    return args


# -- operator actions -----------------------------------------------------------------------


@main.group()
def reconcile() -> None:
    """The reconciliation queue: operations whose outcome is not proven."""


@reconcile.command("list")
@click.option("--tenant", default=None)
@click.option("--endpoint", default=None)
@click.option("--reason", type=click.Choice([r.value for r in Reason]), default=None)
@click.option("--older-than", default=None, help="Only unresolved for longer than this (e.g. 2h).")
@click.option("--limit", type=click.IntRange(1, 10_000), default=50, show_default=True)
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True)
@json_option
@click.pass_obj
def reconcile_list(
    obj: Context,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: str | None,
    limit: int,
    offset: int,
    as_json: bool,
) -> None:
    """Unresolved operations, oldest first."""

    def go() -> None:
        ops = Reconciler(obj.outbox()).list(
            tenant=tenant,
            endpoint=endpoint,
            reason=reason,
            older_than=parse_duration(older_than) if older_than else None,
            limit=limit,
            offset=offset,
        )
        if as_json:
            _emit_json([operation_dict(op) for op in ops])
            return
        table = Table(title=f"unresolved operations ({len(ops)} shown)")
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
        if ops:
            out.print("next: outbox reconcile show OP, then resolve or requeue it")

    run_guarded(go)


@reconcile.command("show")
@click.argument("operation_id")
@tenant_option
@json_option
@click.pass_obj
def reconcile_show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    """The evidence: every attempt, its request ID and what was observed."""
    _show(obj, operation_id, tenant, as_json)


@reconcile.command("resolve")
@click.argument("operation_id")
@tenant_option
@click.option("--as", "outcome", type=click.Choice(["succeeded", "failed"]), required=True)
@click.option("--note", required=True, help="What you checked, for the audit trail.")
@click.option("--operator", default=None, help="Your name (default: the OS user).")
@json_option
@click.pass_obj
def reconcile_resolve(
    obj: Context,
    operation_id: str,
    tenant: str,
    outcome: str,
    note: str,
    operator: str | None,
    as_json: bool,
) -> None:
    """Settle an unresolved operation as succeeded or failed."""

    def go() -> None:
        op = Reconciler(obj.outbox()).resolve(
            operation_id, tenant=tenant, outcome=outcome, note=note, operator=operator
        )
        _done(op, as_json, f"resolved {operation_id} as {op.state.value}")

    run_guarded(go)


@reconcile.command("requeue")
@click.argument("operation_id")
@tenant_option
@click.option("--note", required=True, help="What you checked, for the audit trail.")
@click.option("--operator", default=None, help="Your name (default: the OS user).")
@click.option(
    "--accept-duplicate-risk",
    is_flag=True,
    help="Requeue even though the receiver may have forgotten the key.",
)
@json_option
@click.pass_obj
def reconcile_requeue(
    obj: Context,
    operation_id: str,
    tenant: str,
    note: str,
    operator: str | None,
    accept_duplicate_risk: bool,
    as_json: bool,
) -> None:
    """Send again under the same operation ID, with a new retry window."""

    def go() -> None:
        op = Reconciler(obj.outbox()).requeue(
            operation_id,
            tenant=tenant,
            note=note,
            operator=operator,
            accept_duplicate_risk=accept_duplicate_risk,
        )
        _done(op, as_json, f"requeued {operation_id}: pending, same operation ID")

    run_guarded(go)


@main.command()
@click.argument("operation_id")
@tenant_option
@click.option("--note", required=True, help="Why, for the audit trail.")
@click.option("--operator", default=None)
@json_option
@click.pass_obj
def cancel(
    obj: Context, operation_id: str, tenant: str, note: str, operator: str | None, as_json: bool
) -> None:
    """Cancel a pending operation that was never sent."""

    def go() -> None:
        op = Reconciler(obj.outbox()).cancel(
            operation_id, tenant=tenant, note=note, operator=operator
        )
        _done(op, as_json, f"cancelled {operation_id}")

    run_guarded(go)


@main.command()
@click.option("--older-than", required=True, help="e.g. 30d: finished longer ago than this.")
@click.option("--operator", default=None)
@json_option
@click.pass_obj
def purge(obj: Context, older_than: str, operator: str | None, as_json: bool) -> None:
    """Delete old succeeded, failed and cancelled operations; never unresolved ones."""

    def go() -> None:
        cutoff: timedelta = parse_duration(older_than)
        removed = Reconciler(obj.outbox()).purge(older_than=cutoff, operator=operator)
        if as_json:
            _emit_json({"removed": removed, "total": sum(removed.values())})
        else:
            detail = ", ".join(f"{k}={v}" for k, v in sorted(removed.items())) or "nothing"
            out.print(f"purged {sum(removed.values())} operations ({detail})")

    run_guarded(go)


def _done(op: Any, as_json: bool, message: str) -> None:
    if as_json:
        _emit_json(operation_dict(op))
    else:
        out.print(message)


@main.command()
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Keep the demo's files here (default: a temporary directory, removed).",
)
@click.pass_obj
def demo(obj: Context, directory: str | None) -> None:
    """A guided run against a local receiver: lost responses, replays, reconciliation."""
    from outbox.demo import run_demo

    del obj
    run_guarded(lambda: run_demo(directory, out))


@main.command("console")
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
@click.pass_obj
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

    def go() -> None:
        try:
            from outbox.console.auth import Credentials
            from outbox.console.server import check_bind, open_existing, serve
        except ImportError as exc:
            raise click.UsageError(
                f"outbox console needs the console extra: pip install 'outbox[console]' ({exc})"
            ) from exc
        from outbox.reconcile import default_operator

        name = operator or default_operator()
        credentials = Credentials.configured(token_file=token_file, default_name=name)
        check_bind(host, allow_remote=allow_remote, credentials=credentials)
        if obj.app is None:
            if not obj.db:
                raise click.UsageError("name the database: --db URL or OUTBOX_DATABASE_URL")
            obj._outbox = open_existing(obj.db)
        ob = obj.outbox()
        serve(
            ob,
            host=host,
            port=port,
            credentials=credentials or Credentials.generate(name),
            read_only=read_only,
            echo=click.echo,
        )

    run_guarded(go)


# -- receiver conformance check and status lookups ------------------------------------------


@main.command("check-receiver")
@click.option(
    "--app", "app_option", default=None, help="module:attr naming the application's Outbox."
)
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
@click.option(
    "--strict", is_flag=True, help="Exit 1 also when a check could not tell (undecided)."
)
@click.option(
    "--probe-tenants",
    default=None,
    metavar="A,B",
    help="The two tenants of the tenant-scoping probe (default outbox-probe-tenant-a,-b).",
)
@json_option
@click.pass_obj
def check_receiver_command(
    obj: Context,
    app_option: str | None,
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

    def go() -> None:
        try:
            body = json.loads(json_body)
        except ValueError as exc:
            raise click.UsageError(f"--json-body is not JSON: {exc}") from exc
        if app_option:
            obj.app = app_option
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

    run_guarded(go)


@reconcile.command("probe")
@click.argument("operation_id", required=False)
@click.option("--all", "every", is_flag=True, help="Probe every unresolved operation.")
@click.option("--tenant", default=None, help="The operation's tenant (with --all: a filter).")
@click.option("--endpoint", default=None, help="With --all: only this endpoint's operations.")
@json_option
@click.pass_obj
def reconcile_probe(
    obj: Context,
    operation_id: str | None,
    every: bool,
    tenant: str | None,
    endpoint: str | None,
    as_json: bool,
) -> None:
    """Ask the receiver (the endpoint's status_lookup) and settle what it answers.

    Applied: resolved as succeeded. Not applied, within the key retention: requeued under
    the same operation ID. After it: left unresolved, evidence in the audit. Unknown: left
    for you. Every action is audited as actor status-lookup.
    """
    from outbox.lookup import probe, probe_all

    if every == (operation_id is not None):
        raise click.UsageError("name one operation, or pass --all")
    if operation_id is not None and endpoint is not None:
        raise click.UsageError("--endpoint filters --all only")

    def go() -> None:
        ob = obj.outbox()
        if operation_id is not None:
            outcomes = [probe(ob, operation_id, tenant=tenant or "")]
        else:
            outcomes = probe_all(ob, endpoint=endpoint, tenant=tenant)
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

    run_guarded(go)


if __name__ == "__main__":  # pragma: no cover
    main()
