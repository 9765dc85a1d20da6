"""Operations in every state, built for real, for the operator tests (library and CLI).

Nothing here writes an operation row by hand: every state is reached through a real
receiver on 127.0.0.1 and real dispatches (``dispatch_once``), or an operator action.
Time is a :class:`FakeClock`, started at the real wall time so that a CLI reading the
database with the system clock sees sensible ages; ``clock.advance`` crosses backoff and
windows without sleeping.

The same endpoints serve ``--app tests.integration._reconcile_states:cli_app`` (the
command line's view of the application), configured through :data:`APP_ENV`.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, func, select, text
from sqlalchemy import create_engine as sa_create_engine
from sqlalchemy.engine import make_url

from outbox import Endpoint, FakeClock, Outbox, RetryPolicy
from outbox.dispatch import failpoints
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.tables import attempts, audit, operations
from outbox.testing.receiver import Receiver

APP_ENV = "OUTBOX_RECONCILE_TEST_APP"
APP = "tests.integration._reconcile_states:cli_app"

#: How long the receiver keeps keys, for every endpoint here.
RETENTION = timedelta(hours=2)
WINDOW = timedelta(minutes=5)
#: Past the backoff of one attempt (full jitter, capped at 0.5 * 2**n seconds) and
#: still well inside the window.
PAST_BACKOFF_SECONDS = 120.0


@dataclass(frozen=True)
class Ref:
    tenant: str
    operation_id: str
    endpoint: str
    state: str
    reason: str | None = None


# Every state, and every unresolved reason the dispatcher reaches on its own.
OK = Ref("acme", "op-ok", "inventory", "succeeded")
BAD = Ref("acme", "op-bad", "inventory", "failed")
BUSY = Ref("acme", "op-busy", "inventory", "unresolved", "retries_exhausted")
LOST = Ref("globex", "op-lost", "fragile", "unresolved", "outcome_unknown")
DARK = Ref("", "op-dark", "offline", "unresolved", "never_delivered")
STUCK = Ref("", "op-stuck", "inventory", "in_flight")
WAIT = Ref("acme", "op-wait", "inventory", "pending")
CANCELLED = Ref("globex", "op-cancel", "inventory", "cancelled")

EVERY = (OK, BAD, BUSY, LOST, DARK, STUCK, WAIT, CANCELLED)
UNRESOLVED = (BUSY, LOST, DARK)


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens: connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def endpoints(receiver_url: str, offline_url: str) -> list[Endpoint]:
    def ep(name: str, url: str, max_attempts: int) -> Endpoint:
        return Endpoint(
            name=name,
            base_url=url,
            timeout=3.0,  # never waited for: no fault here hangs
            retry=RetryPolicy(max_attempts=max_attempts, window=WINDOW),
            key_retention=RETENTION,
            tenant_header="X-Tenant",
            # "op-busy" (503 forever) ends retries_exhausted by the policy alone; under
            # the fleet's throttle it would wait for deliver_within.
            throttle=None,
        )

    return [
        ep("inventory", receiver_url, 2),
        # One attempt: a lost response goes straight to reconciliation.
        ep("fragile", receiver_url, 1),
        ep("offline", offline_url, 2),
    ]


def make_outbox(db_url: str, receiver_url: str, offline_url: str, clock: FakeClock) -> Outbox:
    return Outbox(db_url, endpoints=endpoints(receiver_url, offline_url), clock=clock)


def real_now_clock() -> FakeClock:
    return FakeClock(start_ms=time.time_ns() // 1_000_000)


def enqueue(ob: Outbox, ref: Ref, **kw: Any) -> None:
    ob.enqueue(
        endpoint=ref.endpoint,
        method="POST",
        path="/reservations",
        json={"op": ref.operation_id, "quantity": 2},
        operation_id=ref.operation_id,
        tenant=ref.tenant,
        **kw,
    )


def crash_one_attempt(ob: Outbox) -> None:
    """Dispatch once with a failpoint that kills the attempt after its row commits.

    The operation stays ``in_flight`` with an open attempt under a live lease, exactly
    as a dispatcher that died mid-attempt leaves it.
    """
    names = (failpoints.ENV, failpoints.ENABLE_ENV)
    previous = {name: os.environ.get(name) for name in names}
    os.environ[failpoints.ENV] = "after_attempt_commit=raise"
    os.environ[failpoints.ENABLE_ENV] = failpoints.ENABLE_VALUE
    failpoints.reload()
    try:
        ob.dispatch_once()
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        failpoints.reload()


def build_every_state(
    ob: Outbox, receiver: Receiver, clock: FakeClock, *, in_flight: bool = True
) -> None:
    """One operation in each state of :data:`EVERY` (``in_flight`` optional)."""
    receiver.faults.fail_before_work(400, key=BAD.operation_id, retry_after=None, times=1)
    receiver.faults.fail_before_work(503, key=BUSY.operation_id, retry_after=None, times=None)
    receiver.faults.drop_after_commit(key=LOST.operation_id, times=1)
    for ref in (OK, BAD, BUSY, LOST, DARK):
        enqueue(ob, ref)
    ob.dispatch_once()  # ok, bad settle; lost unresolved; busy, dark retry
    clock.advance(PAST_BACKOFF_SECONDS)
    ob.dispatch_once()  # busy and dark spend their second attempt
    if in_flight:
        enqueue(ob, STUCK)
        crash_one_attempt(ob)
    # Nothing is dispatched after this point: these stay as they are.
    enqueue(ob, WAIT)
    enqueue(ob, CANCELLED)
    ob.reconcile.cancel(
        CANCELLED.operation_id, tenant=CANCELLED.tenant, note="customer withdrew the order"
    )
    for ref in EVERY if in_flight else tuple(r for r in EVERY if r is not STUCK):
        op = ob.get(ref.operation_id, tenant=ref.tenant)
        got = (op.state.value, op.reason.value if op.reason else None)
        assert got == (ref.state, ref.reason), (ref, got, op.attempts)


# -- raw reads: what is really in the tables ------------------------------------------


def table_rows(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of the three outbox tables, in id order (for before/after equality)."""
    with engine.connect() as conn:
        return {
            t.name: [tuple(r) for r in conn.execute(select(t).order_by(t.c.id))]
            for t in (operations, attempts, audit)
        }


