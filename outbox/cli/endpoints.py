"""``outbox endpoint list|pause|resume``: the fleet's view of each receiver endpoint
(circuit breaker, pause, rate limits and the throttle) and an operator's
planned-maintenance switch, audited."""

from __future__ import annotations

import json
from collections.abc import Mapping

import click

from outbox.cli.root import json_option, main, out
from outbox.cli.support import Context, command
from outbox.reconcile.status import endpoint_limits
from outbox.reconcile.status import endpoint_state_dict as _row


@main.group()
def endpoint() -> None:
    """See and pause the receiver endpoints (circuit breaker state, maintenance)."""


@command(endpoint, "list", reads=True)
@json_option
def endpoint_list(obj: Context, as_json: bool) -> None:
    """Each endpoint that ever failed, was paused or limited: circuit, reason, since
    when; its rate (declared and throttled) and max in flight."""
    ob = obj.outbox()
    rows = [
        _row(s, endpoint_limits(s.name, s, ob.endpoints.get(s.name)))
        for s in ob.store.endpoint_states()
    ]
    if as_json:
        click.echo(json.dumps(rows))
        return
    for r in rows:
        state = "paused" if r["paused"] else r["circuit"]
        out.print(f"{r['endpoint']}: {state} since {r['since']} ({r['reason'] or '-'})")
        out.print(f"  {limits_line(r)}", markup=False)


def _per_second(rate: object) -> str:
    return "-" if not isinstance(rate, int | float) else f"{rate:g} req/s"


def limits_line(r: Mapping[str, object]) -> str:
    """An endpoint's limits in words (:class:`~outbox.reconcile.status.EndpointLimits`
    as a dict): what ``outbox endpoint list`` and ``outbox status`` print."""
    rate = f"rate {_per_second(r['rate'])}"
    if r["rate"] is None and r["registered"]:
        rate = "rate unlimited"
    if r["throttled"]:
        throttle = f"throttled (this rate since {r['rate_changed_at']})"
    else:
        throttle = "throttle off" if r["throttle_enabled"] is False else "not throttled"
    refused = f", last refusal {r['refused_at']}" if r["refused_at"] else ""
    if r["registered"]:
        declared = (
            f"declared rate_limit {_per_second(r['rate_limit'])}, "
            f"max_in_flight {r['max_in_flight'] if r['max_in_flight'] is not None else '-'}"
        )
    else:
        declared = "declared limits not known here (not registered: use --app)"
    return f"{rate}, {throttle}{refused}; {declared}"


def _switch(paused: bool, verb: str, doc: str) -> None:
    """``outbox endpoint VERB NAME --note ...``: pause or resume, audited."""

    def switch(obj: Context, name: str, note: str, operator: str | None, as_json: bool) -> None:
        from outbox.reconcile import Reconciler

        state = Reconciler(obj.outbox()).set_endpoint_paused(
            name, paused=paused, note=note, operator=operator
        )
        if as_json:
            click.echo(json.dumps(_row(state)))
        else:
            out.print(f"{'paused' if paused else 'resumed'} {name} (circuit {state.circuit.value})")

    switch.__name__ = f"endpoint_{verb}"
    switch.__doc__ = doc
    options = (
        click.argument("name"),
        click.option("--note", required=True, help="Why, for the audit trail."),
        click.option("--operator", default=None, help="Your name (default: the OS user)."),
        json_option,
    )
    for option in reversed(options):
        switch = option(switch)
    command(endpoint, verb)(switch)


_PAUSE_DOC = "Stop sending to NAME (planned maintenance): nothing is claimed, nothing is spent."
_switch(True, "pause", _PAUSE_DOC)
_switch(False, "resume", "Send to NAME again (an open circuit is probed at once).")
