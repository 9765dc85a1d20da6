"""Django adapters: a view decorator whose view runs inside ``transaction.atomic()``
with the receipt completed on Django's own connection in that same transaction, and a
status view.

::

    receipts = Receipts(outbox.create_engine(url))   # the same database as Django's

    @csrf_exempt
    @receipted(receipts, identity=current_identity)
    def reserve(request): ...   # write the effect through Django; never commit it

``identity(request)`` is the application's access check: it returns an
:class:`~outbox.receiver.Identity` or raises ``PermissionDenied``. The claim (step 1)
commits on the kit's own engine before the view runs; the view's effect and the receipt
(step 3) commit in one Django transaction. On SQLite give Django
``OPTIONS={"transaction_mode": "IMMEDIATE"}`` so concurrent requests queue instead of
failing to upgrade a read lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse

from outbox.receiver.answers import Reply, busy, stored_headers
from outbox.receiver.kit import Claim, Identity, Receipts, Request, is_busy
from outbox.receiver.store import Scope

View = Callable[..., HttpResponse]

_COMPLETE = (
    "UPDATE outbox_receipts SET state = 'done', status = %s, headers = %s, body = %s, "
    "completed_ms = %s, expires_ms = %s WHERE tenant = %s AND principal = %s AND "
    "method = %s AND route = %s AND key = %s AND token = %s AND state = 'in_progress'"
)


class _Undo(Exception):
    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.status)
        self.reply = reply


def to_django(reply: Reply) -> HttpResponse:
    response = HttpResponse(reply.body, status=reply.status)
    for name, value in reply.headers.items():
        response[name] = value
    return response


def _reply(response: HttpResponse) -> Reply:
    return Reply(response.status_code, dict(response.items()), bytes(response.content))


def _complete(receipts: Receipts, claim: Claim, reply: Reply, using: str) -> bool:
    now = receipts.now_ms()
    s = claim.scope
    params = [
        reply.status,
        json.dumps(stored_headers(reply.headers), sort_keys=True),
        reply.body,
        now,
        now + receipts.retention_seconds * 1000,
        s.tenant, s.principal, s.method, s.route, claim.key, claim.token,
    ]  # fmt: skip
    with connections[using].cursor() as cursor:
        cursor.execute(_COMPLETE, params)
        return bool(cursor.rowcount == 1)


def receipted(
    receipts: Receipts,
    identity: Callable[[HttpRequest], Identity],
    *,
    required: bool = True,
    using: str = "default",
) -> Callable[[View], View]:
    """Decorate a view: at most one effect per key under (tenant, principal, method,
    route); replays, 409, 422 and 400 as the kit answers them."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            who = identity(request)  # the access check, before the receipt lookup
            request_id = request.headers.get(receipts.request_id_header)
            key = request.headers.get(receipts.key_header)
            bad = receipts.check_key(key, required=required)
            if bad is not None:
                return to_django(receipts.declare(bad, request_id))
            if not key:
                with transaction.atomic(using=using):
                    return view(request, *args, **kwargs)
            match = request.resolver_match
            route = "/" + match.route if match is not None and match.route else request.path
            facts = Request(
                method=request.method or "GET",
                route=route,
                body=request.body,
                content_type=request.content_type,
                query=request.META.get("QUERY_STRING", ""),
            )
            got = receipts.claim(Scope(who.tenant, who.principal, facts.method, route), key, facts)
            if isinstance(got, Reply):
                return to_django(receipts.declare(got, request_id))
            return _run(
                receipts, got, view=view, request=request, args=args, kwargs=kwargs,
                using=using, request_id=request_id,
            )  # fmt: skip

        return wrapper

    return decorate


def _run(
    receipts: Receipts,
    claim: Claim,
    *,
    view: View,
    request: HttpRequest,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    using: str,
    request_id: str | None,
) -> HttpResponse:
    try:
        with transaction.atomic(using=using):
            reply = _reply(view(request, *args, **kwargs))
            if reply.status >= 500 and not receipts.store_5xx:
                raise _Undo(reply)
            if not _complete(receipts, claim, reply, using):
                raise _Undo(Reply(409, {"retry-after": "1"}, b""))  # lease lost
    except _Undo as undo:
        receipts.abort(claim)
        return to_django(receipts.declare(undo.reply, request_id))
    except BaseException as exc:
        receipts.abort(claim)
        if is_busy(exc):  # SQLite's lock wait outlasted the busy timeout: nothing was done
            return to_django(receipts.declare(busy(), request_id))
        raise
    return to_django(receipts.declare(reply, request_id))


def status_view(
    receipts: Receipts, identity: Callable[[HttpRequest], Identity]
) -> Callable[..., HttpResponse]:
    """``GET /operations/<path:key>``: the answer the outbox's default lookup reads."""

    def view(request: HttpRequest, key: str) -> HttpResponse:
        who = identity(request)
        return to_django(receipts.status(who.tenant, who.principal, key))

    return view


__all__ = ["receipted", "status_view", "to_django"]