def audit_rows(engine: Engine, operation_id: str | None = None) -> list[dict[str, Any]]:
    query = select(audit).order_by(audit.c.id)
    if operation_id is not None:
        query = query.where(audit.c.operation_id == operation_id)
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(query)]


def state_counts(engine: Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(operations.c.state, func.count()).group_by(operations.c.state)
        ).all()
    return {state: n for state, n in rows}


def attempt_count(engine: Engine, operation_ids: list[str] | None = None) -> int:
    query = select(func.count()).select_from(
        attempts.join(operations, attempts.c.operation_pk == operations.c.id)
    )
    if operation_ids is not None:
        query = query.where(operations.c.operation_id.in_(operation_ids))
    with engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def orphan_attempts(engine: Engine) -> int:
    """Attempt rows whose operation is gone (a purge must not leave any)."""
    with engine.connect() as conn:
        return int(
            conn.execute(
                select(func.count())
                .select_from(attempts)
                .where(~attempts.c.operation_pk.in_(select(operations.c.id)))
            ).scalar_one()
        )


# -- the application as the command line sees it (--app) -----------------------------


def app_env(db_url: str, receiver_url: str, offline_url: str, now_ms: int) -> dict[str, str]:
    cfg = {"db": db_url, "receiver_url": receiver_url, "offline_url": offline_url, "now": now_ms}
    return {APP_ENV: json.dumps(cfg)}


def cli_app() -> Outbox:
    """``--app`` target: the same endpoints, on a FakeClock set to the test's time."""
    cfg = json.loads(os.environ[APP_ENV])
    return make_outbox(
        cfg["db"], cfg["receiver_url"], cfg["offline_url"], FakeClock(start_ms=cfg["now"])
    )


# -- worlds: a database with an operation in every state --------------------------------


