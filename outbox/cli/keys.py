"""``outbox keys ...``: rotation and crypto-shredding of encrypted rows.

The key ring comes like the application does: ``--keys module:attr`` (or OUTBOX_KEYS)
naming an :class:`outbox.base.keys.KeyRing`, or the ring of the ``--app`` Outbox.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import click

from outbox.cli.root import _emit_json, err, json_option, main, out
from outbox.cli.support import DURATION, Context, command
from outbox.errors import ValidationError


@main.group()
def keys() -> None:
    """Encryption at rest: re-wrap data keys, destroy old ones."""


def _store(obj: Context) -> Any:
    ob = obj.outbox()
    if ob.keys is None:
        raise click.UsageError(
            "no key ring: name it with --keys module:attr (or OUTBOX_KEYS), or use an --app "
            "whose Outbox has keys="
        )
    return ob.store


def _progress(verb: str) -> Any:
    seen = [0]

    def on_batch(n: int) -> None:
        seen[0] += n
        err.print(f"{verb}: {seen[0]} rows scanned", markup=False)

    return on_batch


def _report(report: Any, *, verb: str, dry_run: bool, as_json: bool, current: str) -> None:
    data = {
        "rows_seen": report.rows_seen,
        "rows_changed": report.rows_changed,
        "values_changed": report.values_changed,
        "by_key": report.by_key or {},
        "current_key": current,
        "dry_run": dry_run,
    }
    if as_json:
        _emit_json(data)
        return
    keys_seen = ", ".join(f"{k}={n}" for k, n in sorted(data["by_key"].items())) or "none"
    done = "would change" if dry_run else verb
    out.print(
        f"{done} {report.values_changed} values in {report.rows_changed} rows "
        f"({report.rows_seen} sealed rows scanned; values by key before: {keys_seen})",
        markup=False,
    )


@command(keys, "rotate")
@click.option("--dry-run", is_flag=True, help="Count what would be re-wrapped; change nothing.")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=500, show_default=True)
@json_option
def rotate(obj: Context, dry_run: bool, batch_size: int, as_json: bool) -> None:
    """Re-wrap every data key under the ring's current key (old rows stay readable)."""
    from outbox.store import rekey

    store = _store(obj)
    report = rekey.rotate(store, dry_run=dry_run, batch_size=batch_size,
                          on_batch=_progress("rotate"))  # fmt: skip
    current = store.sealer.ring.current
    _report(report, verb="re-wrapped", dry_run=dry_run, as_json=as_json, current=current)


@command(keys, "shred")
@click.option(
    "--older-than", type=DURATION, required=True, help="e.g. 90d: finished longer ago than this."
)
@click.option("--dry-run", is_flag=True, help="Count what would be shredded; change nothing.")
@click.option("--batch-size", type=click.IntRange(1, 10_000), default=500, show_default=True)
@json_option
def shred(
    obj: Context, older_than: timedelta, dry_run: bool, batch_size: int, as_json: bool
) -> None:
    """Destroy the data keys of old finished operations; rows and audit trail stay."""
    from outbox.store import rekey

    if older_than <= timedelta(0):
        # As purge: "finished before now" would shred every finished operation at once.
        raise ValidationError("--older-than must be positive")
    store = _store(obj)
    cutoff = obj.outbox().clock.now_ms() - int(older_than.total_seconds() * 1000)
    report = rekey.shred(store, finished_before_ms=cutoff, dry_run=dry_run,
                         batch_size=batch_size, on_batch=_progress("shred"))  # fmt: skip
    current = store.sealer.ring.current
    _report(report, verb="shredded", dry_run=dry_run, as_json=as_json, current=current)
