"""Starlette / FastAPI adapters: a dependency that gives the handler the receipt's
connection, and the ASGI middleware that answers replays, 409, 422 and 400 and commits
the receipt with the effect before a byte of the response leaves.

::

    app = FastAPI()
    app.add_middleware(ReceiptsMiddleware, receipts=receipts)
    receipted = receipt_connection(receipts, identity=current_identity)

    @app.post("/reservations", status_code=201)
    def reserve(body: Reservation, conn: Connection = Depends(receipted)) -> dict:
        ...  # write the effect on conn; never commit it

``current_identity`` is the application's own authentication dependency (it raises 401
or 403 itself, so the access check runs before the receipt lookup) returning an
:class:`Identity`. The middleware must wrap every route that uses the dependency.
"""

# No "from __future__ import annotations": FastAPI must evaluate the dependencies'
# annotations, which name the closure variable ``identity``.

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Annotated, Any

from sqlalchemy import Connection
from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest

import outbox.receiver.answers as answers  # noqa: PLR0402
from outbox.receiver.answers import Reply
from outbox.receiver.kit import Claim, Identity, Receipts, Request, is_busy
from outbox.receiver.store import Scope

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]

_STATE = "outbox_receipt"


class ReceiptAnswer(Exception):
    """Raised by the dependency: the kit answers this request itself."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


def _open(receipts: Receipts) -> Connection:
    conn = receipts.engine.connect()
    conn.begin()
    return conn


def receipt_connection(
    receipts: Receipts,
    identity: Callable[..., Any],
    *,
    required: bool = True,
) -> Callable[..., Awaitable[Connection]]:
    """A FastAPI dependency: claims the request's key under the scope ``identity``
    gives (tenant, principal) plus method and route, and returns the connection whose
    transaction will hold the effect and the receipt."""
    from fastapi import Depends

    async def dependency(
        request: HttpRequest, who: Annotated[Identity, Depends(identity)]
    ) -> Connection:
        key = request.headers.get(receipts.key_header)
        bad = receipts.check_key(key, required=required)
        if bad is not None:
            raise ReceiptAnswer(bad)
        route = getattr(request.scope.get("route"), "path", request.url.path)
        claim: Claim | None = None
        if key:
            facts = Request(
                method=request.method,
                route=route,
                body=await request.body(),
                content_type=request.headers.get("content-type"),
                query=request.url.query,
            )
            scope = Scope(who.tenant, who.principal, request.method, route)
            got = await run_in_threadpool(receipts.claim, scope, key, facts)
            if isinstance(got, Reply):
                raise ReceiptAnswer(got)
            claim = got
        try:
            conn = await run_in_threadpool(_open, receipts)
        except BaseException as exc:
            if claim is not None:
                await run_in_threadpool(receipts.abort, claim, None)
            if isinstance(exc, OperationalError) and is_busy(exc):
                raise ReceiptAnswer(answers.busy()) from exc  # refused before any work
            raise
        request.state.outbox_receipt = (claim, conn)
        return conn

    return dependency


class ReceiptsMiddleware:
    """Holds the response of a receipted request until its receipt committed with the
    effect; answers the kit's own replies; on a handler exception, rolls back and frees
    the key (then lets the exception go on to the server's 500)."""

    def __init__(self, app: ASGIApp, receipts: Receipts) -> None:
        self.app = app
        self.receipts = receipts

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        start: Message | None = None
        chunks: list[bytes] = []
        held = False

        async def capture(message: Message) -> None:
            nonlocal start, held
            if message["type"] == "http.response.start" and _STATE in state:
                start, held = message, True
                return
            if held and message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
                return
            await send(message)

        request_id = _header(scope, self.receipts.request_id_header)
        try:
            await self.app(scope, receive, capture)
        except ReceiptAnswer as answer:
            await _send(send, self.receipts.declare(answer.reply, request_id))
            return
        except BaseException:
            await self._abort(state)
            raise
        if not held or start is None:
            await self._abort(state)
            return
        claim, conn = state.pop(_STATE)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
        reply = Reply(start["status"], headers, b"".join(chunks))
        try:
            final = await run_in_threadpool(self._finish, claim, conn, reply)
        except BaseException:
            await self._abort({_STATE: (claim, conn)})
            raise
        await _send(send, self.receipts.declare(final, request_id), keep=headers)

    def _finish(self, claim: Claim | None, conn: Connection, reply: Reply) -> Reply:
        try:
            if claim is not None:
                return self.receipts.finish(claim, conn, reply)
            if reply.status >= 500:
                conn.rollback()
            else:
                conn.commit()
            return reply
        finally:
            conn.close()

    async def _abort(self, state: MutableMapping[str, Any]) -> None:
        held = state.pop(_STATE, None)
        if held is None:
            return
        claim, conn = held

        def abort() -> None:
            try:
                if claim is not None:
                    self.receipts.abort(claim, conn)
                elif conn.in_transaction():
                    conn.rollback()
            finally:
                conn.close()

        await run_in_threadpool(abort)


def _header(scope: MutableMapping[str, Any], name: str) -> str | None:
    wanted = name.lower().encode("latin-1")
    for key, value in scope.get("headers", ()):
        if key.lower() == wanted:
            return str(value.decode("latin-1"))
    return None


async def _send(send: Send, reply: Reply, keep: dict[str, str] | None = None) -> None:
    headers = dict(keep or {})
    lowered = {k.lower() for k in reply.headers}
    headers = {k: v for k, v in headers.items() if k.lower() not in lowered}
    headers.update(reply.headers)
    headers["content-length"] = str(len(reply.body))
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": reply.status, "headers": raw})
    await send({"type": "http.response.body", "body": reply.body})


def status_router(
    receipts: Receipts, identity: Callable[..., Any], *, path: str = "/operations/{key:path}"
) -> Any:
    """A FastAPI router answering ``GET /operations/{key}`` under the caller's own scope:
    what :class:`outbox.StatusLookup`'s defaults read, so an ``Endpoint`` with
    ``status_lookup=StatusLookup()`` settles unresolved operations from it."""
    from fastapi import APIRouter, Depends
    from fastapi.responses import Response

    router = APIRouter()

    @router.get(path, include_in_schema=False)
    async def operation_status(key: str, who: Annotated[Identity, Depends(identity)]) -> Response:
        reply = await run_in_threadpool(receipts.status, who.tenant, who.principal, key)
        return Response(reply.body, status_code=reply.status, headers=reply.headers)

    return router


__all__ = ["ReceiptAnswer", "ReceiptsMiddleware", "receipt_connection", "status_router"]
