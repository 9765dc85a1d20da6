"""The overview's two history charts (issue 29): the reconciliation queue's size over
the last hour and each endpoint's attempt latency. One database with known rows (a
real SQLite file and a real PostgreSQL schema): the library's figures
(:mod:`outbox.reconcile.history`) are checked against what the rows say, then the
console's SVG against the library's figures."""

from __future__ import annotations

import re
import uuid

from sqlalchemy import insert, select
from starlette.testclient import TestClient

from outbox import Endpoint, FakeClock, Outbox
from outbox.console import Credentials, create_app
from outbox.reconcile.history import endpoint_latency, queue_history
from outbox.store.engine import create_engine
from outbox.store.migrate import upgrade
from outbox.store.tables import attempts, audit, operations

T0 = 1_800_000_000_000
MIN = 60_000
SINCE = T0 - 60 * MIN
TOKEN = "alice-" + "a" * 20


def _op(op_id: str, state: str, updated_at: int, endpoint: str = "payments") -> dict[str, object]:
    return {"tenant": "acme", "operation_id": op_id, "endpoint": endpoint, "method": "POST",
            "path": "/pay", "headers": "{}", "args_sha256": "x", "state": state,
            "reason": "retries_exhausted" if state == "unresolved" else None,
            "created_at": T0 - 180 * MIN, "updated_at": updated_at}  # fmt: skip


def _build(url: str) -> None:
    engine = create_engine(url)
    upgrade(engine)
    with engine.begin() as conn:
        conn.execute(insert(operations), [
            _op("a", "unresolved", T0 - 50 * MIN),  # entered 50 min ago
            _op("b", "unresolved", T0 - 10 * MIN - 30_000),  # 10.5 min ago
            _op("c", "unresolved", T0 - 120 * MIN),  # before the hour
            _op("d", "failed", T0 - 20 * MIN),  # in the queue from -40 to -20 min
            _op("e", "pending", T0 - 30 * MIN),  # requeued at -30, never attempted
            _op("l", "succeeded", T0 - 5 * MIN, endpoint="ledger"),
        ])  # fmt: skip
        pk = dict(conn.execute(select(operations.c.operation_id, operations.c.id)).all())
        conn.execute(insert(audit), [
            {"tenant": "acme", "operation_id": "d", "actor": "bob", "action": "resolve",
             "from_state": "unresolved", "to_state": "failed", "note": "n", "at": T0 - 20 * MIN},
            {"tenant": "acme", "operation_id": "e", "actor": "bob", "action": "requeue",
             "from_state": "unresolved", "to_state": "pending", "note": "n", "at": T0 - 30 * MIN},
            {"tenant": "@endpoint", "operation_id": "payments", "actor": "bob", "action": "pause",
             "from_state": "closed", "to_state": "paused", "note": "n", "at": T0 - 25 * MIN},
        ])  # fmt: skip

        def attempt(op: str, number: int, started: int, duration: int | None) -> dict[str, object]:
            return {"operation_pk": pk[op], "number": number, "request_id": str(uuid.uuid4()),
                    "dispatcher_id": "d-1", "lease_token": "t", "started_at": started,
                    "lease_until": started + MIN,
                    "finished_at": None if duration is None else started + duration,
                    "delivery": None if duration is None else "delivered",
                    "verdict": None if duration is None else "retry",
                    "duration_ms": duration}  # fmt: skip

        rows = [attempt("d", 1, T0 - 40 * MIN - 4000, 4000)]  # ended at -40 min: d's entry
        rows += [attempt("a", i, T0 - 55 * MIN + i * 1000, 20) for i in range(1, 91)]
        rows += [attempt("b", i, T0 - 15 * MIN + i * 1000, 300) for i in range(1, 10)]
        rows += [attempt("l", 1, T0 - 6 * MIN, 7), attempt("l", 2, T0 - 5 * MIN, None)]
        rows += [attempt("c", 1, T0 - 125 * MIN, 9000)]  # outside the hour
        conn.execute(insert(attempts), rows)
    engine.dispose()


def _expected_sizes() -> list[int]:
    sizes = []
    for i in range(60):
        n = 1  # c, all along
        n += i >= 10  # a entered in minute 10
        n += i >= 49  # b entered in minute 49
        n += 19 <= i <= 38  # d: entered at -40 (end of minute 19), left at -20 (minute 40)
        n += i <= 28  # e: never attempted, counted from the hour's start; left at -30
        sizes.append(n)
    return sizes


def test_queue_history_and_latency_follow_the_rows(db_url: str) -> None:
    _build(db_url)
    with Outbox(db_url, clock=FakeClock(T0)) as ob:
        ob.register(Endpoint(name="mail", base_url="http://127.0.0.1:9"))
        history = queue_history(ob, now_ms=T0)
        latency = {e.endpoint: e for e in endpoint_latency(ob, now_ms=T0)}
        queue_now = ob.reconcile.status().figures.reconciliation_queue
    assert history.sizes == _expected_sizes()
    assert history.sizes[-1] == queue_now == 3
    pay = latency["payments"]
    # 91 attempts of a/b/d in the hour: 90 x 20 ms, 9 x 300 ms and d's 4,000 ms.
    assert (pay.count, pay.max_ms, pay.mean_ms) == (100, 4000, 85.0)
    assert (pay.p50_ms, pay.p95_ms, pay.p99_ms) == (25, 500, 500)
    # The open attempt (no duration yet) is not counted; 7 ms is under its bucket's 10.
    assert latency["ledger"].as_dict() | {"buckets": None} == {
        "endpoint": "ledger", "count": 1, "mean_ms": 7.0, "max_ms": 7, "p50_ms": 7,
        "p95_ms": 7, "p99_ms": 7, "buckets": None,
    }  # fmt: skip
    assert latency["mail"].count == 0  # registered, no attempt: named with 0


def test_the_overview_draws_the_librarys_figures(db_url: str) -> None:
    _build(db_url)
    creds = Credentials.parse(f"alice:{TOKEN}\n", default_name="x", source="test")
    with Outbox(db_url, clock=FakeClock(T0)) as ob:
        c = TestClient(create_app(ob, creds), base_url="http://127.0.0.1")
        c.post("/login", data={"token": TOKEN}, follow_redirects=False)
        page = c.get("/").text
        history = queue_history(ob, now_ms=T0)
        latency = endpoint_latency(ob, now_ms=T0)
    sizes = re.search(r'data-chart="queue-size" data-sizes="([0-9,]+)" data-now="(\d+)"', page)
    assert sizes and [int(n) for n in sizes.group(1).split(",")] == history.sizes
    assert int(sizes.group(2)) == 3
    drawn = re.findall(
        r'<g data-endpoint="([^"]+)" data-count="(\d+)" data-p50="(\d+)" data-p95="(\d+)" '
        r'data-p99="(\d+)"',
        page,
    )
    assert drawn == [
        (e.endpoint, str(e.count), str(e.p50_ms), str(e.p95_ms), str(e.p99_ms))
        for e in latency
        if e.count
    ]
    assert [d[0] for d in drawn] == ["ledger", "payments"]
