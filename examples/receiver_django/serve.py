"""A Django service with idempotency receipts: ``POST /reservations`` creates a row.

The same service as ``examples/receiver_fastapi.py``, on Django: the view runs inside
``transaction.atomic()`` (``outbox.receiver.djangokit.receipted``) and writes the
reservation through Django's own connection; the receipt is completed on that
connection in the same transaction. Bearer token = principal, ``X-Tenant`` checked
against the principal's tenants before the receipt lookup; ``GET /operations/<key>``
answers the outbox's default status lookup. Served by a threaded WSGI server:

    python examples/receiver_django/serve.py --port 8001             # SQLite ./receiver-django.db
    python examples/receiver_django/serve.py --db postgresql+psycopg://postgres@127.0.0.1/test

``RECEIVER_EXAMPLE_FAULTS=1`` enables ``X-Test-Fault: raise`` / ``hang`` for tests.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import django
from django.conf import settings
from sqlalchemy.engine import make_url

PROBE_TENANTS = {"outbox-probe-tenant-a", "outbox-probe-tenant-b"}
TOKENS = {
    "orders-app-token": ("orders-app", {"", "acme", "globex", *PROBE_TENANTS}),
    "other-app-token": ("other-app", {"acme"}),
}


def django_database(url: str) -> dict[str, Any]:
    """Django's DATABASES entry for the SQLAlchemy URL the receipts use too."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": parsed.database,
            # Writers take the lock up front (like BEGIN IMMEDIATE) and wait for it.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5},
        }
    options = {"options": parsed.query["options"]} if "options" in parsed.query else {}
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": parsed.database,
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.host or "",
        "PORT": str(parsed.port or ""),
        "OPTIONS": options,
    }


def configure(db_url: str, lease_seconds: float) -> Any:
    settings.configure(
        DEBUG=False,
        ALLOWED_HOSTS=["127.0.0.1", "localhost"],
        ROOT_URLCONF=__name__,
        DATABASES={"default": django_database(db_url)},
        INSTALLED_APPS=[],
        MIDDLEWARE=[],
        SECRET_KEY="example-only",  # noqa: S106 (no sessions or signing here)
        USE_TZ=True,
    )
    django.setup()
    from sqlalchemy import Column, Integer, MetaData, String, Table

    import outbox
    from outbox.receiver import Receipts

    app_metadata = MetaData()
    Table(
        "reservations",
        app_metadata,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("tenant", String(255), nullable=False),
        Column("sku", String(64), nullable=False),
        Column("quantity", Integer, nullable=False),
    )

    engine = outbox.create_engine(db_url)
    receipts = Receipts(
        engine, retention=timedelta(hours=24), lease=timedelta(seconds=lease_seconds)
    )
    receipts.migrate()
    app_metadata.create_all(engine)  # the reservations table
    return receipts


urlpatterns: list[Any] = []


def build_urls(receipts: Any) -> None:
    from django.core.exceptions import PermissionDenied
    from django.db import connection
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.urls import path
    from django.views.decorators.csrf import csrf_exempt

    from outbox.receiver import Identity
    from outbox.receiver.djangokit import receipted, status_view

    faults = os.environ.get("RECEIVER_EXAMPLE_FAULTS") == "1"

    def identity(request: HttpRequest) -> Identity:
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        known = TOKENS.get(token)
        tenant = request.headers.get("X-Tenant", "")
        if known is None or tenant not in known[1]:
            raise PermissionDenied("not allowed for this tenant")
        return Identity(tenant=tenant, principal=known[0])

    @csrf_exempt
    @receipted(receipts, identity)
    def reserve(request: HttpRequest) -> HttpResponse:
        if request.method != "POST":
            return HttpResponse(status=405)
        try:
            body = json.loads(request.body)
            sku, quantity = body["sku"], body["quantity"]
            if not isinstance(sku, str) or not 0 < len(sku) <= 64:
                raise ValueError
            if type(quantity) is not int or not 0 < quantity <= 1000:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            return JsonResponse({"error": "invalid reservation"}, status=400)
        tenant = identity(request).tenant
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO reservations (tenant, sku, quantity) VALUES (%s, %s, %s) RETURNING id",
                [tenant, sku, quantity],
            )
            new_id = cursor.fetchone()[0]
        fault = request.headers.get("X-Test-Fault")
        if faults and fault == "raise":
            raise RuntimeError("injected handler failure")
        if faults and fault == "hang":
            time.sleep(3600)
        return JsonResponse(
            {"reservation_id": new_id, "sku": sku, "quantity": quantity}, status=201
        )

    urlpatterns[:] = [
        path("reservations", reserve),
        path("operations/<path:key>", status_view(receipts, identity)),
    ]


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 256


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--db", default=os.environ.get("RECEIVER_DATABASE_URL", "sqlite:///receiver-django.db")
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    args = parser.parse_args()
    receipts = configure(args.db, args.lease_seconds)
    build_urls(receipts)
    from django.core.wsgi import get_wsgi_application

    server = make_server(args.host, args.port, get_wsgi_application(), _Server, _Quiet)
    print(json.dumps({"listening": f"http://{args.host}:{args.port}"}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
