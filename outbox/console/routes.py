"""The console's routes: the :class:`~outbox.console.app.Console` and its views, as one
ASGI app."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from outbox.console.app import Console, SecurityHeaders
from outbox.console.auth import Credentials, Sessions
from outbox.console.bulkviews import BulkViews
from outbox.console.fleet import FleetViews
from outbox.console.render import HERE
from outbox.console.views import Views

if TYPE_CHECKING:
    from outbox.client import Outbox


def create_app(
    outbox: Outbox,
    credentials: Credentials,
    *,
    read_only: bool = False,
    allowed_hosts: list[str] | None = None,
    sessions: Sessions | None = None,
) -> Starlette:
    """The console as an ASGI app. ``allowed_hosts``: Host header values accepted (a
    defence against DNS rebinding on a loopback bind); None accepts any."""
    console = Console(outbox, credentials, read_only=read_only, sessions=sessions)
    v = Views(console)
    fleet = FleetViews(console)
    routes = [
        Route("/login", console.login_form, methods=["GET"]),
        Route("/login", console.login, methods=["POST"]),
        Route("/logout", console.logout, methods=["POST"]),
        Route("/", console.reader(v.overview), methods=["GET"]),
        Route("/queue", console.reader(v.queue), methods=["GET"]),
        Route("/operations", console.reader(v.operations), methods=["GET"]),
        Route("/operation", console.reader(v.operation), methods=["GET"]),
        Route("/audit", console.reader(v.audit), methods=["GET"]),
        Route("/endpoints", console.reader(fleet.endpoints), methods=["GET"]),
        Route("/endpoints/{action}", console.writer(fleet.switch), methods=["POST"]),
        Route("/operation/{action}", console.writer(v.act), methods=["POST"]),
        Route("/bulk", console.writer(BulkViews(v).bulk), methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    middleware = [Middleware(SecurityHeaders)]
    if allowed_hosts is not None:
        middleware.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts))
    app = Starlette(routes=routes, middleware=middleware)
    app.state.console = console
    return app
