"""The console's endpoints page: each receiver endpoint's fleet state (circuit breaker or
an operator's pause, since when, why, probes, next probe; its rate limits and the
throttle) as ``outbox endpoint list`` and ``outbox status`` print it, and the
pause/resume switch the CLI's ``outbox endpoint pause|resume`` is, audited by the same
store call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from outbox.console.app import Console, in_thread
from outbox.console.auth import Session
from outbox.errors import ValidationError
from outbox.reconcile import Reconciler
from outbox.reconcile.status import (
    EndpointFigures,
    EndpointLimits,
    endpoint_state_dict,
    figures,
)

DONE = {
    "paused": "Paused: nothing of it is claimed or spent until it is resumed.",
    "resumed": "Resumed: it is sent to again (an open circuit is probed at once).",
}


@dataclass(frozen=True)
class EndpointRow:
    """One endpoint as the page shows it: its fleet state (``Figures.circuits``), the
    detail of ``endpoint_state_dict`` when the fleet ever saw it fail or pause, its
    live backlog (``Figures.endpoints``) and its limits (``Figures.limits``)."""

    name: str
    state: str
    detail: dict[str, Any] | None
    since_ms: int | None
    next_probe_ms: int | None
    backlog: EndpointFigures
    registered: bool
    limits: EndpointLimits


@dataclass(frozen=True)
class Fleet:
    rows: list[EndpointRow]
    now_ms: int

    @property
    def blocked(self) -> int:
        return sum(1 for r in self.rows if r.state != "closed")


def fleet(console: Console) -> Fleet:
    """Every endpoint the library knows of: registered, with a fleet state row, or with
    live operations; in the words and figures of :func:`outbox.reconcile.status.figures`."""
    outbox = console.outbox
    now = outbox.clock.now_ms()
    fig = figures(outbox, now_ms=now, settled=False)
    states = {s.name: s for s in fig.endpoint_states}
    names = sorted(set(fig.circuits) | set(fig.endpoints))
    rows = []
    for name in names:
        s = states.get(name)
        limits = fig.limits.get(name, EndpointLimits(name))
        rows.append(
            EndpointRow(
                name=name,
                state=fig.circuits.get(name, "closed"),
                detail=endpoint_state_dict(s, limits) if s is not None else None,
                since_ms=s.since if s is not None else None,
                next_probe_ms=s.next_probe_at if s is not None and not s.paused else None,
                backlog=fig.endpoints.get(name, EndpointFigures()),
                registered=name in outbox.endpoints,
                limits=limits,
            )
        )
    return Fleet(rows, now)


class FleetViews:
    def __init__(self, console: Console) -> None:
        self.c = console

    async def endpoints(self, request: Request, session: Session) -> Response:
        seen = await in_thread(lambda: fleet(self.c))
        return self.c.page(
            "endpoints.html",
            session=session,
            title="Endpoints",
            nav="endpoints",
            fleet=seen,
            notice=DONE.get(request.query_params.get("done", "")),
        )

    async def switch(self, request: Request, session: Session, form: FormData) -> Response:
        """POST /endpoints/pause|resume: ``Reconciler.set_endpoint_paused``, as ``outbox
        endpoint pause|resume`` calls it, audited under the session's name in one
        transaction."""
        action = request.path_params["action"]
        name = form.get("name")
        note = form.get("note")
        paused = action == "pause"
        outbox = self.c.outbox
        try:
            if action not in ("pause", "resume"):
                raise ValidationError(f"unknown endpoint action {action!r}")
            if not isinstance(name, str) or not isinstance(note, str):
                raise ValidationError("name the endpoint and say why")
            await in_thread(
                lambda: Reconciler(outbox).set_endpoint_paused(
                    name, paused=paused, note=note, operator=session.actor
                )
            )
        except ValidationError as exc:
            return self.c.message(
                session,
                status=400,
                heading="Not accepted",
                message=f"{exc}. Nothing was changed.",
                link="/endpoints",
                link_text="Back to the endpoints",
            )
        done = "paused" if paused else "resumed"
        return RedirectResponse(f"/endpoints?done={done}#endpoint-{quote(name)}", status_code=303)
