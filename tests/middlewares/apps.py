"""Receivers built on real idempotency middlewares from the package index.

Each factory returns an ASGI application served by uvicorn in its own process
(``support.serve``). The business handler records one effect row per applied request in
the SQLite file named by ``OUTBOX_MW_EFFECTS``: that file is the oracle, never the
responses. ``POST /reservations`` applies; ``POST /explode`` raises after applying, the
way a handler bug does.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any

SCHEMA = "CREATE TABLE IF NOT EXISTS effects (id INTEGER PRIMARY KEY, key TEXT, body TEXT)"


def apply_effect(key: str | None, body: bytes) -> dict[str, Any]:
    """Write one effect row; return the business result."""
    conn = sqlite3.connect(os.environ["OUTBOX_MW_EFFECTS"], timeout=10)
    try:
        with conn:
            conn.execute(SCHEMA)
            cur = conn.execute(
                "INSERT INTO effects (key, body) VALUES (?, ?)", (key, body.decode())
            )
        return {"effect_id": cur.lastrowid, "received": json.loads(body or b"null")}
    finally:
        conn.close()


def _starlette_routes() -> Any:
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def reservations(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse(apply_effect(request.headers.get("idempotency-key"), body), 201)

    async def explode(request: Request) -> JSONResponse:
        apply_effect(request.headers.get("idempotency-key"), await request.body())
        raise RuntimeError("handler bug after the effect")

    return [
        Route("/reservations", reservations, methods=["POST"]),
        Route("/explode", explode, methods=["POST"]),
    ]


def asgi_idempotency_header() -> Any:
    from idempotency_header_middleware import IdempotencyHeaderMiddleware
    from idempotency_header_middleware.backends import MemoryBackend
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    return Starlette(
        routes=_starlette_routes(),
        middleware=[Middleware(IdempotencyHeaderMiddleware, backend=MemoryBackend())],
    )


def fastapi_idempotency_key() -> Any:
    from fastapi_idempotency_key import IdempotencyMiddleware
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    return Starlette(routes=_starlette_routes(), middleware=[Middleware(IdempotencyMiddleware)])


def fastapi_idempotency() -> Any:
    from fastapi_idempotency import IdempotencyMiddleware
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    return Starlette(routes=_starlette_routes(), middleware=[Middleware(IdempotencyMiddleware)])


def django_idempotency_key() -> Any:
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="test-only-not-secret",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF="tests.middlewares.django_urls",
        MIDDLEWARE=["idempotency_key.middleware.IdempotencyKeyMiddleware"],
        INSTALLED_APPS=[],
        DATABASES={},
        USE_TZ=True,
    )
    from django.core.asgi import get_asgi_application

    return get_asgi_application()


FACTORIES = {
    "asgi-idempotency-header": "asgi_idempotency_header",
    "fastapi-idempotency-key": "fastapi_idempotency_key",
    "fastapi-idempotency": "fastapi_idempotency",
    "django-idempotency-key": "django_idempotency_key",
}
