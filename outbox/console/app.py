"""The console's ASGI application: sign-in, security headers, and the routes.

Pages are rendered on the server and work without JavaScript (none is shipped). Every
state change is a POST carrying the session's CSRF token; reads never change anything.
Every rule about what an action may do lives in the library (:mod:`outbox.reconcile`,
:mod:`outbox.wire.lookup`, :mod:`outbox.reconcile.browse`); this module only translates HTTP
to calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.base.logs import get_logger
from outbox.base.version import __version__
from outbox.console.auth import Credentials, Session, Sessions, SignInLimiter
from outbox.console.bulkplan import BulkPlans
from outbox.console.render import environment
from outbox.errors import StoreError

log = get_logger("outbox.console")

if TYPE_CHECKING:
    from outbox.client import Outbox

SESSION_COOKIE = "outbox_console_session"
CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
    "cross-origin-opener-policy": "same-origin",
}
MAX_FORM_FIELDS = 2000
#: Every form fits: a 2000-character note (a bulk apply names its preview, not each
#: operation, so no form grows with a selection).
MAX_FORM_BYTES = 256 * 1024


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response, static files included."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


Handler = Callable[[Request], Awaitable[Response]]


class Console:
    """State shared by the handlers: the outbox, the credentials, the open sessions."""

    def __init__(
        self,
        outbox: Outbox,
        credentials: Credentials,
        *,
        read_only: bool = False,
        sessions: Sessions | None = None,
        sign_ins: SignInLimiter | None = None,
    ) -> None:
        self.sign_ins = sign_ins or SignInLimiter()
        self.outbox = outbox
        self.credentials = credentials
        self.read_only = read_only
        self.sessions = sessions or Sessions()
        self.bulk_plans = BulkPlans(ttl_seconds=self.sessions.ttl)
        self.env = environment()
        self.env.globals.update(op_url=op_url, op_link=op_link)
        self.database = outbox.engine.url.render_as_string(hide_password=True)

    # -- rendering ------------------------------------------------------------------

    def page(
        self,
        template: str,
        *,
        session: Session | None,
        status: int = 200,
        **context: Any,
    ) -> HTMLResponse:
        html = self.env.get_template(template).render(
            session=session,
            read_only=self.read_only,
            version=__version__,
            database=self.database,
            **context,
        )
        return HTMLResponse(html, status_code=status)

    def message(
        self,
        session: Session | None,
        *,
        status: int,
        heading: str,
        message: str,
        link: str | None = None,
        link_text: str = "",
    ) -> HTMLResponse:
        return self.page(
            "message.html",
            session=session,
            status=status,
            title=heading,
            heading=heading,
            message=message,
            link=link,
            link_text=link_text,
        )

    # -- sign-in --------------------------------------------------------------------

    def session_of(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(SESSION_COOKIE))

    def login_page(self, request: Request, *, status: int, error: str | None = None) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if request.method != "GET" or request.url.path in ("/login", "/logout"):
            target = "/"
        return self.page(
            "login.html",
            session=None,
            status=status,
            title="Sign in",
            next_url=target,
            error=error,
        )

    async def login_form(self, request: Request) -> Response:
        if self.session_of(request) is not None:
            return RedirectResponse("/", status_code=303)
        return self.login_page(request, status=200)

    async def login(self, request: Request) -> Response:
        form = await read_form(request)
        if not same_origin(request):
            return self.message(
                None, status=403, heading="Refused", message="cross-origin sign-in refused"
            )
        address = request.client.host if request.client else "unknown"
        wait = self.sign_ins.locked_for(address)
        if wait > 0:
            log.warning("console_sign_in_refused_locked", client=address)
            response = self.login_page(
                request, status=429, error="Too many failed sign-ins: try again later."
            )
            response.headers["Retry-After"] = str(int(wait) + 1)
            return response
        actor = self.credentials.match(str(form.get("token") or ""))
        if actor is None:
            log.warning("console_sign_in_failed", client=address)
            if self.sign_ins.failed(address):
                log.warning("console_sign_in_locked", client=address,
                            lockout_seconds=self.sign_ins.lockout)  # fmt: skip
            return self.login_page(request, status=401, error="That token is not valid.")
        self.sign_ins.succeeded(address)
        session = self.sessions.create(actor)
        response = RedirectResponse(safe_next(str(form.get("next") or "/")), status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            session.id,
            max_age=int(self.sessions.ttl),
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response

    async def logout(self, request: Request) -> Response:
        session = self.session_of(request)
        if session is None:
            return self.login_page(request, status=401)
        form = await read_form(request)
        if not session.csrf_ok(_str(form.get("csrf"))) or not same_origin(request):
            return self.csrf_refusal(session)
        self.sessions.drop(session.id)
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    def csrf_refusal(self, session: Session) -> Response:
        return self.message(
            session,
            status=403,
            heading="Refused",
            message=(
                "This request did not carry the form's security token (or came from another "
                "site); nothing was changed. Reload the page and try again."
            ),
            link="/",
            link_text="Back to the overview",
        )

    # -- gates ----------------------------------------------------------------------

    def reader(self, fn: Callable[[Request, Session], Awaitable[Response]]) -> Handler:
        """A GET handler that needs a session: 401 and the sign-in form without one."""

        async def handler(request: Request) -> Response:
            session = self.session_of(request)
            if session is None:
                return self.login_page(request, status=401)
            return await self.guarded(session, fn(request, session))

        return handler

    async def guarded(self, session: Session, work: Awaitable[Response]) -> Response:
        """A database failure as a page (503), never a traceback; nothing half-done: every
        write is one transaction in the library."""
        try:
            return await work
        except (StoreError, SQLAlchemyError) as exc:
            detail = exc.orig if isinstance(exc, DBAPIError) else exc
            return self.message(
                session,
                status=503,
                heading="The database failed",
                message=f"{type(exc).__name__}: {detail}. Nothing was changed by this request.",
                link="/",
                link_text="Back to the overview",
            )

    def writer(self, fn: Callable[[Request, Session, FormData], Awaitable[Response]]) -> Handler:
        """A POST handler that changes state: session (401), not read-only (403), the
        session's CSRF token and a same-origin request (403), in that order."""

        async def handler(request: Request) -> Response:
            session = self.session_of(request)
            if session is None:
                return self.login_page(request, status=401)
            if self.read_only:
                return self.message(
                    session,
                    status=403,
                    heading="Read-only console",
                    message="This console was started with --read-only: it changes nothing.",
                    link="/",
                    link_text="Back to the overview",
                )
            form = await read_form(request)
            if not session.csrf_ok(_str(form.get("csrf"))) or not same_origin(request):
                return self.csrf_refusal(session)
            return await self.guarded(session, fn(request, session, form))

        return handler


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def read_form(request: Request) -> FormData:
    """The posted form; 413 for a body larger than any of our forms can be (the parser
    would otherwise read it whole), 411 for one whose length is not announced."""
    length = request.headers.get("content-length")
    if length is None or not length.isdigit():
        raise HTTPException(411, "a form post must announce its length")
    if int(length) > MAX_FORM_BYTES:
        raise HTTPException(413, f"form larger than {MAX_FORM_BYTES} bytes")
    return await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)


def same_origin(request: Request) -> bool:
    """False when the browser says the request came from another origin."""
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    parts = urlsplit(origin)
    return (parts.scheme, parts.netloc) == (request.url.scheme, request.url.netloc)


def safe_next(target: str) -> str:
    """Only a path on this console: never another host (open redirect)."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def op_link(tenant: str, operation_id: str) -> str:
    return "/operation?" + urlencode({"tenant": tenant, "id": operation_id})


def op_url(op: Any) -> str:
    return op_link(op.tenant, op.operation_id)


def query_url(path: str, params: Mapping[str, Any]) -> str:
    clean = {k: v for k, v in params.items() if v not in (None, "")}
    return path + ("?" + urlencode(clean) if clean else "")


async def in_thread(fn: Callable[[], Any]) -> Any:
    """Library calls block (database, status lookups): keep them off the event loop."""
    return await run_in_threadpool(fn)
