"""``outbox dispatch``, in one process or several."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

from outbox.cli.process import settle_gc_for_dispatch
from outbox.cli.support import EXIT_USAGE, Context, command, fail
from outbox.errors import ConfigurationError, StoreError

if TYPE_CHECKING:
    from outbox.client import Outbox
from outbox.cli.root import _emit_json, err, json_option, main, out

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
@click.option(
    "--listen-url",
    envvar="OUTBOX_LISTEN_URL",
    default=None,
    help="PostgreSQL: a direct connection used only for LISTEN wake-ups, when --db goes "
    "through pgbouncer in transaction pooling (or OUTBOX_LISTEN_URL).",
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
    listen_url: str | None,
    as_json: bool,
) -> None:
    """Run the dispatcher. SIGTERM or Ctrl-C: stop claiming, finish in-flight work, exit 0."""
    if once and until_empty:
        raise click.UsageError("--once and --until-empty exclude each other")
    if not obj.app:
        raise click.UsageError("dispatch needs --app module:attr: endpoints live in code")
    if metrics_port is not None:
        try:
            import prometheus_client  # noqa: F401  (the metrics extra)
        except ImportError:
            fail(
                EXIT_USAGE,
                "--metrics-port needs prometheus_client, which is not installed: "
                "pip install 'http-outbox[metrics]'",
            )
    if processes is not None:
        if once or until_empty:
            flag = "--once" if once else "--until-empty"
            raise click.UsageError(f"{flag} and --processes do not go together")
        if metrics_port is not None:
            raise click.UsageError(
                "--metrics-port and --processes do not go together: each process would "
                "need its own port"
            )
        _supervise(obj, processes, concurrency, as_json, listen_url)
        return
    from outbox.dispatch.supervise import catch_sigterm_early

    # Before loading the application: a SIGTERM during start-up stops us cleanly.
    stop = None if once or until_empty else catch_sigterm_early()
    ob = _open_waiting_for_database(obj, stop)
    if listen_url is not None:
        import dataclasses

        ob.dispatcher_settings = dataclasses.replace(ob.dispatcher_settings, listen_url=listen_url)
    if not ob.endpoints:
        raise click.UsageError(f"--app {obj.app} registers no endpoint: nothing can be sent")
    server = None
    if metrics_port is not None:
        from outbox.observe.metrics import serve

        try:
            server = serve(ob.metrics(), host=metrics_host, port=metrics_port)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {metrics_host}:{metrics_port}: {exc}"
            ) from exc
    settle_gc_for_dispatch()
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


def _supervise(
    obj: Context, processes: int, concurrency: int | None, as_json: bool, listen_url: str | None
) -> None:
    from outbox.dispatch.supervise import Supervisor

    # Fail here, once, on what every child would fail on (a bad module, no endpoint).
    if not obj.outbox().endpoints:
        raise click.UsageError(f"--app {obj.app} registers no endpoint: nothing can be sent")
    obj.close()  # the children open their own connections
    command = [sys.executable, "-m", "outbox.cli", *_child_args(obj), "dispatch", "--json"]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    if listen_url is not None:
        command += ["--listen-url", listen_url]
    supervisor = Supervisor(command, processes)
    report = supervisor.run()
    if as_json:
        _emit_json(report.as_dict())
    else:
        out.print(" ".join(f"{k}={v}" for k, v in report.as_dict().items()), markup=False)
    if supervisor.exit_status:
        sys.exit(supervisor.exit_status)


def _child_args(obj: Context) -> list[str]:
    """The options this command was given (before or after it), for a child process.
    A URL from the environment stays there: the child inherits it, a password stays off
    every process's command line, and beside ``--app`` it is not the operator's word."""
    args = ["--log-level", obj.log_level, "--log-format", obj.log_format]
    db = obj.db if obj.db_env is None else None
    schema = obj.schema if not obj.schema_env else None
    keys = obj.keys if not obj.keys_env else None
    for option, value in (("--db", db), ("--schema", schema), ("--app", obj.app), ("--keys", keys)):
        if value is not None:
            args += [option, value]
    return [*args, "--debug"] if obj.debug else args


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

    from outbox.dispatch.dispatcher import logger

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
