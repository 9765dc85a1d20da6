"""``outbox demo``, ``outbox console`` and ``outbox check-receiver``."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click

from outbox.cli.support import (
    Context,
    command,
)

if TYPE_CHECKING:
    pass
from outbox.cli.root import _emit_json, json_option, main, out


@command(main)
@click.option(
    "--dir",
    "directory",
    default=None,
    help="Keep the demo's files here (default: a temporary directory, removed).",
)
@click.option(
    "--receiver",
    "receiver_kind",
    type=click.Choice(["test", "kit"]),
    default="test",
    show_default=True,
    help="test: the fault-injecting test receiver; kit: a service on outbox.receiver.",
)
def demo(obj: Context, directory: str | None, receiver_kind: str) -> None:
    """A guided run against a local receiver: lost responses, replays, reconciliation."""
    del obj
    if receiver_kind == "kit":
        from outbox.cli.demo_kit import run_kit_demo

        run_kit_demo(directory, out)
        return
    from outbox.cli.demo import run_demo

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
            f"outbox console needs the console extra: pip install 'http-outbox[console]' ({exc})"
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
