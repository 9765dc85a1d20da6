"""A FastAPI service with idempotency receipts: ``POST /reservations`` creates a row.

The reservation row and the receipt of its ``Idempotency-Key`` commit in one
transaction (``outbox.receiver``): a lost response, a retry, 64 duplicates at once, a
crash mid-handler or a handler exception all end in one reservation. The caller is
authenticated by a bearer token (its principal); ``X-Tenant`` chooses the tenant, and the
access check refuses a tenant the principal is not a member of, before the receipt
lookup. ``GET /operations/{key}`` answers the outbox's default status lookup.

    python examples/receiver_fastapi.py --port 8000                # SQLite ./receiver.db
    python examples/receiver_fastapi.py --db postgresql+psycopg://postgres@127.0.0.1/test

``RECEIVER_EXAMPLE_FAULTS=1`` lets tests ask for a fault with ``X-Test-Fault``: ``raise``
(the handler fails after writing its row) or ``hang`` (the handler blocks after writing
its row, until the process is killed).
"""

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy import Column, Connection, Integer, MetaData, String, Table, insert

import outbox
from outbox.receiver import Identity, Receipts
from outbox.receiver.asgi import ReceiptsMiddleware, receipt_connection, status_router

PROBE_TENANTS = {"outbox-probe-tenant-a", "outbox-probe-tenant-b"}
#: token -> (principal, tenants it may act for). A real service asks its identity provider.
TOKENS = {
    "orders-app-token": ("orders-app", {"", "acme", "globex", *PROBE_TENANTS}),
    "other-app-token": ("other-app", {"acme"}),
}

app_metadata = MetaData()
reservations = Table(
    "reservations",
    app_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("tenant", String(255), nullable=False),
    Column("sku", String(64), nullable=False),
    Column("quantity", Integer, nullable=False),
)


class Reservation(BaseModel):
    sku: str = Field(min_length=1, max_length=64)
    quantity: int = Field(gt=0, le=1000)


def identity(
    authorization: Annotated[str | None, Header()] = None,
    x_tenant: Annotated[str, Header()] = "",
) -> Identity:
    """The access check: who asks (the token), and may they act for this tenant."""
    token = (authorization or "").removeprefix("Bearer ").strip()
    known = TOKENS.get(token)
    if known is None:
        raise HTTPException(401, "unknown credentials")
    principal, tenants = known
    if x_tenant not in tenants:
        raise HTTPException(403, "not a member of this tenant")
    return Identity(tenant=x_tenant, principal=principal)


def build_app(db_url: str, *, lease_seconds: float = 30.0) -> FastAPI:
    engine = outbox.create_engine(db_url)
    receipts = Receipts(
        engine, retention=timedelta(hours=24), lease=timedelta(seconds=lease_seconds)
    )
    receipts.migrate()
    app_metadata.create_all(engine)
    faults = os.environ.get("RECEIVER_EXAMPLE_FAULTS") == "1"

    app = FastAPI()
    app.state.receipts = receipts
    app.add_middleware(ReceiptsMiddleware, receipts=receipts)
    app.include_router(status_router(receipts, identity))
    receipted = receipt_connection(receipts, identity)

    @app.post("/reservations", status_code=201)
    def reserve(
        body: Reservation,
        conn: Annotated[Connection, Depends(receipted)],
        who: Annotated[Identity, Depends(identity)],
        x_test_fault: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        new_id = conn.execute(
            insert(reservations)
            .values(tenant=who.tenant, sku=body.sku, quantity=body.quantity)
            .returning(reservations.c.id)
        ).scalar_one()
        if faults and x_test_fault == "raise":
            raise RuntimeError("injected handler failure")
        if faults and x_test_fault == "hang":
            time.sleep(3600)
        result = {"reservation_id": new_id, "sku": body.sku, "quantity": body.quantity}
        return JSONResponse(result, status_code=201)

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--db", default=os.environ.get("RECEIVER_DATABASE_URL", "sqlite:///receiver.db")
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--lease-seconds", type=float, default=30.0)
    args = parser.parse_args()
    app = build_app(args.db, lease_seconds=args.lease_seconds)
    print(json.dumps({"listening": f"http://{args.host}:{args.port}"}), flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
