"""The operator's actions: ``outbox reconcile ...``, ``cancel`` and ``purge``."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from outbox.cli.support import (
    DURATION,
    EXIT_REFUSED,
    EXIT_USAGE,
    Context,
    Page,
    command,
    fail,
    page_options,
)
from outbox.model import Reason

if TYPE_CHECKING:
    from outbox.reconcile.bulk import BulkGroup, BulkReport, Selection
from outbox.cli.reading import _show
from outbox.cli.root import _emit_json, _filter_words, _reconciler, err, json_option, main, out

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
@page_options(10_000)
@json_option
def reconcile_list(
    obj: Context,
    tenant: str | None,
    endpoint: str | None,
    reason: str | None,
    older_than: timedelta | None,
    newer_than: timedelta | None,
    page: Page,
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
    ops = rec.unresolved(**filters, limit=page.limit, offset=page.offset)
    total = rec.count(**filters)
    if as_json:
        _emit_json(page.as_json(total, "operations", [operation_dict(op) for op in ops]))
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
    more = page.next_words(len(ops), total)
    if more is not None:
        hint = obj.command_hint("reconcile", "list", *_filter_words(**filters), *more)
        out.print(f"more: {hint}", markup=False)
    if ops:
        first = ops[0]
        tenant_words = ["--tenant", first.tenant] if first.tenant else []
        show_first = obj.command_hint("reconcile", "show", first.operation_id, *tenant_words)
        out.print(f"next: {show_first}, then resolve or requeue it", markup=False)


@command(reconcile, "show", reads=True)
@click.argument("operation_id")
@click.option("--tenant", default="", help="The tenant (namespace) of the operation ID.")
@json_option
def reconcile_show(obj: Context, operation_id: str, tenant: str, as_json: bool) -> None:
    """The evidence: every attempt, its request ID and what was observed."""
    _show(obj, operation_id, tenant, as_json)


@dataclass(frozen=True, slots=True)
class Target:
    """What a command with :func:`bulk_options` acts on: one operation, or (``selection``
    set) every match of the filters."""

    operation_id: str | None
    tenant: str | None
    selection: Selection | None
    dry_run: bool
    yes: bool
    #: List every operation, not only the groups (--verbose).
    verbose: bool = False


VERBOSE_OPTION = click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="With --all: list every operation (default: grouped by outcome and reason, with "
    "counts and the first few IDs).",
)


def target_options(
    *, every_help: str, tenant_help: str, confirm: bool = True
) -> Callable[[Any], Any]:
    """One operation ID, or --all with filters (and, with ``confirm``, --dry-run and
    --yes). The command gets them as one ``target`` (:class:`Target`), checked:
    bulk-only flags are refused with one operation."""

    def decorate(fn: Any) -> Any:
        @functools.wraps(fn)
        def gathered(
            *args: Any,
            operation_id: str | None,
            every: bool,
            tenant: str | None,
            endpoint: str | None,
            reason: str | None,
            older_than: timedelta | None,
            newer_than: timedelta | None,
            dry_run: bool = False,
            yes: bool = False,
            verbose: bool = False,
            **kwargs: Any,
        ) -> Any:
            filters = {
                "endpoint": endpoint,
                "reason": reason,
                "older_than": older_than,
                "newer_than": newer_than,
            }
            flags = {"dry_run": dry_run, "yes": yes, "verbose": verbose}
            selection = _selection(operation_id, every, tenant, filters, flags)
            target = Target(operation_id, tenant, selection, dry_run, yes, verbose)
            return fn(*args, target=target, **kwargs)

        options: list[Any] = [
            click.argument("operation_id", required=False),
            click.option("--all", "every", is_flag=True, help=every_help),
            click.option("--tenant", default=None, help=tenant_help),
            filter_options,
        ]
        if confirm:
            options += [
                click.option(
                    "--dry-run",
                    is_flag=True,
                    help="With --all: say what would change; change nothing.",
                ),
                click.option(
                    "--yes", is_flag=True, help="With --all: do not ask for confirmation."
                ),
                VERBOSE_OPTION,
            ]
        for option in reversed(options):
            gathered = option(gathered)
        return gathered

    return decorate


bulk_options = target_options(
    every_help="Act on every match of the filters.",
    tenant_help="The operation's tenant (default ''); with --all, a filter.",
)


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
    from outbox.reconcile.bulk import Selection

    return Selection(tenant=tenant, **filters)


def _run_bulk(obj: Context, action: str, target: Target, *, as_json: bool, **kwargs: Any) -> None:
    """Dry run (always first), confirmation on a terminal, then the run with a progress
    bar, and the summary. Exit 1 if anything was refused or changed by someone else."""
    from outbox.reconcile.bulk import bulk, select

    selection, dry_run, yes = target.selection, target.dry_run, target.yes
    assert selection is not None
    rec = _reconciler(obj)
    ops = select(rec, action, selection)
    plan = bulk(rec, action, selection, dry_run=True, selected=ops, **kwargs)
    if dry_run:
        _bulk_summary(plan, as_json, verbose=target.verbose)
        return
    would = plan.counts["changed"]
    if would and not yes:
        if not sys.stdin.isatty():
            fail(
                EXIT_USAGE,
                f"{action} --all would change {would} operations; without a terminal to "
                "confirm on, pass --yes (or look first with --dry-run)",
            )
        _bulk_summary(plan, False, to=err, verbose=target.verbose)
        click.confirm(f"{action} {would} operations?", abort=True, err=True)
    with _progress_bar(f"{action}", len(ops)) as advance:
        report = bulk(rec, action, selection, selected=ops, on_progress=advance, **kwargs)
    _bulk_summary(report, as_json, verbose=target.verbose)
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


def _bulk_summary(
    report: BulkReport, as_json: bool, *, to: Console | None = None, verbose: bool = False
) -> None:
    """One head line, then one line per group (outcome and reason: its count and first
    IDs); ``verbose``: one line per operation as well. ``--json`` carries both."""
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
    for group in report.groups():
        console.print(f"  {_group_line(group, report.dry_run)}", markup=False)
    if not verbose:
        if any(g.count > len(g.first_ids) for g in report.groups()):
            console.print("  (--verbose or --json lists every operation)", markup=False)
        return
    for item in report.items:
        tenant = f" (tenant {item.tenant!r})" if item.tenant else ""
        if item.outcome.value == "changed":
            line = f"{'would change' if report.dry_run else 'changed'} -> {item.detail}"
        else:
            line = f"{item.outcome.value.replace('_', ' ')}: {item.detail}"
        console.print(f"  {item.operation_id}{tenant}: {line}", markup=False)


def _group_line(group: BulkGroup, dry_run: bool) -> str:
    """``refused 300: key retention passed: needs --accept-duplicate-risk (pay-0001,
    pay-0002, pay-0003, and 297 more)``"""
    ids = ", ".join(group.first_ids)
    more = group.count - len(group.first_ids)
    ids += f", and {more} more" if more else ""
    if group.outcome.value == "changed":
        label = f"{'would change' if dry_run else 'changed'} {group.count} -> {group.why}"
    else:
        label = f"{group.outcome.value.replace('_', ' ')} {group.count}: {group.why}"
    return f"{label} ({ids})"


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
    obj: Context, target: Target, outcome: str, note: str, operator: str | None, as_json: bool
) -> None:
    """Settle an unresolved operation (or, with --all, every match) as succeeded or failed."""
    if target.selection is not None:
        _run_bulk(obj, "resolve", target, as_json=as_json,
                  outcome=outcome, note=note, operator=operator)  # fmt: skip
        return
    assert target.operation_id is not None
    op = _reconciler(obj).resolve(
        target.operation_id, tenant=target.tenant or "", outcome=outcome, note=note,
        operator=operator,
    )  # fmt: skip
    _one_done(op, as_json, f"resolved {target.operation_id} as {op.state.value}")


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
    target: Target,
    note: str,
    operator: str | None,
    accept_duplicate_risk: bool,
    as_json: bool,
) -> None:
    """Send again under the same operation ID, with a new retry window.

    Decided from the database alone (the policy stored with each operation): no --app
    needed; the dispatcher that sends it needs the application.
    """
    if target.selection is not None:
        _run_bulk(obj, "requeue", target, as_json=as_json, note=note, operator=operator,
                  accept_duplicate_risk=accept_duplicate_risk)  # fmt: skip
        return
    assert target.operation_id is not None
    op = _reconciler(obj).requeue(
        target.operation_id,
        tenant=target.tenant or "",
        note=note,
        operator=operator,
        accept_duplicate_risk=accept_duplicate_risk,
    )
    _one_done(op, as_json, f"requeued {target.operation_id}: pending, same operation ID")


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
@VERBOSE_OPTION
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
    verbose: bool,
    note: str,
    operator: str | None,
    as_json: bool,
) -> None:
    """Cancel a pending operation that was never sent (or, with --all, every match)."""
    filters = {"endpoint": endpoint, "older_than": older_than, "newer_than": newer_than}
    flags = {"dry_run": dry_run, "yes": yes, "verbose": verbose}
    selection = _selection(operation_id, every, tenant, filters, flags)
    if selection is not None:
        target = Target(operation_id, tenant, selection, dry_run, yes, verbose)
        _run_bulk(obj, "cancel", target, as_json=as_json,
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


@command(reconcile, "probe")
@target_options(
    every_help="Probe every unresolved match of the filters.",
    tenant_help="The operation's tenant (with --all: a filter).",
    confirm=False,
)
@json_option
def reconcile_probe(obj: Context, target: Target, as_json: bool) -> None:
    """Ask the receiver (the endpoint's status_lookup) and settle what it answers.

    Applied: resolved as succeeded. Not applied, within the key retention: requeued under
    the same operation ID. After it: left unresolved, evidence in the audit. Unknown: left
    for you. Every action is audited as actor status-lookup.
    """
    rec = _reconciler(obj)
    sel = target.selection
    if sel is None:
        assert target.operation_id is not None
        outcomes = [rec.probe(target.operation_id, tenant=target.tenant or "")]
    else:
        outcomes = rec.probe_all(
            tenant=sel.tenant, endpoint=sel.endpoint, reason=sel.reason,
            older_than=sel.older_than, newer_than=sel.newer_than,
        )  # fmt: skip
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