@dataclass
class World:
    ob: Outbox
    clock: FakeClock
    receiver: Receiver
    offline_url: str
    db_url: str

    def rows(self) -> dict[str, list[tuple[Any, ...]]]:
        return table_rows(self.ob.engine)

    def audit(self, operation_id: str | None = None) -> list[dict[str, Any]]:
        return audit_rows(self.ob.engine, operation_id)

    def outbox_at(self, now_ms: int) -> Outbox:
        """Another Outbox on the same database whose clock reads ``now_ms`` (close it)."""
        return make_outbox(self.db_url, self.receiver.url, self.offline_url, FakeClock(now_ms))


W = TypeVar("W", bound=World)


@contextmanager
def every_state_world(
    cls: type[W], db_url: str, receiver: Receiver, *, in_flight: bool = True, build: bool = True
) -> Iterator[W]:
    clock = real_now_clock()
    offline = closed_port_url()
    ob = make_outbox(db_url, receiver.url, offline, clock)
    try:
        if build:
            build_every_state(ob, receiver, clock, in_flight=in_flight)
        yield cls(ob, clock, receiver, offline, db_url)
    finally:
        ob.close()


@contextmanager
def database(kind: str, directory: Path) -> Iterator[str]:
    """A migrated, empty outbox database like conftest's ``db_url``, for wider scopes."""
    if kind == "sqlite":
        yield f"sqlite:///{directory / 'outbox.sqlite3'}"
        return
    from tests.conftest import POSTGRES_URL, require_postgres

    require_postgres()
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa_create_engine(POSTGRES_URL)
    try:
        with admin.begin() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        url = make_url(POSTGRES_URL).update_query_dict({"options": f"-csearch_path={schema}"})
        rendered = url.render_as_string(hide_password=False)
        engine = create_engine(rendered)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        yield rendered
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()


# The stable JSON shapes the CLI and the reports promise (manual, operators guide, "JSON shapes").
OPERATION_KEYS = {
    "tenant",
    "operation_id",
    "endpoint",
    "method",
    "path",
    "headers",
    "body",
    "body_view",  # the body as the receiver gets it (JSON, form fields, raw summary)
    "state",
    "reason",
    "ordering_key",
    "priority",
    "not_before",
    "deliver_within_ms",  # the operation's own business deadline, or None
    "deliver_by",
    "attempts_counted",
    "attempts_total",
    "attempts_in_progress",
    "last_error",
    "created_at",
    "updated_at",
    "next_attempt_at",
    "first_attempt_at",
    "version",
    "result",
}
#: `reconcile list --json`: one page of operation objects and the total matching.
LIST_KEYS = {"total", "limit", "offset", "operations"}
#: `audit --json`: one page of audit entries and the total matching.
AUDIT_PAGE_KEYS = {"total", "limit", "offset", "entries"}
AUDIT_ENTRY_KEYS = {
    "tenant",
    "operation_id",
    "at",
    "actor",
    "action",
    "from_state",
    "to_state",
    "note",
    "details",
}
REPORT_KEYS = OPERATION_KEYS | {"explanation", "blocked_by", "requeue_risk", "attempts", "audit"}
ATTEMPT_KEYS = {
    "number",
    "request_id",
    "dispatcher_id",
    "started_at",
    "finished_at",
    "delivery",
    "verdict",
    "counted",
    "status",
    "receiver_request_id",
    "error_class",
    "error_message",
    "duration_ms",
    "description",
}
AUDIT_KEYS = {"at", "actor", "action", "from_state", "to_state", "note", "details"}
STATUS_KEYS = {
    "counts",
    "oldest_pending_age_seconds",
    "reconciliation_backlog",
    "unresolved_by_reason",
    "attempts_last_hour",
    "keys_near_expiry",
    "keys_expired",
    "figures",
    "problems",
    "ok",
    "dispatchers",
    "live_dispatchers",
    "endpoints",
    "due",
    "unsendable",
    "attempts_last_hour_by_outcome",
    "endpoint_states",  # each endpoint's circuit and pause, in detail (store.endpoints)
}
