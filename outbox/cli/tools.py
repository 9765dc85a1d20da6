"""``outbox demo``, ``outbox console`` and ``outbox check-receiver``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def _probe_body_options(
    json_body: str | None, form_body: str | None, content: str | None, content_type: str | None
) -> dict[str, Any]:
    """The probe body options as ``check_receiver`` takes them; UsageError (exit 2) for
    none, two, or one that does not parse."""
    given = [n for n, v in (("--json-body", json_body), ("--form-body", form_body),
                            ("--content", content)) if v is not None]  # fmt: skip
    if len(given) != 1:
        raise click.UsageError(
            "give the probe exactly one body: --json-body, --form-body or --content"
            + (f" (got {' and '.join(given)})" if given else "")
        )
    if (content is None) != (content_type is None):
        raise click.UsageError("--content and --content-type go together")
    if json_body is not None:
        try:
            return {"json_body": json.loads(json_body)}
        except ValueError as exc:
            raise click.UsageError(f"--json-body is not JSON: {exc}") from exc
    if form_body is not None:
        return {"data": _form_fields(form_body)}
    assert content is not None
    if content.startswith("@"):
        try:
            raw = Path(content[1:]).read_bytes()
        except OSError as exc:
            raise click.UsageError(f"--content: cannot read {content[1:]}: {exc.strerror}") from exc
    else:
        raw = content.encode("utf-8")
    return {"content": raw, "content_type": content_type}


def _form_fields(text: str) -> Any:
    """A JSON object as a mapping, else ``a=1&b=2`` as pairs in the given order."""
    from urllib.parse import parse_qsl

    if text.lstrip().startswith("{"):
        try:
            fields = json.loads(text)
        except ValueError as exc:
            raise click.UsageError(f"--form-body is not a JSON object: {exc}") from exc
        if not isinstance(fields, dict):
            raise click.UsageError("--form-body must be a JSON object or name=value&...")
        return fields
    try:
        pairs = parse_qsl(text, keep_blank_values=True, strict_parsing=True)
    except ValueError as exc:
        raise click.UsageError(f"--form-body is not name=value&...: {exc}") from exc
    return pairs


@command(main, "check-receiver")
@click.option("--endpoint", required=True, help="The registered endpoint to probe.")
@click.option("--path", required=True, help="The operation's path, e.g. /reservations.")
@click.option("--json-body", default=None, help="The probe operation's JSON body.")
@click.option(
    "--form-body",
    default=None,
    metavar="FIELDS",
    help="Form fields instead (application/x-www-form-urlencoded), for a form-reading "
    "API: 'amount=2000&currency=eur' (order kept) or a JSON object (see --form-style).",
)
@click.option(
    "--form-style",
    type=click.Choice(["flat", "stripe"]),
    default="flat",
    show_default=True,
    help="How a JSON object given to --form-body is encoded (stripe: metadata[order]=17).",
)
@click.option(
    "--content",
    default=None,
    metavar="TEXT|@FILE",
    help="A raw body instead (XML, a signed payload), sent as given; @FILE reads a file. "
    "Needs --content-type.",
)
@click.option("--content-type", default=None, help="The media type of --content.")
@click.option("--method", default="POST", show_default=True)
@click.option("--tenant", default="", help="Tenant sent with the probes (if the endpoint does).")
@click.option(
    "--retention-delay",
    type=float,
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
    json_body: str | None,
    form_body: str | None,
    form_style: str,
    content: str | None,
    content_type: str | None,
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

    The probe body takes the form the endpoint's operations use: --json-body,
    --form-body or --content with --content-type (exactly one). Exit 0 when no check
    failed and at least one was decided (with --strict: none undecided), 1 otherwise,
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

    bodies = _probe_body_options(json_body, form_body, content, content_type)
    if not obj.app:
        raise click.UsageError("check-receiver needs --app module:attr: endpoints live in code")
    report = check_receiver(
        obj.outbox(),
        endpoint=endpoint,
        method=method,
        path=path,
        **bodies,
        form_style=form_style,
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
