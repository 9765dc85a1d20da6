"""The ``outbox`` command: a thin shell over the library.

Each command parses its options, makes one library call and renders the result as a
table (default) or JSON (``--json``). Every failure is one line on stderr and a
documented exit code (see :mod:`outbox.cli.support`); ``--debug`` adds the traceback.
Read commands never create or migrate a database. Heavy modules (the dispatcher, httpx,
aiohttp, Alembic, tenacity) are imported only by the commands that need them.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console

from outbox.base.safetext import neutralise
from outbox.cli.support import (
    DB_ENVVARS,
    Context,
    OutboxGroup,
)

if TYPE_CHECKING:
    pass


class SafeConsole(Console):
    """A rich Console that spells out control characters in every string it renders
    (``print`` arguments and table cells alike; ``outbox.base.safetext``), so a stored note,
    error or body cannot clear or rewrite the operator's screen. Rich's own styling is
    unaffected."""

    def render_str(self, text: str, **kwargs: Any) -> Any:
        return super().render_str(neutralise(text), **kwargs)


# Markup and emoji codes off: a stored string in a table cell ("[link=…]", ":warning:")
# must print as written, never be read as rich markup or turned into an emoji. Our own
# styled lines ask for markup=True.
out = SafeConsole(highlight=False, soft_wrap=True, markup=False, emoji=False)
err = SafeConsole(highlight=False, soft_wrap=True, stderr=True, markup=False, emoji=False)

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
@click.option("--keys", help="module:attr naming the key ring for encrypted rows (or OUTBOX_KEYS).")
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
    keys: str | None,
    log_level: str,
    log_format: str,
    debug: bool,
) -> None:
    """A durable, client-side operation outbox for HTTP integrations.

    --db, --schema, --app, --keys and --debug may come before or after the command.
    """
    # Piped or captured output: never cut IDs to an 80-column guess; operators copy them.
    out.width = None if sys.stdout.isatty() else 4096  # type: ignore[assignment]
    obj = ctx.ensure_object(Context)
    obj.db, obj.schema, obj.app, obj.debug = db, schema, app, debug
    if keys is not None:
        obj.keys, obj.keys_env = keys, False  # over OUTBOX_KEYS, as after the command
    obj.log_level, obj.log_format = log_level, log_format
    from_env = click.core.ParameterSource.ENVIRONMENT
    if db is not None and ctx.get_parameter_source("db") is from_env:
        obj.db_env = next((name for name in DB_ENVVARS if os.environ.get(name)), None)
    obj.schema_env = schema is not None and ctx.get_parameter_source("schema") is from_env
    ctx.call_on_close(obj.close)


# Where each command is defined (imported on use; tests/unit/test_cli_commands.py checks
# this map against what the modules register).
main.lazy_commands = {
    "migrate": "outbox.cli.reading",
    "status": "outbox.cli.reading",
    "show": "outbox.cli.reading",
    "audit": "outbox.cli.reading",
    "reconcile": "outbox.cli.operator",
    "cancel": "outbox.cli.operator",
    "purge": "outbox.cli.operator",
    "endpoint": "outbox.cli.endpoints",
    "keys": "outbox.cli.keys",
    "dispatch": "outbox.cli.dispatching",
    "demo": "outbox.cli.tools",
    "console": "outbox.cli.tools",
    "check-receiver": "outbox.cli.tools",
}


def _filter_words(**filters: Any) -> list[str]:
    """The command-line words that give these filters again."""
    from outbox.base.durations import format_duration

    words: list[str] = []
    for name, value in filters.items():
        if value is None:
            continue
        shown = format_duration(value) if isinstance(value, timedelta) else str(value)
        words += [f"--{name.replace('_', '-')}", shown]
    return words
